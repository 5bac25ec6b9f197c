"""Shared test utilities: a dense reference backward and a mismatch report."""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Per-dtype absolute slack on top of "at most 2x plain torch's error against fp64" (flash-attention rule).
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float64: 1e-12}


def dense_grads(x, w, b, dy, dtype=None):
    """dX, dW, db of F.linear by autograd, in ``dtype`` (default: the inputs' dtype)."""
    dtype = dtype or x.dtype
    x_ = x.detach().to(dtype).requires_grad_()
    w_ = w.detach().to(dtype).requires_grad_()
    b_ = b.detach().to(dtype).requires_grad_() if b is not None else None
    F.linear(x_, w_, b_).backward(dy.to(dtype))
    return x_.grad, w_.grad, (b_.grad if b_ is not None else None)


def assert_close_report(actual, expected, atol, rtol=0.0, name="tensor"):
    """assert_close that prints the first mismatching positions when it fails."""
    actual, expected = actual.double(), expected.double()
    bad = ~torch.isclose(actual, expected, atol=atol, rtol=rtol, equal_nan=True)
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        rows = [f"  {tuple(i)}: got {actual[tuple(i)].item():.6g}, want {expected[tuple(i)].item():.6g}"
                for i in idx]
        raise AssertionError(f"{name}: {int(bad.sum())} of {bad.numel()} mismatch (atol={atol})\n"
                             + "\n".join(rows))


def assert_within_torch_error(actual, ref64, torch_same_dtype, dtype, name="tensor"):
    """|actual - ref64| <= 2 * |torch_dtype - ref64| + atol, elementwise in the max sense."""
    err = (actual.double() - ref64).abs().max().item()
    base = (torch_same_dtype.double() - ref64).abs().max().item()
    bound = 2 * base + ATOL[dtype]
    assert err <= bound, f"{name}: max error {err:.3g} > bound {bound:.3g} (torch's own error {base:.3g})"
