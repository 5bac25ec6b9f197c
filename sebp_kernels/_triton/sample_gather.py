"""Sampled mode's kept rows gathered into dense buffers, so that dW, db (and a sampled dX) are cuBLAS GEMMs over
``cap`` rows instead of the fused kernel's gathered loop (which runs at about half cuBLAS's rate on whole
rows).

``cap`` is a host integer, a little above the layer's recent kept count (:meth:`~sebp_kernels.sampling.
SampleState.capacity`), so the GEMMs' shapes are known without reading the count back. One launch:

- slot j < kept (and j < cap): row ``perm[j]`` of dY times its 1/q, and the same row of X;
- slot j >= kept: zeros (a zero row adds nothing to dW, db or dX);
- more kept rows than ``cap`` (the count moved past the margin): the slots take a window of ``cap``
  consecutive kept rows, cyclically from a random offset, each scaled by kept / cap on top of its 1/q. Every
  kept row is in the window with probability cap / kept, so the gradient stays unbiased; only its variance
  grows, and only in that backward. The offset is the torch reference's
  (:func:`~sebp_kernels.sampling.window_offset`), from the layer's stream and backward count.

``rows`` (int64, cap) holds each slot's row of dY, for a sampled dX's scatter: a zero slot names a row that
was not kept, whose dX is zero anyway.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import FastLaunch
from .sample_select import _mix64


@triton.jit(do_not_specialize=["CAP"])
def _gather_kept_kernel(
    dy_ptr, x_ptr, perm_ptr, count_ptr, scale_ptr, hash_ptr, dyk_ptr, xk_ptr, rows_ptr,
    N, K, CAP, stride_dy, stride_x,
    HAS_X: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    j = tl.program_id(0)
    kept = tl.load(count_ptr)
    over = kept > CAP
    # the window's offset: the backward's stream state (its count was advanced by the compaction), mixed
    # with a constant of its own, then (h >> 32) * kept >> 32, as sampling.window_offset
    key = tl.load(hash_ptr).to(tl.uint64, bitcast=True)
    step = (tl.load(hash_ptr + 1) - 1).to(tl.uint64, bitcast=True)
    h = _mix64(_mix64(key + step * 0x9E3779B97F4A7C15) + 0xD1B54A32D192ED03)
    off = (((h >> 32) * kept.to(tl.int64).to(tl.uint64, bitcast=True)) >> 32).to(tl.int64, bitcast=True)
    slot = tl.where(over, (off + j) % tl.maximum(kept, 1).to(tl.int64), j)
    r = tl.load(perm_ptr + slot).to(tl.int64)
    factor = tl.where(over, tl.div_rn(kept.to(tl.float32), CAP * 1.0), 1.0)
    s = tl.where(j < kept, tl.load(scale_ptr + r) * factor, 0.0)
    tl.store(rows_ptr + j, r)
    out = j.to(tl.int64)
    for c0 in range(0, N, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        v = tl.load(dy_ptr + r * stride_dy + cols, mask=cols < N, other=0.0)
        tl.store(dyk_ptr + out * N + cols, (v.to(tl.float32) * s).to(dyk_ptr.dtype.element_ty), mask=cols < N)
    if HAS_X:
        live = tl.where(j < kept, K, 0)  # a zero slot reads nothing
        for c0 in range(0, K, BLOCK_K):
            cols = c0 + tl.arange(0, BLOCK_K)
            v = tl.load(x_ptr + r * stride_x + cols, mask=cols < live, other=0.0)
            tl.store(xk_ptr + out * K + cols, v, mask=cols < K)


_gather = FastLaunch(_gather_kept_kernel)


def _block(n: int, interpret: bool) -> int:
    return 16 if interpret else max(16, min(triton.next_power_of_2(n), 2048))


def gather_kept(dy: torch.Tensor, x: torch.Tensor | None, perm: torch.Tensor, count: torch.Tensor,
                scale: torch.Tensor, hash_state: torch.Tensor, cap: int, interpret: bool = False):
    """(dyk, xk or None, rows): ``cap`` slots of the kept rows of 2-D ``dy`` (M, out), each times its ``scale``
    (fp32, M), and of ``x`` (M, in) when given, as the module docstring says. ``perm``: the selection's
    permutation, kept rows first; ``count``: int32 (1,), the kept count; ``hash_state``: the layer's stream key
    and backward count, already advanced by this backward's selection. Both inputs need unit column stride."""
    m, n = dy.shape
    k = x.shape[1] if x is not None else 1
    dyk = torch.empty((cap, n), dtype=dy.dtype, device=dy.device)
    xk = torch.empty((cap, k), dtype=x.dtype, device=x.device) if x is not None else None
    rows = torch.empty(cap, dtype=torch.int64, device=dy.device)
    if cap:
        _gather[(cap,)](dy, x if x is not None else dy, perm, count, scale, hash_state, dyk,
                        xk if xk is not None else dyk, rows, n, k, cap, dy.stride(0),
                        x.stride(0) if x is not None else 0, HAS_X=x is not None, BLOCK_N=_block(n, interpret),
                        BLOCK_K=_block(k, interpret), num_warps=1 if interpret else 4)
    return dyk, xk, rows
