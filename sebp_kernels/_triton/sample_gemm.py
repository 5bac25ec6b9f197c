"""Sampled mode's dW and db on cuBLAS, for layers whose rows of dY are nearly all non-zero (packed batches).

The fused kernel's dW loop reads the kept rows through the permutation at well under cuBLAS's rate (H100,
bf16, 16384 x 8192 -> 2048 with half the rows kept: 813 us against cuBLAS's 750 us for every row). Here one
launch gathers the first ``capacity`` rows of the permutation (the kept rows first), each row of dY times its
1/q, into contiguous buffers, zero past the kept count; cuBLAS then multiplies those. The capacity is set on
the host from the layer's kept share read back a step or more ago (:meth:`~sebp_kernels.sampling.SampleState.
kept_capacity`), never by a sync; kept rows past it (a draw far above its expectation, or a share that grew)
go through the fused kernel, whose dW and db are added: the gradient is the same either way.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .grads import grads_rows
from .launch import FastLaunch
from .tuning import cdiv


@triton.jit(do_not_specialize=["K", "count_ptr"])
def _gather_kernel(dy_ptr, x_ptr, perm_ptr, count_ptr, scale_ptr, dyg_ptr, xg_ptr, K, N_OUT, N_IN,
                   stride_dym, stride_dyo, stride_xm, stride_xi,
                   SCALED: tl.constexpr, DO_X: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    inside = rows < K
    valid = rows < tl.minimum(tl.load(count_ptr), K)  # kept rows; the rest of the buffer is written as zeros
    src = tl.load(perm_ptr + rows, mask=valid, other=0).to(tl.int64)
    if SCALED:
        s = tl.load(scale_ptr + src, mask=valid, other=0.0)
    else:
        s = tl.where(valid, 1.0, 0.0)
    m_out = cols < N_OUT
    t = tl.load(dy_ptr + src[:, None] * stride_dym + cols[None, :] * stride_dyo, mask=valid[:, None] & m_out[None, :],
                other=0.0)
    out = (t.to(tl.float32) * s[:, None]).to(dyg_ptr.dtype.element_ty)
    tl.store(dyg_ptr + rows.to(tl.int64)[:, None] * N_OUT + cols[None, :], out, mask=inside[:, None] & m_out[None, :])
    if DO_X:
        m_in = cols < N_IN
        v = tl.load(x_ptr + src[:, None] * stride_xm + cols[None, :] * stride_xi, mask=valid[:, None] & m_in[None, :],
                    other=0.0)
        tl.store(xg_ptr + rows.to(tl.int64)[:, None] * N_IN + cols[None, :], v, mask=inside[:, None] & m_in[None, :])


_gather = FastLaunch(_gather_kernel)


def gathered_dw_db(dy: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, perm: torch.Tensor,
                   count: torch.Tensor, scale: torch.Tensor | None, capacity: int, need_dw: bool, need_db: bool,
                   ieee: bool, n_sm: int, interpret: bool = False):
    """(dW, db) over the rows ``perm[:count]`` (each row of dY times ``scale`` at its row index; None: 1), None
    where not needed: the first ``capacity`` rows gathered and multiplied by cuBLAS, any past it by the fused
    kernel."""
    m, n_out = dy.shape
    n_in = x.shape[1] if need_dw else 0
    dev = dy.device
    capacity = max(1, min(capacity, m))
    dyg = torch.empty(capacity, n_out, dtype=dy.dtype, device=dev)
    xg = torch.empty(capacity, n_in, dtype=x.dtype, device=dev) if need_dw else dyg
    block_r, block_c = (8, 16) if interpret else (16, 256)
    grid = (cdiv(capacity, block_r), cdiv(max(n_out, n_in), block_c))
    _gather[grid](dy, x if need_dw else dy, perm, count, dy if scale is None else scale, dyg, xg, capacity, n_out,
                  n_in, dy.stride(0), dy.stride(1), x.stride(0) if need_dw else 0, x.stride(1) if need_dw else 0,
                  SCALED=scale is not None, DO_X=need_dw, BLOCK_R=block_r, BLOCK_C=block_c,
                  num_warps=1 if interpret else 4)
    dw_over = db_over = None
    if capacity < m:  # kept rows past the capacity: none as a rule, and then a launch that writes zeros
        over = (count - capacity).clamp(min=0).to(torch.int32)
        _, dw_over, db_over = grads_rows(dy, x, weight, perm[capacity:], over, False, need_dw, need_db, ieee, n_sm,
                                         interpret, 1 if interpret else None, scale=scale)
    dw = db = None
    if need_dw:
        dw = dyg.t() @ xg if dw_over is None else torch.addmm(dw_over, dyg.t(), xg)
    if need_db:
        db = dyg.sum(0, dtype=torch.float32)
        db = (db if db_over is None else db + db_over.float()).to(dy.dtype)
    return dw, db
