"""Sampled mode (sebp_kernels.sampling): unbiased against dense, exact at budget 1, NaN/Inf rows kept, draws that
reproduce and resume, a cutoff that meets its budget, bad settings refused."""
from __future__ import annotations

import random

import pytest
import torch

from sebp_kernels import SEBPConfig, SEBPLinear, sebp_linear
from sebp_kernels.reference import sebp_backward_torch
from sebp_kernels.sampling import (GRID, SampleState, _signed, keep_probabilities, layer_key, mix64, mix64_int,
                                   row_draws, sampled_backward_torch, solve_tau)
from tests.helpers import dense_grads


def _skewed(m=96, n=8, k=12, zero_every=5, dtype=torch.float64, power=4, floor=0.0):
    """x, W, b and a dY whose row norms spread over decades (a few large rows, a long tail), some rows zero."""
    x = torch.randn(m, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype)
    b = torch.randn(n, dtype=dtype)
    dy = torch.randn(m, n, dtype=dtype) * (torch.rand(m, 1, dtype=dtype) ** power + floor)
    dy[::zero_every] = 0
    return x, w, b, dy


def test_hash_matches_python_oracle():
    rng = random.Random(0)
    vals = [0, 1, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1] + [rng.getrandbits(64) for _ in range(200)]
    got = mix64(torch.tensor([_signed(v) for v in vals], dtype=torch.int64))
    assert [g & (2 ** 64 - 1) for g in got.tolist()] == [mix64_int(v) for v in vals]


def test_draws_are_uniform_on_the_grid_and_depend_on_every_input():
    d = row_draws(3, 7, 11, 200_000)
    assert d.dtype == torch.int64 and int(d.min()) >= 0 and int(d.max()) < GRID
    u = d.double() / GRID
    assert abs(u.mean().item() - 0.5) < 0.003 and abs(u.var().item() - 1 / 12) < 0.002
    base = row_draws(3, 7, 11, 64)
    for other in (row_draws(4, 7, 11, 64), row_draws(3, 8, 11, 64), row_draws(3, 7, 12, 64)):
        assert (other != base).float().mean() > 0.9
    assert torch.equal(row_draws(3, 7, 11, 64), base)


@pytest.mark.slow
@pytest.mark.parametrize("sample_dx", [False, True])
def test_mean_over_draws_is_the_dense_gradient(sample_dx):
    """Over 2000 draws (the same dY, the layer's counter advancing) the mean of the sampled dW, db (and dX with
    sample_dx) is the dense gradient within its standard error. The SE is the estimator's own (rows independent:
    Var = sum_i g_i^2 (1 - q_i) / q_i), and the draws' sample variance must agree with it (independent draws)."""
    # with sample_dx each row of dX is one row of dY: no row so rare that 2000 draws may never keep it
    x, w, b, dy = _skewed(power=2, floor=0.05) if sample_dx else _skewed()
    dx_ref, dw_ref, db_ref = dense_grads(x, w, b, dy)
    cfg = SEBPConfig("sampled", budget=0.3, sample_dx=sample_dx, seed=5)
    state = SampleState(layer_key=9)
    draws = 2000
    acc = {"dx": [], "dw": [], "db": []}
    for _ in range(draws):
        dx, dw, db = sampled_backward_torch(dy, x, w, cfg, state)
        acc["dx"].append(dx), acc["dw"].append(dw), acc["db"].append(db)
    c = state.counts()
    assert 0.26 < c["kept"] / c["nonzero"] < 0.36, c  # it did sample: most rows left out of dW
    q = keep_probabilities(torch.linalg.vector_norm(dy.float(), dim=1), state.tau).double()
    odds = torch.where(dy.any(1), (1 - q) / q, torch.zeros_like(q))  # (1 - q) / q per row, 0 for zero rows
    var = {"dw": (dy ** 2).t() @ (x ** 2 * odds[:, None]), "db": (dy ** 2 * odds[:, None]).sum(0),
           "dx": (dy @ w) ** 2 * odds[:, None]}
    refs = {"dw": dw_ref, "db": db_ref, "dx": dx_ref}
    zs, ratios = [], []
    for name in ("dw", "db", "dx") if sample_dx else ("dw", "db"):
        s = torch.stack(acc[name])
        noisy = var[name] > 0
        assert torch.allclose(s.mean(0)[~noisy], refs[name][~noisy], atol=1e-12), name  # rows always kept
        zs.append(((s.mean(0) - refs[name]) / (var[name] / draws).sqrt())[noisy])
        ratios.append((s.var(0) / var[name])[noisy])
    z, ratio = torch.cat(zs), torch.cat(ratios)
    assert z.abs().max() < 4.5, z.abs().max().item()
    assert 0.5 < (z ** 2).mean() < 1.8, (z ** 2).mean().item()
    assert 0.85 < ratio.mean() < 1.15, ratio.mean().item()
    if not sample_dx:  # dX exact over the non-zero rows, every draw
        assert all(torch.allclose(d, dx_ref, atol=1e-12) for d in acc["dx"][:20])


def test_dropping_without_rescale_would_be_caught():
    """The statistic above detects a biased estimator: the same draws without the 1/q rescale miss dW."""
    x, w, b, dy = _skewed()
    _, dw_ref, _ = dense_grads(x, w, b, dy)
    tau = solve_tau(torch.linalg.vector_norm(dy.float(), dim=1), 0.3)
    q = keep_probabilities(torch.linalg.vector_norm(dy.float(), dim=1), tau).double()
    s = torch.stack([(dy * (row_draws(0, 0, t, dy.shape[0]) < q * GRID)[:, None]).t() @ x for t in range(2000)])
    z = (s.mean(0) - dw_ref).abs() / (s.std(0) / 2000 ** 0.5).clamp(min=1e-300)
    assert z.max() > 10


@pytest.mark.parametrize("sample_dx", [False, True])
def test_budget_one_is_exact_mode_bit_for_bit(sample_dx):
    x, w, b, dy = _skewed(dtype=torch.float32)
    exact = sebp_backward_torch(dy, x, w, SEBPConfig("exact"))
    state = SampleState(1)
    for _ in range(3):
        got = sampled_backward_torch(dy, x, w, SEBPConfig("sampled", budget=1.0, sample_dx=sample_dx), state)
        for g, e in zip(got, exact):
            assert torch.equal(g, e)
    c = state.counts()
    assert c["kept"] == c["nonzero"] == 3 * int(dy.any(1).sum()) and float(state.tau) == 0.0


def test_warmup_backwards_are_exact_then_sampling_starts():
    x, w, b, dy = _skewed(dtype=torch.float32)
    exact = sebp_backward_torch(dy, x, w, SEBPConfig("exact"))
    cfg, state = SEBPConfig("sampled", budget=0.2, warmup=2), SampleState(1)
    for _ in range(2):
        assert all(torch.equal(g, e) for g, e in zip(sampled_backward_torch(dy, x, w, cfg, state), exact))
    assert state.counts()["rows"] == 0 and state.tau is not None and float(state.tau) > 0
    _, dw, _ = sampled_backward_torch(dy, x, w, cfg, state)
    assert not torch.equal(dw, exact[1]) and state.counts()["kept"] < state.counts()["nonzero"]


def test_nan_and_inf_rows_are_always_kept():
    x, w, b, dy = _skewed(dtype=torch.float32)
    dy[3] = 0
    dy[3, 1] = float("nan")
    dy[7] = 1e-30
    dy[7, 2] = float("inf")
    cfg, state = SEBPConfig("sampled", budget=0.05), SampleState(2)
    for _ in range(20):
        dx, dw, db = sampled_backward_torch(dy, x, w, cfg, state)
        assert torch.isnan(dw[1]).all() and torch.isnan(db[1]) and torch.isinf(dw[2]).any()
    assert torch.isfinite(state.tau)
    norms = torch.linalg.vector_norm(dy.float(), dim=1)
    q = keep_probabilities(norms, state.tau)
    assert q[3] == 1 and q[7] == 1


def test_same_seed_same_bits_and_resume_continues_the_draws():
    x, w, b, dy = _skewed(dtype=torch.float32)
    cfg = SEBPConfig("sampled", budget=0.3, seed=11)
    one, two = SampleState(4), SampleState(4)
    first = [sampled_backward_torch(dy * (1 + t), x, w, cfg, one)[1] for t in range(6)]
    again = [sampled_backward_torch(dy * (1 + t), x, w, cfg, two)[1] for t in range(3)]
    saved = two.state_dict()
    resumed = SampleState(4)
    resumed.load_state_dict(saved)
    again += [sampled_backward_torch(dy * (1 + t), x, w, cfg, resumed)[1] for t in range(3, 6)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert resumed.counts() == one.counts()
    other = sampled_backward_torch(dy, x, w, SEBPConfig("sampled", budget=0.3, seed=12), SampleState(4))[1]
    assert not torch.equal(other, first[0])


@pytest.mark.parametrize("budget", [0.1, 0.3, 0.5])
def test_cutoff_adapts_to_the_budget(budget):
    m, n, k = 512, 16, 8
    x, w = torch.randn(m, k), torch.randn(n, k)
    cfg, state = SEBPConfig("sampled", budget=budget), SampleState(3)
    gen = torch.Generator().manual_seed(1)
    for t in range(60):  # a fixed distribution of dY: heavy-tailed row scales, a fifth of the rows zero
        dy = torch.randn(m, n, generator=gen) * torch.rand(m, 1, generator=gen) ** 3
        dy[torch.rand(m, generator=gen) < 0.2] = 0
        if t == 10:
            state._stats = None  # measure after the first steps only
        sampled_backward_torch(dy, x, w, cfg, state)
    c = state.counts()
    assert abs(c["kept"] / c["nonzero"] - budget) < 0.03, c


def test_solve_tau_meets_the_target_share():
    wts = torch.rand(1000) ** 5
    wts[:100] = 0
    for budget in (0.05, 0.3, 0.9):
        tau = solve_tau(wts, budget)
        share = (wts[wts > 0] / tau).clamp(max=1).mean().item()
        assert budget <= share < budget + 0.005
    assert float(solve_tau(wts, 1.0)) == 0.0 and float(solve_tau(torch.zeros(5), 0.3)) == 0.0


def test_through_the_module_and_autograd():
    lin = torch.nn.Linear(12, 8)
    m = SEBPLinear.from_linear(lin, SEBPConfig("sampled", budget=0.5), sample_key=layer_key("a.q_proj"))
    assert m._sebp_sampler.layer_key == layer_key("a.q_proj") != layer_key("a.k_proj")
    x = torch.randn(4, 16, 12, requires_grad=True)
    m(x).pow(2).sum().backward()
    assert m.weight.grad is not None and x.grad.shape == x.shape and m._sebp_sampler.calls == 1
    assert "budget=0.5" in repr(m)
    with pytest.raises(ValueError, match="SampleState"):
        sebp_linear(x, lin.weight, lin.bias, SEBPConfig("sampled", budget=0.5)).sum().backward()


@pytest.mark.parametrize("kwargs, msg", [
    ({"mode": "sampled"}, "budget in \\(0, 1\\]"),
    ({"mode": "sampled", "budget": 0.0}, "budget in \\(0, 1\\]"),
    ({"mode": "sampled", "budget": 1.5}, "budget in \\(0, 1\\]"),
    ({"mode": "sampled", "budget": float("nan")}, "budget in \\(0, 1\\]"),
    ({"mode": "exact", "budget": 0.3}, "belong to sampled mode"),
    ({"mode": "sampled", "budget": 0.3, "warmup": -1}, "warmup"),
])
def test_bad_settings_are_refused(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        SEBPConfig(**kwargs)


def test_config_round_trips():
    c = SEBPConfig("sampled", budget=0.3, sample_dx=True, seed=4, warmup=7)
    assert SEBPConfig.from_dict(c.to_dict()) == c
    assert SEBPConfig.from_dict(c.to_dict()).op_key == c.op_key
    import copy
    import pickle

    assert pickle.loads(pickle.dumps(c)) == c and copy.deepcopy(c) == c
    assert "budget" not in SEBPConfig().to_dict()


@pytest.mark.slow
def test_compiled_layer_draws_the_same_rows_as_eager():
    """Under torch.compile the layer's backward is the sebp::linear_backward operator, which reads the layer's
    SampleState when it runs: the same draws, cutoffs and bits as the eager layer."""
    lin = torch.nn.Linear(12, 8)
    m = SEBPLinear.from_linear(lin, SEBPConfig("sampled", budget=0.5), sample_key=3)
    ref = SEBPLinear.from_linear(torch.nn.Linear(12, 8), SEBPConfig("sampled", budget=0.5), sample_key=3)
    ref.weight = torch.nn.Parameter(lin.weight.detach().clone())
    ref.bias = torch.nn.Parameter(lin.bias.detach().clone())
    f = torch.compile(m, backend="aot_eager", fullgraph=True)
    for _ in range(3):
        x = torch.randn(4, 16, 12)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        f(x1).pow(3).sum().backward()
        ref(x2).pow(3).sum().backward()
        assert torch.equal(m.weight.grad, ref.weight.grad) and torch.equal(x1.grad, x2.grad)
        m.weight.grad = ref.weight.grad = None
    assert m._sebp_sampler.calls == 3 and m._sebp_sampler.counts() == ref._sebp_sampler.counts()
