"""benchmarks/resprop_variants.py: each ablation computes what it says, against direct references."""
from __future__ import annotations

import sys

import pytest
import torch

import sebp_kernels.resprop as R
from sebp_kernels import ReSpropLinear
from tests.helpers import load_benchmark


def _load():
    return sys.modules.get("resprop_variants") or load_benchmark("resprop_variants")


V = _load()


def _data(seed=0, b=4, t=9, n_in=6, n_out=5):
    g = torch.Generator().manual_seed(seed)
    x = [torch.randn(b, t, n_in, generator=g, dtype=torch.float64) for _ in range(2)]
    dy = [torch.randn(b, t, n_out, generator=g, dtype=torch.float64) for _ in range(2)]
    for d in dy:
        d[1, 6:] = 0  # right padding
        d[3, 4:] = 0
    w = torch.randn(n_out, n_in, generator=g, dtype=torch.float64)
    return x, dy, w


def _two_steps(name, reuse, seed=0, draw_seed=0):
    """(dX, dW) of the second of two ReSprop backwards under variant ``name``, and the data."""
    x, dy, w = _data(seed)
    layer = ReSpropLinear(w.shape[1], w.shape[0], bias=False, reuse=reuse, backend="torch").double()
    layer.weight.data.copy_(w)
    with V.variant(name, draw_seed):
        for i in range(2):
            layer.weight.grad = None
            xi = x[i].clone().requires_grad_()
            layer(xi).backward(dy[i])
    return xi.grad, layer.weight.grad, x, dy, w


def _rows_backward(dy, x, w, rows_dy):
    """dX, dW of a dense backward on rows_dy (B, T, out) standing for dY."""
    return rows_dy @ w, rows_dy.reshape(-1, w.shape[0]).t() @ x.reshape(-1, w.shape[1])


def test_sample_is_the_product_rule():
    dx, dw, x, dy, w = _two_steps("sample", 0.5)
    layer = ReSpropLinear(w.shape[1], w.shape[0], bias=False, reuse=0.5, backend="torch").double()
    layer.weight.data.copy_(w)
    for i in range(2):
        layer.weight.grad = None
        xi = x[i].clone().requires_grad_()
        layer(xi).backward(dy[i])
    torch.testing.assert_close(dx, xi.grad)
    torch.testing.assert_close(dw, layer.weight.grad)


def test_none_keeps_the_largest_rows_of_dy():
    reuse = 0.75
    dx, dw, x, dy, w = _two_steps("none", reuse)
    d = dy[1].reshape(-1, w.shape[0])
    active = d.any(1)
    k = int(R.kept_count(reuse, active))
    norms = d.norm(dim=1).masked_fill(~active, -1)
    kept = torch.zeros_like(active)
    kept[norms.topk(k).indices] = True
    ex_dx, ex_dw = _rows_backward(dy[1], x[1], w, (d * kept.unsqueeze(1)).view_as(dy[1]))
    torch.testing.assert_close(dx, ex_dx)
    torch.testing.assert_close(dw, ex_dw)


def test_mean_source_averages_active_samples():
    _, dy, _ = _data()
    p = V.mean_source(dy[0])
    active = dy[0].any(-1)
    for t in range(dy[0].shape[1]):
        rows = dy[0][active[:, t], t]
        torch.testing.assert_close(p[t], rows.mean(0))
    bad = dy[0].clone()
    bad[0, 2, 1] = float("nan")
    assert torch.equal(V.mean_source(bad)[2], torch.zeros_like(bad[0, 2]))


def test_mean_variant_reuses_the_batch_mean():
    reuse = 0.5
    dx, dw, x, dy, w = _two_steps("mean", reuse)
    ex = R.resprop_grads(dy[1], x[1], w, V.mean_source(dy[0]), reuse, "torch")
    torch.testing.assert_close(dx, ex[0])
    torch.testing.assert_close(dw, ex[1])


def test_fit_scale_is_the_least_squares_factor():
    _, dy, _ = _data()
    active = dy[1].any(-1, keepdim=True)
    p = R.reuse_source(dy[0])
    pa = p * active
    expected = float((dy[1] * pa).sum() / pa.square().sum())
    assert float(V.fit_scale(dy[1], p)) == pytest.approx(min(max(expected, 0), 1))
    # P = 2 * (one sample's dY), and every sample the same: alpha = 1/2 exactly
    same = dy[1][0].expand_as(dy[1]).clone()
    assert float(V.fit_scale(same, 2 * dy[1][0])) == pytest.approx(0.5)
    assert float(V.fit_scale(same, -dy[1][0])) == 0  # anti-correlated: clipped
    assert float(V.fit_scale(same, torch.zeros_like(dy[1][0]))) == 0  # no P to fit


def test_fitted_variant_scales_p():
    reuse = 0.5
    dx, dw, x, dy, w = _two_steps("fitted", reuse)
    p = R.reuse_source(dy[0])
    ex = R.resprop_grads(dy[1], x[1], w, p * V.fit_scale(dy[1], p), reuse, "torch")
    torch.testing.assert_close(dx, ex[0])
    torch.testing.assert_close(dw, ex[1])


def test_sampled_is_unbiased_and_keeps_about_the_count():
    reuse = 0.75
    x, dy, w = _data()
    exact_dx, exact_dw = _rows_backward(dy[1], x[1], w, dy[1])
    d = dy[1].reshape(-1, w.shape[0])
    active = d.any(1)
    k = int(R.kept_count(reuse, active))
    keep_mask = V.sampled_keep(torch.Generator().manual_seed(0))
    counts, est = [], torch.zeros_like(d)
    n = 4000
    for _ in range(n):
        d2 = d.clone()
        keep = keep_mask(d2, active, reuse)
        assert not (keep & ~active).any()
        counts.append(int(keep.sum()))
        est += d2 * keep.unsqueeze(1)
    est /= n
    assert sum(counts) / n == pytest.approx(k, rel=0.05)
    torch.testing.assert_close(est, d, atol=0.15, rtol=0.1)  # the mean of the estimates -> dY
    dx, dw, *_ = _two_steps("sampled", reuse, draw_seed=1)
    assert not torch.allclose(dx, exact_dx)  # one draw is an estimate, not the exact gradient
    assert torch.isfinite(dw).all()


def test_context_restores_and_errors():
    saved = (R.reuse_source, R.keep_mask, R.resprop_grads)
    for name in V.VARIANTS:
        with V.variant(name):
            pass
        assert (R.reuse_source, R.keep_mask, R.resprop_grads) == saved
    with pytest.raises(ValueError, match="unknown ReSprop variant"):
        with V.variant("other"):
            pass
    assert V.parse("0.9") == ("0.9", "sample")
    assert V.parse("0.9:none") == ("0.9", "none")
    for bad in ("dense:none", "0.9:x", "1.5", "abc"):
        with pytest.raises(SystemExit):
            V.parse(bad)


def _load_cpu_script():
    return load_benchmark("resprop_cpu")


def test_cpu_script_levels_and_labels():
    cpu = _load_cpu_script()
    assert cpu.parse_levels("dense, 0.9,0.9:none") == ["dense", "0.9", "0.9:none"]
    assert [cpu.label(v) for v in ("dense", "0.5", "0.9:sampled")] == ["dense", "reuse 0.5", "reuse 0.9 (sampled)"]
    with pytest.raises(SystemExit, match="unknown ReSprop variant"):
        cpu.parse_levels("dense,0.9:best")


@pytest.mark.slow
def test_cpu_script_runs_variants(tmp_path):
    """A tiny run: every variant trains, and reuse 0 equals dense (the variants do not leak out of their run)."""
    cpu = _load_cpu_script()
    out = tmp_path / "v.json"
    res = cpu.main(["--train-samples", "32", "--eval-samples", "8", "--epochs", "1", "--batch", "8",
                    "--levels", "dense,0.9:mean,0.9:sampled,0", "--drop-steps", "0", "--output", str(out)])
    levels = res["levels"]
    assert list(levels) == ["dense", "0.9:mean", "0.9:sampled", "0"]
    assert levels["0.9:sampled"]["variant"] == "sampled" and levels["dense"]["variant"] is None
    assert levels["0"]["step_loss"] == pytest.approx(levels["dense"]["step_loss"], rel=1e-5)  # exact, to rounding
    # the first backward has no P (exact): the first two losses agree, the third follows a reuse backward
    mean, dense = levels["0.9:mean"]["step_loss"], levels["dense"]["step_loss"]
    assert mean[:2] == pytest.approx(dense[:2], rel=1e-5)
    assert mean[2:] != pytest.approx(dense[2:], rel=1e-3)
    assert out.exists() and out.with_suffix(".png").exists()
    assert (R.reuse_source, R.keep_mask) == (V.R.reuse_source, V.R.keep_mask)
