"""The grouped linear of a mixture-of-experts layer whose experts are one 3-D weight (transformers 5's fused
``gate_up_proj`` / ``down_proj``, shape (experts, out, in)), with the SEBP backward: over the routed rows whose
dL/dY is not zero only.

Each expert already computes over the rows routed to it alone (its group of rows, sorted by expert), so the dense
backward's work is that of the routed rows. What is left to skip is the routed rows no loss reaches: a padding
token is routed like any other, and its rows get exactly zero dL/dY. The backward compacts the rows with any
non-zero element (NaN and Inf count), counts them per expert, and runs the two grouped GEMMs (dX, dW) over those
rows alone; the other rows' dX is zero, as dense computes it. Exact: each expert's dW sums the same non-zero
products, and the zero rows add exact zeros.

The GEMMs are ``torch.nn.functional.grouped_mm`` where this torch and the operands allow it, else a loop over the
groups (:func:`grouped_mm_loop`, the reference the tests hold the grouped path to).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["grouped_mm", "grouped_mm_loop", "sebp_grouped_linear"]


def grouped_mm_loop(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Grouped GEMM as a loop: ``a`` (S, K) rows grouped by ``offs`` (cumulative ends), ``b`` (E, K, N) -> (S, N);
    with ``a`` (K, S) grouped by columns and ``b`` (S, N) -> (E, K, N), each group's ``a_g @ b_g``."""
    ends = offs.tolist()
    if b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[2])
        start = 0
        for e, end in enumerate(ends):
            if end > start:
                torch.mm(a[start:end], b[e], out=out[start:end])
            start = end
        return out
    out = a.new_zeros(len(ends), a.shape[0], b.shape[1])
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            torch.mm(a[:, start:end], b[start:end], out=out[e])
        start = end
    return out


_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _aligned(t: torch.Tensor) -> bool:
    """F.grouped_mm's rule for its operands: 16-byte aligned data and strides."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s == 1 or (s * size) % 16 == 0 for s in t.stride())


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_mm_loop`'s product by ``torch.nn.functional.grouped_mm`` where it runs on these operands
    (this torch has it, on a GPU or the CPU, in fp32, bf16 or fp16, aligned), else by the loop."""
    fn = getattr(F, "grouped_mm", None)
    if (fn is not None and a.device.type in ("cuda", "cpu") and a.dtype == b.dtype and a.dtype in _GROUPED_DTYPES
            and _aligned(a) and _aligned(b)):
        return fn(a, b, offs=offs.to(torch.int32))
    return grouped_mm_loop(a, b, offs)


class _GroupedLinear(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ weight[e]ᵀ``; the backward over the rows of dY that are not zero."""

    @staticmethod
    def forward(ctx, x, weight, offs, experts):
        ctx.save_for_backward(x, weight, offs, experts)
        return grouped_mm(x, weight.transpose(-2, -1), offs)

    @staticmethod
    def backward(ctx, dy):
        x, weight, offs, experts = ctx.saved_tensors
        active = dy.ne(0).any(dim=1)  # NaN compares unequal to 0: a diverging row stays active
        rows = active.nonzero().squeeze(1)
        k, n = rows.numel(), dy.shape[0]
        if k == n:  # every row active: the dense products, nothing to gather
            dya, xa, offs_a = dy, x, offs
        else:
            dya, xa = dy.index_select(0, rows), x.index_select(0, rows)
            counts = torch.bincount(experts.index_select(0, rows), minlength=weight.shape[0])
            offs_a = counts[: weight.shape[0]].cumsum(0)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dxa = grouped_mm(dya, weight, offs_a)
            dx = dxa if k == n else dy.new_zeros(x.shape).index_copy_(0, rows, dxa)
        if ctx.needs_input_grad[1]:
            dw = grouped_mm(dya.t(), xa, offs_a) if k else torch.zeros_like(weight)
        return dx, dw, None, None


def sebp_grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                        experts: torch.Tensor) -> torch.Tensor:
    """Each expert's linear over its rows: ``x`` (S, in) sorted by expert, ``weight`` (E, out, in), ``offs`` (E,)
    the cumulative row counts, ``experts`` (S,) each row's expert (sorted, each < E). Forward as the dense grouped
    GEMM; backward over the rows of dY that are not zero (see the module doc)."""
    return _GroupedLinear.apply(x, weight, offs, experts)
