"""Host launcher of the fused SEBP backward: select -> dX -> dW/db, all on the device, no host sync.

Inputs the Triton path does not cover (CPU tensors outside the interpreter, mixed or other dtypes, empty
shapes) go to the torch reference, so this function is always safe to call.
"""
from __future__ import annotations

import os

import torch

from ..config import SEBPConfig
from ..reference import sebp_backward_torch
from .dw import dw_db_rows, dw_splits
from .dx import dx_rows
from .select import _sm_count, select_rows_device

# Read when the kernels were decorated: under TRITON_INTERPRET=1 they run on CPU tensors.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def supported(dy: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """Whether the Triton kernels handle these inputs (else the torch path runs)."""
    want = "cpu" if INTERPRET else "cuda"
    tensors = [t for t in (dy, x, weight) if t is not None]
    return (all(t.device.type == want and t.dtype == dy.dtype for t in tensors)
            and dy.dtype in DTYPES and dy.dim() == 2 and min(dy.shape) > 0 and weight.shape[1] > 0)


def _ieee(dtype: torch.dtype) -> bool:
    """fp32 dots in full precision unless torch itself allows TF32 for matmuls."""
    return INTERPRET or dtype != torch.float32 or not torch.backends.cuda.matmul.allow_tf32




class _RowsHint:
    """The active-row count of the previous call on the same layer shape, for picking tile shapes.

    The count is copied to pinned host memory without waiting; the next call reads whatever has landed (a
    stale value only costs speed, never correctness). Bucketed to a power of two so the autotuner tunes a
    handful of densities per shape. A captured CUDA graph keeps the tile shapes of its capture (warm up first).
    """

    _slots: dict = {}  # key -> (pinned int32 tensor, numpy view of it)

    @classmethod
    def get(cls, key, m: int) -> int | None:
        """The bucketed count of the last call, or None before any count has landed."""
        slot = cls._slots.get(key)
        k = int(slot[1][0]) if slot is not None else -1
        return None if k < 0 else min(m, max(64, 1 << max(0, k - 1).bit_length()))

    @classmethod
    def record(cls, key, count: torch.Tensor) -> None:
        slot = cls._slots.get(key)
        if slot is None:
            pinned = torch.full((1,), -1, dtype=torch.int32, pin_memory=True)
            slot = cls._slots[key] = (pinned, pinned.numpy())
        slot[0].copy_(count, non_blocking=True)


def sebp_backward_triton(
    dy: torch.Tensor,
    x: torch.Tensor | None,
    weight: torch.Tensor,
    config: SEBPConfig,
    need_dx: bool = True,
    need_dw: bool = True,
    need_db: bool = True,
):
    """(dX, dW, db) of ``Y = X Wᵀ + b`` over the active rows of 2-D ``dy`` (M, out); None where not needed.

    dX (M, in) is zero on inactive rows; dW and db sum over active rows only. The active-row count stays on
    the device, so the whole backward can be captured in a CUDA graph.
    """
    if not supported(dy, x if need_dw else None, weight):
        return sebp_backward_torch(dy, x, weight, config, need_dx, need_dw, need_db)
    # The kernels index columns with 32-bit offsets times the column stride: keep that stride 1.
    dy, weight = _unit_col_stride(dy), _unit_col_stride(weight)
    x = _unit_col_stride(x) if x is not None else None
    perm, count = select_rows_device(dy, config.mode, config.eps, config.top_n, interpret=INTERPRET)
    m = dy.shape[0]
    hint = None
    if not INTERPRET:
        key = (dy.device, m, *weight.shape, config)
        hint = _RowsHint.get(key, m)
        if not torch.cuda.is_current_stream_capturing():
            _RowsHint.record(key, count)
    ieee = _ieee(dy.dtype)
    dx = dw = db = None
    if need_dx:
        dx = dx_rows(dy, weight, perm, count, interpret=INTERPRET, ieee=ieee, rows_hint=hint)
    if need_dw:
        split = 1 if INTERPRET else dw_splits(weight.shape[0], weight.shape[1], hint or m, _sm_count(dy.device))
        dw, db = dw_db_rows(dy, x, perm, count, need_db, split, interpret=INTERPRET, ieee=ieee,
                            w_dtype=weight.dtype, rows_hint=hint)
    elif need_db:
        db = _db_only(dy, perm, count)
    return dx, dw, db


def _unit_col_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(1) == 1 or t.shape[1] == 1 else t.contiguous()


def _db_only(dy: torch.Tensor, perm: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """db over active rows when dW is not needed (frozen weight, trainable bias): a 0/1 row mask times dY."""
    m = dy.shape[0]
    keep = torch.arange(m, device=dy.device) < count
    mask = torch.empty(m, dtype=torch.bool, device=dy.device).scatter_(0, perm.long(), keep)
    # where(), not mask @ dy: 0 * Inf on an inactive row would leak NaN into db
    return torch.where(mask[:, None], dy, 0).sum(0, dtype=torch.float32).to(dy.dtype)
