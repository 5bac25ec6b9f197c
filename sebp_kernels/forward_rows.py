"""The forward of an SEBP linear over the real-token rows of a padded batch.

Where :mod:`.pad_rows` has checked that the padding rows of a batch carry no gradient into any SEBP linear
(its verdict ``on``), nothing the loss reads depends on what those rows of a linear's output hold: attention
masks them out as keys, and their own outputs reach no loss. The forward then computes the real-token rows only
and writes zeros (plus the bias) to the padding rows, instead of a GEMM over every row: on a ``longest`` batch
half of whose rows are padding, about half the forward GEMM work. The real rows get the same values as
``F.linear`` up to summation order (another GEMM kernel), the padding rows other values that nothing reads.

On the GPU (or the Triton interpreter) it is one launch of the dX kernel (:mod:`._triton.fwd`) with the row
count on the device, so a CUDA graph replays it for any batch of the captured shape (the choice itself, rows or
every row, is the one made at capture: a graph captured before the verdict keeps every row); elsewhere the torch
reference runs on the CPU, and ``F.linear`` on a GPU.

It pays only where the work it skips outweighs what the kernel gives away to cuBLAS. On an H100 (bf16,
results/kernels.json run forward_rows) it was 1.2-1.9x faster than
``F.linear`` at half the rows real for Llama-3.2-1B and Qwen2.5-0.5B projections over 8192 rows, but for
Qwen's 896->128 k/v; 5-15% slower with every row real; and slower at every density for BERT-base's
projections over 2112 rows (a `longest` batch of short sentences: 14 us or more a launch where cuBLAS takes
6-18 us). :func:`pays` draws the line from those rows: at least :data:`MIN_ROWS` rows and at least
:data:`MIN_SKIPPED` multiply-adds skipped at the batch's share of real rows (the last one read back, see
:class:`~.pad_rows.PadRows`; a half where none was read yet).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from .reference import linear_rows_torch, unit_col_stride


@functools.lru_cache(maxsize=1)
def _triton_parts():
    """(supported, the launcher, ieee, SM count, interpreting), or None without triton (looked up once)."""
    try:
        from ._triton.backward import INTERPRET, _ieee, supported
        from ._triton.fwd import linear_rows_triton
        from ._triton.select import _sm_count
    except ImportError:
        return None
    return supported, linear_rows_triton, _ieee, _sm_count, INTERPRET


def _wt_view_ok(weight: Tensor) -> bool:
    """Whether the kernel can read ``weight``ᵀ as a strided view: unit stride in one of its dimensions (a
    ``Conv1D``'s transposed weight has it in the other), and every offset it forms (32-bit) within range."""
    last = (weight.shape[0] - 1) * weight.stride(0) + (weight.shape[1] - 1) * weight.stride(1)
    return 1 in weight.stride() and last < 2**31 - 1


def linear_over_rows(x: Tensor, weight: Tensor, bias: Tensor | None, perm: Tensor, count: Tensor) -> Tensor:
    """``F.linear(x, weight, bias)`` on the rows ``perm[:count]`` of ``x`` (leading dimensions flattened); the
    other rows hold the bias (zeros without one). On a GPU where the Triton kernel does not take these tensors
    it is ``F.linear`` on every row (the torch reference reads the count on the host)."""
    x2 = unit_col_stride(x.reshape(-1, x.shape[-1]))
    parts = _triton_parts()
    if parts is not None and parts[0](x2, None, weight) and _wt_view_ok(weight) and _bias_ok(bias, x2):
        supported, launch, ieee, sm_count, interpret = parts
        y = launch(x2, weight, perm, count, ieee(x2.dtype), 1 if interpret else sm_count(x2.device), interpret,
                   bias)
    elif x.device.type == "cuda":  # no Triton for these tensors: the reference would sync (and break a capture)
        return F.linear(x, weight, bias)
    else:
        y = linear_rows_torch(x2, weight, perm, count, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def _bias_ok(bias: Tensor | None, x2: Tensor) -> bool:
    """Whether the kernel can add ``bias`` as it stores: none, or a contiguous vector on ``x2``'s device and in
    its dtype (as ``F.linear`` takes it)."""
    return bias is None or (bias.dim() == 1 and bias.stride(0) == 1 and bias.device == x2.device
                            and bias.dtype == x2.dtype)


MIN_ROWS = 4096
MIN_SKIPPED = 3e9  # multiply-adds: ~10 us of an H100's bf16 GEMM throughput


def pays(rows: int, in_features: int, out_features: int, density: float | None) -> bool:
    """Whether the forward over the real rows is expected to beat ``F.linear`` on ``rows`` rows of which the
    share ``density`` is real (None: not known yet, taken as a half); see the module docstring."""
    real = 0.5 if density is None else density
    return rows >= MIN_ROWS and rows * in_features * out_features * (1.0 - real) > MIN_SKIPPED


def could_pay(rows, in_features: int, out_features: int) -> bool:
    """Whether :func:`pays` can hold for this shape at any share of real rows (none real at best). A compiled
    SEBP linear asks it when its graph is traced (``rows`` may be symbolic: the answer is then a guard), and where
    it cannot, traces ``F.linear`` instead of calling the forward operator for nothing."""
    return rows >= MIN_ROWS and rows * in_features * out_features > MIN_SKIPPED


def linear_maybe_over_rows(x: Tensor, weight: Tensor, bias: Tensor | None, rows) -> Tensor:
    """:func:`linear_over_rows` where ``rows`` (perm, count, a recent real-row share or None) names the
    real-token rows and that :func:`pays`, else ``F.linear``."""
    if (rows is None or x.device != rows[0].device  # a layer on another GPU than the batch's rows
            or not pays(x.numel() // x.shape[-1], weight.shape[1], weight.shape[0], rows[2])):
        return F.linear(x, weight, bias)
    return linear_over_rows(x, weight, bias, rows[0], rows[1])
