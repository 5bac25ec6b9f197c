"""Row selection on the device: which rows of dL/dY are active, compacted in order, count left on the device.

Two small kernels, no host sync:

1. ``_row_flags_kernel``: one pass over dY. Each program owns ``BLOCK_R`` rows and walks their columns until
   every one of its rows is known to be active (so a dense dY costs one column block per row, not a full
   read). It writes a 0/1 flag per row and its block's active count.
2. ``_compact_kernel``: each program adds up the counts of the blocks before it and scatters its rows into a
   permutation of ``0..M-1``: active rows first in row order, then the inactive rows (in reverse order) at
   the back. The number of active rows ``k`` goes to a one-element device tensor.

Measured on an H100 (2026-11-22), a one-launch variant (each block publishes its count and finds its offset
by a decoupled look-back over earlier blocks, numbered by an atomic ticket) took 6-13 us more GPU time than
these two launches at every BERT-base and Llama-3.2-3B shape, so selection stays two launches.

The dX kernel reads the whole permutation: tiles below ``k`` compute rows, tiles above it write zeros, so
dX needs no separate memset. ``topk`` mode (a static ``N``) ranks rows by a fused sum-of-squares pass and
builds the same permutation with ``torch.topk`` and a stable sort, all on the device.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import FastLaunch, Plans, plan_ids
from .tuning import cdiv

EXACT, THRESHOLD = 0, 1


@triton.jit
def _row_flags_kernel(
    dy_ptr, flags_ptr, block_count_ptr,
    M, N,
    stride_m, stride_n,
    eps,
    MODE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < M
    n_valid = tl.sum(rmask.to(tl.int32), axis=0)
    row_ptrs = dy_ptr + rows.to(tl.int64)[:, None] * stride_m
    active = tl.zeros([BLOCK_R], dtype=tl.int32)
    n_active = tl.sum(active, axis=0)
    c0 = 0
    # Stop as soon as every row of the block is active: a dense dY is then read one column block deep.
    while (c0 < N) & (n_active < n_valid):
        cols = c0 + tl.arange(0, BLOCK_C)
        tile = tl.load(row_ptrs + cols[None, :] * stride_n,
                       mask=rmask[:, None] & (cols < N)[None, :], other=0.0)
        if MODE == 0:  # exact: any non-zero (NaN and Inf compare unequal to 0)
            hit = tile != 0
        else:  # threshold: |x| > eps, NaN always
            a = tl.abs(tile.to(tl.float32))
            hit = (a > eps) | (a != a)
        active = tl.maximum(active, tl.max(hit.to(tl.int32), axis=1))
        n_active = tl.sum(active, axis=0)
        c0 += BLOCK_C
    tl.store(flags_ptr + rows, active, mask=rmask)
    tl.store(block_count_ptr + pid, n_active)


@triton.jit
def _compact_kernel(
    flags_ptr, block_count_ptr, perm_ptr, count_ptr,
    M, NB,
    BLOCK_R: tl.constexpr, BLOCK_NB: tl.constexpr,
):
    pid = tl.program_id(0)
    before = tl.sum(tl.zeros([BLOCK_NB], dtype=tl.int32), axis=0)
    for s in range(0, pid, BLOCK_NB):  # active rows in the blocks before this one
        idx = s + tl.arange(0, BLOCK_NB)
        before += tl.sum(tl.load(block_count_ptr + idx, mask=idx < pid, other=0), axis=0)
    local = tl.arange(0, BLOCK_R)
    rows = pid * BLOCK_R + local
    rmask = rows < M
    f = tl.load(flags_ptr + rows, mask=rmask, other=0)
    excl = tl.cumsum(f, axis=0) - f
    pos_active = before + excl
    pos_inactive = M - 1 - (pid * BLOCK_R - before + local - excl)
    tl.store(perm_ptr + tl.where(f > 0, pos_active, pos_inactive), rows, mask=rmask)
    if pid == NB - 1:
        tl.store(count_ptr, before + tl.sum(f, axis=0))


@triton.jit
def _row_sumsq_kernel(
    dy_ptr, out_ptr,
    M, N,
    stride_m, stride_n,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < M
    row_ptrs = dy_ptr + rows.to(tl.int64)[:, None] * stride_m
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for c0 in range(0, N, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        v = tl.load(row_ptrs + cols[None, :] * stride_n,
                    mask=rmask[:, None] & (cols < N)[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(v * v, axis=1)
    # Non-finite rows rank first: a diverging row is never dropped.
    acc = tl.where((acc == acc) & (acc < float("inf")), acc, float("inf"))
    tl.store(out_ptr + rows, acc, mask=rmask)


@functools.lru_cache(maxsize=None)
def _row_blocks(n: int, interpret: bool) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps) for the row passes: 8 rows x up to 512 columns, 8 warps. Chosen by
    ``scripts/flags_sweep.py`` on an H100 (``results/h100_flags_sweep.json``): over BERT-base and
    Llama-3.2-3B dY shapes at densities 0.01, 0.2 and 1.0 it was within 6% of each case's best on average
    (26% at worst) and never slower than the previous rule (up to 32 rows x 16K elements, 4 warps), which it
    beat by up to 37% (16384 x 3072 at d = 1.0: 15.0 -> 9.5 us)."""
    if interpret:
        return 8, 16, 1
    return 8, max(64, min(triton.next_power_of_2(n), 512)), 8


_row_flags = FastLaunch(_row_flags_kernel)
_compact = FastLaunch(_compact_kernel)
_row_sumsq = FastLaunch(_row_sumsq_kernel)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=256)
def _eps_in(eps: float, dtype: torch.dtype) -> float:
    """eps rounded to dY's dtype: torch compares ``|dy| > eps`` in that dtype, and so does the reference."""
    # An eps beyond the dtype's range would round to +inf and hide Inf rows: the largest finite value keeps
    # every finite row inactive and every Inf row active, as the definition says.
    return min(float(torch.tensor(eps, dtype=dtype)), torch.finfo(dtype).max)


def select_rows_device(dy: torch.Tensor, mode: str, eps: float = 0.0, top_n: int | None = None,
                       interpret: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(perm, count): int32 permutation of the M rows of 2-D ``dy`` with the k active rows first, in order,
    and k as an int32 tensor of shape (1,) on the device. No host synchronisation."""
    m, n = dy.shape
    if mode == "topk":
        return _topk_perm(dy, top_n, interpret)
    key = (m, n, dy.dtype, dy.stride(), mode, eps, interpret)
    plan = _SELECT_PLANS.get(key)
    if plan is None:
        plan = _SELECT_PLANS.add(key, _select_plan(m, n, dy.dtype, dy.stride(), mode, eps, interpret))
    idx, nb, sizes, flags_ints, flags_kw, compact_kw = plan
    # one allocation for the four int32 outputs (fewer host calls per layer)
    perm, flags, block_count, count = torch.empty(2 * m + nb + 1, dtype=torch.int32,
                                                  device=dy.device).split(sizes)
    _row_flags.launch_planned((nb,), idx, 3, (dy, flags, block_count, *flags_ints), flags_kw)
    _compact.launch_planned((nb,), idx, 4, (flags, block_count, perm, count, m, nb), compact_kw)
    return perm, count


_SELECT_PLANS = Plans(_row_flags, _compact)  # (shape, dtype, strides, mode, eps, interpreter) -> both passes


def _select_plan(m, n, dtype, stride, mode, eps, interpret):
    """(plan number, blocks, split sizes, the flags pass's scalar arguments, and both passes' keywords)."""
    block_r, block_c, warps = _row_blocks(n, interpret)
    nb = cdiv(m, block_r)
    mode_id = EXACT if mode == "exact" else THRESHOLD
    flags_kw = {"MODE": mode_id, "BLOCK_R": block_r, "BLOCK_C": block_c, "num_warps": warps}
    compact_kw = {"BLOCK_R": block_r, "BLOCK_NB": 16 if interpret else 1024, "num_warps": 1 if interpret else 4}
    return (next(plan_ids), nb, (m, m, nb, 1), (m, n, *stride, _eps_in(eps, dtype)), flags_kw, compact_kw)


def _topk_perm(dy: torch.Tensor, n: int, interpret: bool) -> tuple[torch.Tensor, torch.Tensor]:
    m, cols = dy.shape
    dev = dy.device
    count = torch.full((1,), min(n, m), dtype=torch.int32, device=dev)
    if n >= m:
        return torch.arange(m, dtype=torch.int32, device=dev), count
    block_r, block_c, warps = _row_blocks(cols, interpret)
    sumsq = torch.empty(m, dtype=torch.float32, device=dev)
    _row_sumsq[(cdiv(m, block_r),)](dy, sumsq, m, cols, dy.stride(0), dy.stride(1),
                                                  BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    top = torch.topk(sumsq, n, sorted=False).indices
    outside = torch.ones(m, dtype=torch.uint8, device=dev).index_fill_(0, top, 0)
    perm = torch.sort(outside, stable=True).indices  # chosen rows first, each group in row order
    return perm.to(torch.int32), count
