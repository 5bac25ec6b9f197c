"""ReSprop backward (torch path) against the exact backward and a direct reference of the approximation."""
from __future__ import annotations

import copy
import math
from fractions import Fraction

import pytest
import torch
from torch import nn

from sebp_kernels import ReSpropLinear, SEBPConfig, SEBPLinear, resprop_grads, reuse_drop
from sebp_kernels.resprop import align, reuse_source
from tests.helpers import assert_close_report, assert_within_torch_error, dense_grads

# (B, T, in, out): none a multiple of a block size, plus one position and one sample.
SHAPES = [(3, 7, 5, 6), (1, 13, 9, 4), (4, 1, 3, 17), (2, 33, 65, 31)]


def _inputs(b, t, n_in, n_out, seed=0, lengths=None, dtype=torch.float32):
    """x, w, bias, dY with right padding (``lengths`` real positions per sample) and a zero row inside."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, n_in, generator=g)
    w = torch.randn(n_out, n_in, generator=g) / n_in**0.5
    bias = torch.randn(n_out, generator=g)
    dy = torch.randn(b, t, n_out, generator=g) * torch.logspace(-2, 0, b * t)[torch.randperm(b * t, generator=g)
                                                                             ].view(b, t, 1)
    lengths = lengths or [max(1, t - 2 * i) for i in range(b)]
    for i, n in enumerate(lengths):
        dy[i, n:] = 0
    if t > 2:
        dy[0, 1] = 0  # a row no loss reaches, among real positions
    return x.to(dtype), w.to(dtype), bias.to(dtype), dy.to(dtype)


def reference(dy, x, w, p, reuse):
    """dX, dW of a dense backward on the approximated dY = A (P + D_kept), built row by row in float64."""
    dy, x, w = dy.double(), x.double(), w.double()
    b, t, n_out = dy.shape
    active = (dy != 0).any(-1)  # NaN != 0
    pa = torch.zeros(t, n_out, dtype=torch.float64)
    n = min(t, p.shape[0])
    pa[:n] = p[:n].double()
    d = (dy - active[..., None] * pa).reshape(-1, n_out)
    flat = active.reshape(-1).tolist()
    norms = [float(torch.linalg.vector_norm(r)) for r in d]
    score = [(math.inf if not math.isfinite(s) else s) if a else -1.0 for s, a in zip(norms, flat)]
    order = sorted(range(len(score)), key=lambda i: (-score[i], i))
    k = math.ceil((1 - Fraction(str(reuse))) * sum(flat))
    kept = torch.zeros(len(score), dtype=torch.bool)
    kept[order[:k]] = True
    kept |= torch.tensor([s == math.inf for s in score])
    g = active[..., None] * pa + (d * kept[:, None]).view(b, t, n_out)
    return g @ w, g.reshape(-1, n_out).t() @ x.reshape(-1, x.shape[-1]), kept


@pytest.mark.parametrize("b,t,n_in,n_out", SHAPES)
@pytest.mark.parametrize("reuse", [0.3, 0.5, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("p_len", ["shorter", "same", "longer"])
def test_formula_matches_direct_reference(b, t, n_in, n_out, reuse, p_len):
    x, w, _, dy = _inputs(b, t, n_in, n_out)
    tp = {"shorter": max(1, t - 3), "same": t, "longer": t + 4}[p_len]
    p = torch.randn(tp, n_out, generator=torch.Generator().manual_seed(1))
    p[tp // 2] = 0  # a position where P is unknown
    dx, dw, db, next_p = resprop_grads(dy, x, w, p, reuse)
    want_dx, want_dw, _ = reference(dy, x, w, p, reuse)
    scale = dy.abs().max() + p.abs().max()
    assert_close_report(dx, want_dx, atol=1e-5 * float(scale) * n_out**0.5, name="dX")
    assert_close_report(dw, want_dw, atol=1e-5 * float(scale) * (b * t) ** 0.5, name="dW")
    assert torch.equal(db, dy.reshape(-1, n_out).sum(0))
    assert (dx[(dy == 0).all(-1)] == 0).all(), "inactive rows got a gradient"
    assert next_p.shape == (t, n_out)


def test_float64_matches_direct_reference():
    """A float64 model: the row norms are taken in float64 (a float32 request on float64 input is an error)."""
    x, w, _, dy = (v.double() for v in _inputs(3, 7, 5, 6))
    p = torch.randn(7, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    dx, dw, _, next_p = resprop_grads(dy, x, w, p, 0.5)
    want_dx, want_dw, _ = reference(dy, x, w, p, 0.5)
    torch.testing.assert_close(dx, want_dx)
    torch.testing.assert_close(dw, want_dw)
    assert next_p.dtype == torch.float64
    drop = reuse_drop(dy, dy, levels=(0.5,))
    assert drop.residual >= 0


def test_reuse_zero_is_exact_sebp_and_dense():
    x, w, bias, dy = _inputs(3, 11, 9, 7)
    layers = {"resprop": ReSpropLinear.from_linear(_linear(w, bias), reuse=0.0),
              "sebp": SEBPLinear.from_linear(_linear(w, bias), SEBPConfig("exact"))}
    grads = {}
    for name, layer in layers.items():
        for _ in range(2):  # a second step, after which a P would exist
            grads[name] = _module_grads(layer, x, dy)
    want = dense_grads(x, w, bias, dy)
    ref = dense_grads(x, w, bias, dy, torch.float64)
    for got_r, got_s, t, r, name in zip(grads["resprop"], grads["sebp"], want, ref, ("dX", "dW", "db")):
        assert torch.equal(got_r, got_s), name
        assert_within_torch_error(got_r, r, t, torch.float32, name)
    assert layers["resprop"].resprop_state.p is None  # nothing to keep at reuse 0


def test_non_contiguous_inputs():
    """dY and X as attention hands them over (a transposed layout)."""
    x, w, _, dy = _inputs(3, 10, 8, 6)
    p = torch.randn(7, 6)
    dy_t, x_t = dy.transpose(0, 1).contiguous().transpose(0, 1), x.transpose(0, 1).contiguous().transpose(0, 1)
    assert not dy_t.is_contiguous() and not x_t.is_contiguous()
    got = resprop_grads(dy_t, x_t, w, p, 0.7)
    want = resprop_grads(dy, x, w, p, 0.7)
    for g, t in zip(got, want):
        assert torch.equal(g, t)


def test_everything_kept_equals_dense_to_rounding():
    """reuse just above 0 keeps every active row: P + (dY - P) = dY, to fp32 rounding."""
    x, w, _, dy = _inputs(4, 9, 12, 10)
    p = torch.randn(6, 10)
    dx, dw, db, _ = resprop_grads(dy, x, w, p, 1e-7)
    want = dense_grads(x, w, None, dy)
    ref = dense_grads(x, w, None, dy, torch.float64)
    for got, t, r, name in zip((dx, dw), want, ref, ("dX", "dW")):
        err = (got.double() - r).abs().max().item()
        assert err <= 4 * (t.double() - r).abs().max().item() + 1e-5, name


def test_kept_share_of_active_rows():
    x, w, _, dy = _inputs(2, 20, 4, 5, lengths=[20, 10])  # 30 real positions, one of them zero: 29 active
    p = torch.randn(20, 5)
    for reuse, k in ((0.5, 15), (0.9, 3), (0.99, 1), (1.0, 0)):
        *_, kept = reference(dy, x, w, p, reuse)
        assert int(kept.sum()) == k
        dx, *_ = resprop_grads(dy, x, w, p, reuse)
        assert_close_report(dx, reference(dy, x, w, p, reuse)[0], atol=1e-5)


@pytest.mark.parametrize("reuse", [0.5, 1.0])
def test_nan_and_inf_rows_are_always_kept(reuse):
    x, w, _, dy = _inputs(3, 8, 6, 5)
    dy[1, 2, 3] = float("nan")
    dy[2, 0, 1] = float("inf")
    p = torch.randn(8, 5)
    dx, dw, db, next_p = resprop_grads(dy, x, w, p, reuse)
    assert not torch.isfinite(dx[1, 2]).any() and not torch.isfinite(dx[2, 0]).all()
    assert not torch.isfinite(dw).all() and not torch.isfinite(db).all()
    want_dx, _, kept = reference(dy, x, w, p, reuse)
    assert kept.view(3, 8)[1, 2] and kept.view(3, 8)[2, 0]
    finite = torch.isfinite(dy).all(-1)
    assert_close_report(dx[finite], want_dx[finite], atol=1e-5, name="dX of finite rows")
    assert torch.isfinite(next_p).all(), "a non-finite row entered P"


def test_reuse_source_and_align():
    dy = torch.zeros(3, 5, 2)
    dy[0, :2] = 1.0
    dy[1, :4] = 2.0
    dy[2, :4] = 3.0  # ties with sample 1: the first wins
    dy[1, 3, 0] = float("nan")
    p = reuse_source(dy)
    assert torch.equal(p[:3], torch.full((3, 2), 2.0)) and (p[3:] == 0).all()
    assert torch.equal(align(p, 2), p[:2])
    assert torch.equal(align(p, 7), torch.cat([p, torch.zeros(2, 2)]))


def test_frozen_weight_and_no_bias():
    x, w, _, dy = _inputs(2, 6, 5, 4)
    layer = ReSpropLinear(5, 4, bias=False, reuse=0.5)
    layer.weight.data.copy_(w)
    layer.weight.requires_grad_(False)
    for _ in range(2):
        xg = x.clone().requires_grad_()
        p = layer.resprop_state.p
        layer(xg).backward(dy)
    want_dx, _, _ = reference(dy, x, w, p, 0.5)
    assert_close_report(xg.grad, want_dx, atol=1e-5)


def _linear(w, bias=None):
    lin = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None)
    with torch.no_grad():
        lin.weight.copy_(w)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


def _module_grads(layer, x, dy):
    layer.zero_grad(set_to_none=True)
    xg = x.clone().requires_grad_()
    layer(xg).backward(dy)
    return xg.grad, layer.weight.grad, layer.bias.grad


def test_module_steps_with_changing_lengths():
    """Each step uses the P of the step before, aligned by position; the first step is exact."""
    torch.manual_seed(0)
    layer = ReSpropLinear.from_linear(nn.Linear(7, 5), reuse=0.7)
    w = layer.weight.detach()
    prev = None
    for step, (t, lengths) in enumerate([(9, [9, 4, 6]), (5, [5, 5, 2]), (12, [3, 12, 7]), (12, [12, 12, 12])]):
        x, _, _, dy = _inputs(3, t, 7, 5, seed=step, lengths=lengths)
        dx, dw, db = _module_grads(layer, x, dy)
        if prev is None:
            want_dx, want_dw, _ = dense_grads(x, w, None, dy)
        else:
            want_dx, want_dw, _ = reference(dy, x, w, reuse_source(prev), 0.7)
        assert_close_report(dx, want_dx, atol=1e-5, name=f"step {step} dX")
        assert_close_report(dw, want_dw, atol=1e-5, name=f"step {step} dW")
        assert torch.equal(layer.resprop_state.p, reuse_source(dy))
        prev = dy
    assert layer.resprop_state.updates == 4


def test_state_resets_and_stays_untouched_outside_training():
    layer = ReSpropLinear.from_linear(nn.Linear(4, 3), reuse=0.9)
    state = layer.resprop_state
    x, _, _, dy = _inputs(2, 5, 4, 3)
    _module_grads(layer, x, dy)
    assert state.p is not None
    layer.train()  # no switch: P stays
    assert state.p is not None
    layer.eval()
    assert state.p is None
    _module_grads(layer, x, dy)  # eval: a plain linear, exact gradients, no state update
    assert state.p is None and state.updates == 0
    layer.train()
    with torch.no_grad():
        layer(x)
    assert state.p is None
    _module_grads(layer, x, dy)
    assert state.p is not None
    layer.load_state_dict(layer.state_dict())  # a resume
    assert state.p is None


def test_forward_before_reset_backward_after_is_exact_and_stores_nothing():
    layer = ReSpropLinear.from_linear(nn.Linear(4, 3), reuse=1.0)
    x, _, _, dy = _inputs(2, 5, 4, 3)
    _module_grads(layer, x, dy)
    xg = x.clone().requires_grad_()
    y = layer(xg)
    layer.reset_resprop()
    y.backward(dy)
    assert_close_report(xg.grad, dy @ layer.weight.detach(), atol=1e-6)
    assert layer.resprop_state.p is None


def test_dtype_change_is_exact():
    layer = ReSpropLinear.from_linear(nn.Linear(8, 6), reuse=1.0)
    x, _, _, dy = _inputs(2, 5, 8, 6)
    _module_grads(layer, x, dy)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # dY is bf16 now: the fp32 P does not apply
        xg = x.clone().requires_grad_()
        y = layer(xg)
    y.backward(dy.bfloat16())
    assert_close_report(xg.grad, (dy.bfloat16() @ layer.weight.detach().bfloat16()).float(), atol=1e-2)
    assert layer.resprop_state.p.dtype == torch.bfloat16


def test_two_dimensional_input_takes_the_exact_backward_and_keeps_p():
    """Rows without a position axis (a last layer's gathered rows) have no P to align: exact SEBP, P untouched."""
    dense = nn.Linear(4, 3)
    layer = ReSpropLinear.from_linear(copy.deepcopy(dense), reuse=0.9)
    x = torch.randn(6, 4)
    x[2] = 0.0
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    dy = torch.randn(6, 3)
    dy[4] = 0.0
    layer(x1).backward(dy)
    dense(x2).backward(dy)
    torch.testing.assert_close(x1.grad, x2.grad)
    torch.testing.assert_close(layer.weight.grad, dense.weight.grad)
    assert layer.resprop_state.p is None and layer.resprop_state.updates == 0


def test_from_linear_shares_parameters_and_keys():
    lin = nn.Linear(6, 5)
    keys = list(lin.state_dict())
    layer = ReSpropLinear.from_linear(lin, reuse=0.5)
    assert layer.weight is lin.weight and layer.bias is lin.bias
    assert list(layer.state_dict()) == keys
    back = layer.to_linear()
    assert type(back) is nn.Linear and back.weight is lin.weight and not hasattr(back, "reuse")
    copied = copy.deepcopy(layer)
    assert copied.resprop_state is not layer.resprop_state and copied.reuse == 0.5
    with pytest.raises(TypeError, match="plain nn.Linear"):
        ReSpropLinear.from_linear(SEBPLinear.from_linear(lin))
    for bad in (-0.1, 1.5, float("nan"), True, "0.9"):
        with pytest.raises(ValueError, match="reuse must be"):
            ReSpropLinear.from_linear(lin, reuse=bad)


def test_reuse_drop_statistic():
    dy = torch.zeros(2, 4, 3)
    dy[0] = torch.tensor([[1.0, 0, 0], [0, 2, 0], [0, 0, 3], [4, 0, 0]])
    dy[1, :2] = dy[0, :2] + 0.5  # sample 1: two real positions, each 0.5 off in every element
    same = reuse_drop(dy, dy)  # P = sample 0: D is zero on sample 0 and 0.5s on sample 1
    total = float(dy.norm())
    row = 0.5 * 3**0.5
    assert same.active_rows == 6
    assert same.residual == pytest.approx(2**0.5 * row / total)
    # 6 active rows: reuse 0.5 keeps 3 and 0.7 keeps 2 (both D rows), 0.9 and up keep 1 (one D row)
    assert same.dropped == pytest.approx([0, 0, row / total, row / total, row / total], rel=1e-6, abs=1e-12)
    # dropping the same counts of dY's own smallest rows
    y = sorted((float(r.norm()) for r in dy.reshape(-1, 3) if r.any()), reverse=True)
    want = [sum(v * v for v in y[k:]) ** 0.5 / total for k in (3, 2, 1, 1, 1)]
    assert same.topk_dropped == pytest.approx(want)
    assert reuse_drop(torch.zeros_like(dy), dy).residual == pytest.approx(1.0)
    dy[1, 0, 0] = float("nan")
    assert math.isnan(reuse_drop(dy, dy).residual)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reuse", [0.5, 0.9, 1.0])
def test_triton_path_matches_torch_path_on_gpu(dtype, reuse):
    """The same D and kept rows on the same device (so no rank flips at near-ties): the Triton products against
    torch's; fp32 also against the float64 reference."""
    x, w, _, dy = _inputs(8, 300, 256, 384, lengths=[300, 120, 77, 250, 1, 300, 64, 199])
    dy[3, 5, 7] = float("nan")
    p = torch.randn(260, 384)
    args = [t.cuda().to(dtype) for t in (dy, x, w, p)]
    got = resprop_grads(*args, reuse, backend="triton")
    want = resprop_grads(*args, reuse, backend="torch")
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for g, t, name in zip(got[:3], want[:3], ("dX", "dW", "db")):
        assert g.dtype == dtype and torch.isfinite(g).eq(torch.isfinite(t)).all(), name
        ok = torch.isfinite(t)
        scale = float(t[ok].abs().max())
        assert_close_report(g[ok].float().cpu(), t[ok].float().cpu(), atol=tol * scale, name=name)
    assert torch.equal(got[3], want[3])
    if dtype == torch.float32:
        ref_dx, _, _ = reference(dy, x, w, p, reuse)
        finite = torch.isfinite(dy).all(-1)
        assert_close_report(got[0].cpu()[finite], ref_dx[finite], atol=1e-4 * float(ref_dx[finite].abs().max()))
