"""Row selection on the device: which rows of dL/dY are active, compacted in order, count left on the device.

Two small kernels, no host sync:

1. ``_row_flags_kernel``: one pass over dY. Each program owns ``BLOCK_R`` rows: it reads their first column
   block, then the remaining columns of only the rows still inactive (a dense dY costs one column block per
   row, a zero row its full read), a few column blocks a step with no exit test so that their loads overlap.
   It writes a 0/1 flag per row and its block's active count.
2. ``_compact_kernel``: each program adds up the counts of the blocks before its ``ROWS`` rows and scatters
   them into a permutation of ``0..M-1``: active rows first in row order, then the inactive rows (in reverse
   order) at the back. The number of active rows ``k`` goes to a one-element device tensor.

Measured on an H100 (2026-11-22, ``results/tuning/select_one_vs_two_launches_h100.txt`` and
``results/kernels.json``, run select), two one-launch variants were slower than these two launches at
every BERT-base and Llama-3.2-3B shape: each block finding its offset by a decoupled look-back over earlier blocks
(6-13 us more), and the last block to finish compacting all rows alone (1-60 us more). The compact pass
costs 4.8-5.8 us alone and 2.1-3.2 us after the flags pass, whatever its ``ROWS`` (128-1024).

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
def _hits(tile, eps, MODE: tl.constexpr):
    """1 where an element makes its row active: exact, any non-zero (NaN and Inf compare unequal to 0);
    threshold, |x| > eps or NaN."""
    if MODE == 0:
        return (tile != 0).to(tl.int32)
    a = tl.abs(tile.to(tl.float32))
    return ((a > eps) | (a != a)).to(tl.int32)


@triton.jit(do_not_specialize=["M"])
def _row_flags_kernel(
    dy_ptr, flags_ptr, block_count_ptr,
    M, N,
    stride_m, stride_n,
    eps,
    MODE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, UNROLL: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < M
    row_ptrs = dy_ptr + rows.to(tl.int64)[:, None] * stride_m
    cols = tl.arange(0, BLOCK_C)
    # Phase 1: the first column block of every row (an active row nearly always shows it there).
    tile = tl.load(row_ptrs + cols[None, :] * stride_n, mask=rmask[:, None] & (cols < N)[None, :], other=0.0)
    active = tl.max(_hits(tile, eps, MODE), axis=1)
    # Phase 2: the other column blocks of the rows still inactive, UNROLL blocks a step. No exit test in the
    # loop: its loads do not depend on each other, so several are in flight.
    todo = rmask & (active == 0)
    if tl.sum(todo.to(tl.int32), axis=0) > 0:
        for c0 in range(BLOCK_C, N, BLOCK_C * UNROLL):
            for u in tl.static_range(UNROLL):
                c = c0 + u * BLOCK_C + cols
                t = tl.load(row_ptrs + c[None, :] * stride_n, mask=todo[:, None] & (c < N)[None, :], other=0.0)
                active = tl.maximum(active, tl.max(_hits(t, eps, MODE), axis=1))
    tl.store(flags_ptr + rows, active, mask=rmask)
    tl.store(block_count_ptr + pid, tl.sum(active, axis=0))


@triton.jit(do_not_specialize=["M", "count_ptr"])
def _compact_kernel(
    flags_ptr, block_count_ptr, perm_ptr, count_ptr,
    M,
    BLOCK_R: tl.constexpr, ROWS: tl.constexpr, BLOCK_NB: tl.constexpr,
):
    # flags_ptr: a 0/1 flag per row; block_count_ptr: the active count of each block of BLOCK_R rows.
    # Program pid places ROWS rows (a multiple of BLOCK_R).
    pid = tl.program_id(0)
    first = pid * (ROWS // BLOCK_R)  # blocks before this program's rows
    before = tl.sum(tl.zeros([BLOCK_NB], dtype=tl.int32), axis=0)
    for s in range(0, first, BLOCK_NB):
        idx = s + tl.arange(0, BLOCK_NB)
        before += tl.sum(tl.load(block_count_ptr + idx, mask=idx < first, other=0), axis=0)
    local = tl.arange(0, ROWS)
    rows = pid * ROWS + local
    rmask = rows < M
    f = tl.load(flags_ptr + rows, mask=rmask, other=0)
    excl = tl.cumsum(f, axis=0) - f
    pos_active = before + excl
    pos_inactive = M - 1 - (pid * ROWS - before + local - excl)
    tl.store(perm_ptr + tl.where(f > 0, pos_active, pos_inactive), rows, mask=rmask)
    if pid == tl.cdiv(M, ROWS) - 1:
        tl.store(count_ptr, before + tl.sum(f, axis=0))


@triton.jit(do_not_specialize=["M"])
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
    """(BLOCK_R, BLOCK_C, num_warps) of the sum-of-squares pass (topk mode): 8 rows x up to 512 columns, 8
    warps, the tiles the flags pass used until 2026-11-22 (chosen then for it by the earlier
    ``results/tuning/flags_sweep_h100.json``); this pass reads every column anyway."""
    if interpret:
        return 8, 16, 1
    return 8, max(64, min(triton.next_power_of_2(n), 512)), 8


@functools.lru_cache(maxsize=None)
def _flag_blocks(n: int, interpret: bool) -> tuple[int, int, int, int]:
    """(BLOCK_R, BLOCK_C, UNROLL, num_warps) of the flags pass: 4 rows x up to 256 columns, 2 column blocks a
    step, 4 warps. From a sweep on an H100 with the L2 cache flushed, as the bench times
    (``results/tuning/flags_sweep_flushed_h100.json``, 2026-11-22, 36 settings): over BERT-base and Llama-3.2-3B dY
    shapes at densities 0.1, 0.5 and 1.0 it was within 0.6% of each case's best on average, and up to 30%
    faster than the early-exit kernel before it (8 rows x 512 columns, 8 warps; e.g. 16384 x 768 at d = 0.5:
    14.9 -> 12.6 us; 16384 x 3072 at d = 1.0: 12.9 -> 9.1 us), at one of the 15 points 0.5% slower (4096 x 1024
    at d = 0.1)."""
    if interpret:
        return 8, 16, 2, 1
    return 4, max(16, min(triton.next_power_of_2(n), 256)), 2, 4


COMPACT_ROWS = 256  # rows each program of the compaction pass places


def selection_buffers(m: int, nb: int, device: torch.device):
    """(perm, flags, block_count, count): the int32 outputs of a flags pass over ``nb`` blocks of ``m`` rows
    and of the compaction after it, in one allocation (fewer host calls per layer)."""
    return torch.empty(2 * m + nb + 1, dtype=torch.int32, device=device).split((m, m, nb, 1))


def compact_plan(m: int, block_r: int, interpret: bool) -> tuple[int, dict]:
    """(programs, keywords) of the compaction pass after a flags pass over blocks of ``block_r`` rows (a power
    of 2, as ``COMPACT_ROWS`` is)."""
    nb = cdiv(m, block_r)
    rows = max(block_r, 16 if interpret else COMPACT_ROWS)
    block_nb = 16 if interpret else min(4096, max(16, triton.next_power_of_2(nb)))
    return cdiv(m, rows), {"BLOCK_R": block_r, "ROWS": rows, "BLOCK_NB": block_nb,
                           "num_warps": 1 if interpret else 4}


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
    idx, nb, n_compact, flags_ints, flags_kw, compact_kw = plan
    perm, flags, block_count, count = selection_buffers(m, nb, dy.device)
    _row_flags.launch_planned((nb,), idx, 3, (dy, flags, block_count, *flags_ints), flags_kw)
    _compact.launch_planned((n_compact,), idx, 4, (flags, block_count, perm, count, m), compact_kw)
    return perm, count


_SELECT_PLANS = Plans(_row_flags, _compact)  # (shape, dtype, strides, mode, eps, interpreter) -> both passes


def _select_plan(m, n, dtype, stride, mode, eps, interpret):
    """(plan number, flag blocks, compaction programs, the flags pass's scalar arguments, and both passes'
    keywords)."""
    block_r, block_c, unroll, warps = _flag_blocks(n, interpret)
    nb = cdiv(m, block_r)
    mode_id = EXACT if mode == "exact" else THRESHOLD
    flags_kw = {"MODE": mode_id, "BLOCK_R": block_r, "BLOCK_C": block_c, "UNROLL": unroll, "num_warps": warps}
    n_compact, compact_kw = compact_plan(m, block_r, interpret)
    return next(plan_ids), nb, n_compact, (m, n, *stride, _eps_in(eps, dtype)), flags_kw, compact_kw


def row_sumsq(x: torch.Tensor, interpret: bool = False) -> torch.Tensor:
    """fp32 (M,) = ||X_i||² of 2-D ``x`` in one pass (non-finite rows +Inf; :func:`_row_sumsq_kernel`): topk
    mode's ranking, sampled mode's ||X_i||²."""
    m, cols = x.shape
    block_r, block_c, warps = _row_blocks(cols, interpret)
    out = torch.empty(m, dtype=torch.float32, device=x.device)
    _row_sumsq[(cdiv(m, block_r),)](x, out, m, cols, x.stride(0), x.stride(1), BLOCK_R=block_r, BLOCK_C=block_c,
                                    num_warps=warps)
    return out


def _topk_perm(dy: torch.Tensor, n: int, interpret: bool) -> tuple[torch.Tensor, torch.Tensor]:
    m, cols = dy.shape
    dev = dy.device
    count = torch.full((1,), min(n, m), dtype=torch.int32, device=dev)
    if n >= m:
        return torch.arange(m, dtype=torch.int32, device=dev), count
    top = torch.topk(row_sumsq(dy, interpret), n, sorted=False).indices
    outside = torch.ones(m, dtype=torch.uint8, device=dev).index_fill_(0, top, 0)
    perm = torch.sort(outside, stable=True).indices  # chosen rows first, each group in row order
    return perm.to(torch.int32), count
