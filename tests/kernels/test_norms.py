"""SEBP LayerNorm / RMSNorm: forward identical to the module replaced, backward equal to dense autograd.

The same checks run on the torch path (plain run) and on the Triton kernel under the interpreter (one
pytest subprocess with TRITON_INTERPRET=1, see tests/helpers.py); fp32 and fp16 there, bf16 on the torch path.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sebp_kernels import SEBPConfig, SEBPNorm, sebp_layer_norm, sebp_rms_norm
from sebp_kernels.reference import norm_backward_torch
from tests.helpers import assert_within_torch_error

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32, torch.float16] if INTERPRET else [torch.float32, torch.bfloat16]
SHAPES = [(3, 37, 50), (2, 8, 16), (1, 5, 130)]  # (batch, seq, features): awkward widths


def _rows_zeroed(shape, dtype, seed):
    """A dL/dY with zero rows (right padding in every sequence, a whole zero sequence) and one NaN row."""
    g = torch.Generator().manual_seed(seed)
    gy = torch.randn(*shape, generator=g)
    gy[:, shape[1] // 2:] = 0
    gy[-1] = 0
    return gy.to(dtype)


class HFLikeRMSNorm(nn.Module):
    """The Llama RMSNorm formula, as in transformers (the test must not need the class itself)."""

    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.variance_epsilon = eps

    def forward(self, h):
        dt = h.dtype
        h = h.to(torch.float32)
        var = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(var + self.variance_epsilon)
        return self.weight * h.to(dt)


HFLikeRMSNorm.__name__ = "LlamaRMSNorm"  # what SEBPNorm recognises


def _grads(fn, inputs, gy):
    for t in inputs:
        t.grad = None
    out = fn(*inputs)
    out.backward(gy)
    return out.detach(), [t.grad.detach().clone() for t in inputs]


def _leafs(shape, dtype, seed, rms):
    g = torch.Generator().manual_seed(seed + 1)
    n = shape[-1]
    x = (torch.randn(*shape, generator=g) * 2 + 0.5).to(dtype).requires_grad_()
    w = (torch.randn(n, generator=g)).to(dtype).requires_grad_()
    if rms:
        return [x, w]
    return [x, w, torch.randn(n, generator=g).to(dtype).requires_grad_()]


def _dense(rms, eps):
    if rms:  # HFLikeRMSNorm.forward with w as its weight
        return lambda x, w: w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, eps)


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_backward_matches_dense(shape, dtype, rms):
    eps = 1e-5
    gy = _rows_zeroed(shape, dtype, seed=sum(shape))
    leafs = _leafs(shape, dtype, seed=sum(shape), rms=rms)
    sebp = (lambda x, w: sebp_rms_norm(x, w, eps)) if rms else (lambda x, w, b: sebp_layer_norm(x, (shape[-1],), w, b, eps))
    out, got = _grads(sebp, leafs, gy)
    out_d, want = _grads(_dense(rms, eps), leafs, gy)
    assert torch.equal(out, out_d)  # the forward is the dense one, bit for bit
    leafs64 = [t.detach().double().requires_grad_() for t in leafs]
    _, ref = _grads(_dense(rms, eps), leafs64, gy.double())
    for name, g, w_, r in zip(("dX", "dW", "db"), got, want, ref):
        assert g.dtype == dtype and g.shape == w_.shape, name
        assert_within_torch_error(g, r, w_, dtype, name)
    zero_rows = (gy == 0).all(dim=-1)
    assert (got[0][zero_rows] == 0).all()  # skipped rows: exact zeros in dX


def test_layernorm_over_two_trailing_dims():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 7, 4, 6, generator=g, requires_grad=True)
    w = torch.randn(4, 6, generator=g, requires_grad=True)
    b = torch.randn(4, 6, generator=g, requires_grad=True)
    gy = torch.randn(3, 7, 4, 6, generator=g)
    gy[:, 3:] = 0
    _, got = _grads(lambda x_, w_, b_: sebp_layer_norm(x_, (4, 6), w_, b_), [x, w, b], gy)
    _, want = _grads(lambda x_, w_, b_: F.layer_norm(x_, (4, 6), w_, b_), [x, w, b], gy)
    for name, a, e in zip(("dX", "dW", "db"), got, want):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5, msg=name)


def test_nan_rows_stay_active():
    x = torch.randn(2, 6, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    gy = torch.zeros(2, 6, 8)
    gy[0, 1, 3] = float("nan")
    gy[1, 2] = 1.0
    sebp_rms_norm(x, w).backward(gy)
    assert torch.isnan(x.grad[0, 1]).all() and torch.isnan(w.grad).any()
    assert (x.grad[0, 0] == 0).all() and x.grad[1, 2].abs().sum() > 0


if not INTERPRET:

    def test_reference_skips_zero_rows_and_matches_dense():
        x, dy = torch.randn(9, 5, dtype=torch.float64), torch.randn(9, 5, dtype=torch.float64)
        dy[2:6] = 0
        w, b = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
        xl = x.clone().requires_grad_()
        wl, bl = w.clone().requires_grad_(), b.clone().requires_grad_()
        out, mean, rstd = torch.native_layer_norm(xl, (5,), wl, bl, 1e-5)
        out.backward(dy)
        dx, dw, db = norm_backward_torch(dy, x, w, mean.detach().reshape(-1), rstd.detach().reshape(-1))
        torch.testing.assert_close(dx, xl.grad)
        torch.testing.assert_close(dw, wl.grad)
        torch.testing.assert_close(db, bl.grad)

    def test_module_swap_shares_parameters_and_keys():
        ln = nn.LayerNorm(12)
        rms = HFLikeRMSNorm(12)
        for m in (ln, rms):
            s = SEBPNorm(m)
            assert s.weight is m.weight and s.state_dict().keys() == m.state_dict().keys()
            assert s.original() is m
            x = torch.randn(3, 12)
            assert torch.equal(s(x), m(x))
        with pytest.raises(TypeError, match="expected an nn.LayerNorm"):
            SEBPNorm(nn.Linear(3, 3))
        with pytest.raises(ValueError, match="exact mode only"):
            SEBPNorm(ln, SEBPConfig("threshold", eps=0.1))

    def test_frozen_weight_gets_no_grad():
        x = torch.randn(4, 7, requires_grad=True)
        w = torch.randn(7)
        b = torch.randn(7)
        sebp_layer_norm(x, 7, w, b).sum().backward()
        assert x.grad is not None and w.grad is None

    def test_layernorm_under_autocast_runs_in_fp32_like_torch():
        x = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(16, dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(16, dtype=torch.bfloat16, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours = sebp_layer_norm(x, (16,), w, b)
            theirs = F.layer_norm(x, (16,), w, b)
        assert ours.dtype == theirs.dtype
        torch.testing.assert_close(ours, theirs)
        ours.float().sum().backward()
        assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16


if INTERPRET:

    def test_norm_kernel_keeps_one_tile_in_flight_when_a_launch_lacks_resources(monkeypatch):
        """A GPU whose shared memory does not hold the pipelined tiles fails the first launch with
        OutOfResources: the norm backward runs with one tile in flight from then on (kept per device, one
        warning); if that fails too, the error stands."""
        from triton.runtime.errors import OutOfResources

        from sebp_kernels._triton import norm
        from tests.helpers import fail_launches

        shape, eps = (3, 37, 50), 1e-5
        gy = _rows_zeroed(shape, torch.float32, seed=1)
        leafs = _leafs(shape, torch.float32, seed=1, rms=False)
        run = lambda x, w, b: sebp_layer_norm(x, (shape[-1],), w, b, eps)  # noqa: E731
        _, want = _grads(run, leafs, gy)
        failing = {0}
        calls = fail_launches(monkeypatch, norm._norm_bwd, failing)
        monkeypatch.setattr(norm, "_STAGES", {})
        with pytest.warns(UserWarning, match="one norm tile in flight"):
            _, got = _grads(run, leafs, gy)
        assert norm._STAGES == {None: 1} and len(calls) == 2
        assert all(torch.equal(g, t) for g, t in zip(got, want))
        failing.update(range(100))
        with pytest.raises(OutOfResources):
            _grads(run, leafs, gy)
