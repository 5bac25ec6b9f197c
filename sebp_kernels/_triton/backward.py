"""Host launcher of the fused SEBP backward: two launches (select; then dX, dW and db together), all on the
device, no host sync.

Inputs the Triton path does not cover (CPU tensors outside the interpreter, mixed or other dtypes, empty
shapes) go to the torch reference, so this function is always safe to call.
"""
from __future__ import annotations

import functools

import torch

from ..config import SEBPConfig
from ..density import RowDensity
from ..interpret import INTERPRET
from ..reference import dense_products, sebp_backward_torch, unit_col_stride, weight_view
from .grads import grads_rows
from .select import _sm_count, select_rows_device

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def supported(dy: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """Whether the Triton kernels handle these inputs (else the torch path runs): 2-D rows, none empty, every
    tensor in dY's dtype, which :func:`takes`."""
    tensors = [t for t in (dy, x, weight) if t is not None]
    return (takes(dy.dtype, dy.device)
            and all(t.device.type == dy.device.type and t.dtype == dy.dtype for t in tensors)
            and dy.dim() == 2 and min(dy.shape) > 0 and weight.shape[1] > 0)


def takes(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernels take tensors of ``dtype`` on ``device``: CUDA (the CPU under the interpreter), fp16,
    bf16 or fp32; bf16 needs a GPU whose tensor cores take it (compute capability 8.0 or later)."""
    return (device.type == ("cpu" if INTERPRET else "cuda") and dtype in DTYPES
            and (dtype != torch.bfloat16 or INTERPRET or _bf16_dots(device.index)))


@functools.lru_cache(maxsize=None)
def _bf16_dots(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 0)


def _ieee(dtype: torch.dtype) -> bool:
    """The fp32 correctness path (full-precision dots, two-level sums) for fp32 inputs, unless torch itself
    allows TF32 for matmuls. fp16/bf16 take the fast tensor-core loops: their dots accumulate in fp32 anyway.
    (Until 2026-11-22 this returned True for fp16/bf16 too, which put them on the slow loop.)"""
    return dtype == torch.float32 and (INTERPRET or not tf32_matmul_allowed())


def tf32_matmul_allowed() -> bool:
    """Whether torch lets fp32 matmuls use TF32. torch >= 2.9 refuses to read the legacy flag
    (``torch.backends.cuda.matmul.allow_tf32``) once the new API (``fp32_precision``) has set it too, as
    ``Trainer`` / Inductor runs may do: then the new setting decides ("none" defers to the global one)."""
    matmul = torch.backends.cuda.matmul
    try:
        return bool(matmul.allow_tf32)
    except RuntimeError:
        precision = matmul.fp32_precision
        if precision == "none":
            precision = getattr(torch.backends, "fp32_precision", "ieee")
        return precision == "tf32"




def sebp_backward_triton(
    dy: torch.Tensor,
    x: torch.Tensor | None,
    weight: torch.Tensor,
    config: SEBPConfig,
    need_dx: bool = True,
    need_dw: bool = True,
    need_db: bool = True,
    state: RowDensity | None = None,
    rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    dx_buffer=None,
):
    """(dX, dW, db) of ``Y = X Wᵀ + b`` over the active rows of 2-D ``dy`` (M, out); None where not needed.

    dX (M, in) is zero on inactive rows; dW and db sum over active rows only. The active-row count stays on
    the device, so the whole backward can be captured in a CUDA graph. With a ``state`` (one per layer) in
    exact mode, a layer whose rows were nearly all active last time takes the dense backward instead (the
    same gradients: its skipped rows are zero; see :mod:`sebp_kernels.density`). ``rows``: (permutation,
    device-side count) of a superset of dY's non-zero rows, known from the backward that wrote dY (exact mode
    only): the select pass is skipped. ``dx_buffer``: a :class:`~sebp_kernels.zero_rows.ZeroRowBuffer` of
    dX's shape and dtype: dX is written into it, zeroing only the rows it marks dirty (the dense path and the
    torch path leave it alone and return a new dX).
    """
    if not (need_dx or need_dw or need_db):
        return None, None, None
    if not supported(dy, x if need_dw else None, weight):
        return sebp_backward_torch(dy, x, weight, config, need_dx, need_dw, need_db)
    # The kernels index columns with 32-bit offsets times the column stride: keep that stride 1 (a Conv1D's
    # transposed weight is read through its strides, :func:`~..reference.weight_view`).
    dy, weight = unit_col_stride(dy), weight_view(weight)
    x = unit_col_stride(x) if x is not None else None
    if config.mode != "exact":
        state = None  # elsewhere the skipped rows are not zero: only the SEBP path gives the SEBP gradients
        rows = None  # and the rows are chosen by their values
    if state is not None:
        capturing = not INTERPRET and torch.cuda.is_current_stream_capturing()
        path = state.choose(capturing)
        if path != "sebp":
            if path == "probe":
                count = rows[1] if rows is not None else select_rows_device(dy, "exact", interpret=INTERPRET)[1]
                state.observe(count, dy.shape[0])
            return dense_products(dy, x, weight, need_dx, need_dw, need_db)
    if rows is not None and rows[0].shape[0] == dy.shape[0]:
        perm, count = rows
    else:
        perm, count = select_rows_device(dy, config.mode, config.eps, config.top_n, interpret=INTERPRET)
    dx, dw, db = grads_rows(dy, x, weight, perm, count, need_dx, need_dw, need_db, _ieee(dy.dtype),
                            _sm_count(dy.device), INTERPRET, 1 if INTERPRET else None, dx_buffer=dx_buffer)
    if state is not None:
        state.observe(count, dy.shape[0], capturing)
    return dx, dw, db

