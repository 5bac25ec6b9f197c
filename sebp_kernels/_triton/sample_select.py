"""Row selection of sampled mode on the device (:mod:`sebp_kernels.sampling`): row norms, the keep draws and the
row scales in one pass over dY, then one compaction; no host sync, no sort.

1. ``_sampled_flags_kernel``: each program reads every column of its ``BLOCK_R`` rows (the norm needs them all)
   and writes, per row, w = ||dY_i||_2 (fp32, for the layer's next cutoff), its keep probability q on the 24-bit
   grid and 1/q, and a flag: 0 a zero row, 1 a non-zero row left out of dW, 2 a row kept for dW. The keep test
   is the torch reference's bit for bit: the draw is splitmix64's mixer over (seed, layer key, backward count,
   row) in uint64 arithmetic (:func:`_row_draws`), kept when draw < ceil(p * 2^24) with p = min(1, w / tau).
   The backward count is read from the device (``hash_ptr``: the layer's stream key and its count), so a CUDA
   graph's replays draw anew.
2. ``_sampled_compact_kernel``: one permutation of the M rows serves both products: the kept rows first (in
   row order: dW and db read ``perm[:kept]``), then the other non-zero rows (dX, exact over the non-zero rows,
   reads ``perm[:nonzero]``), then the zero rows. Its last program writes both counts, adds them and M to the
   layer's device counters after warm-up and advances the backward count. Two permutations would cost a second
   compaction launch and M more indices for nothing: dX reads its rows through the permutation in any order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import FastLaunch
from .select import _row_blocks, compact_plan
from .tuning import cdiv


@triton.jit
def _mix64(z):
    """splitmix64's mixer on uint64 (products wrap mod 2^64; ``>>`` on unsigned is logical), as
    :func:`sebp_kernels.sampling.mix64`."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _row_draws(hash_ptr, rows):
    """int32 draws in [0, 2^24) of ``rows`` (0-based) for the backward whose stream key (mix64(seed * golden +
    layer key), as int64 bits) and count are ``hash_ptr[0]`` and ``hash_ptr[1]``: the device side of
    :func:`~sebp_kernels.sampling.stream_base` and :func:`~sebp_kernels.sampling.row_draws`."""
    key = tl.load(hash_ptr).to(tl.uint64, bitcast=True)
    step = tl.load(hash_ptr + 1).to(tl.uint64, bitcast=True)
    base = _mix64(key + step * 0x9E3779B97F4A7C15)
    r = (rows + 1).to(tl.int64).to(tl.uint64, bitcast=True)
    return (_mix64(r * 0x9E3779B97F4A7C15 + base) >> 40).to(tl.int32)


@triton.jit(do_not_specialize=["M"])
def _sampled_flags_kernel(
    dy_ptr, tau_ptr, hash_ptr, flags_ptr, kept_count_ptr, active_count_ptr, w_ptr, q_ptr, scale_ptr, wmax_ptr,
    M, N, stride_m, stride_n, WARMUP,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < M
    row_ptrs = dy_ptr + rows.to(tl.int64)[:, None] * stride_m
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    active = tl.zeros([BLOCK_R], dtype=tl.int32)
    for c0 in range(0, N, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        t = tl.load(row_ptrs + cols[None, :] * stride_n, mask=rmask[:, None] & (cols < N)[None, :], other=0.0)
        active = tl.maximum(active, tl.max((t != 0).to(tl.int32), axis=1))  # NaN and Inf are non-zero
        t = t.to(tl.float32)
        acc += tl.sum(t * t, axis=1)
    w = tl.sqrt_rn(acc)
    tau = tl.load(tau_ptr)
    # p = min(1, w / tau); 1 where tau is 0, w is not a positive finite number, or p is NaN; 1 in warm-up
    p = tl.minimum(tl.div_rn(w, tl.where(tau > 0, tau, 1.0)), 1.0)
    p = tl.where((p == p) & (w > 0) & (w < float("inf")), p, 1.0)
    p = tl.where(tau > 0, p, 1.0)
    p = tl.where(tl.load(hash_ptr + 1) < WARMUP, 1.0, p)
    thresh = tl.ceil(p * 16777216.0)  # ceil(p * 2^24), exact in fp32
    kept = active * (_row_draws(hash_ptr, rows) < thresh.to(tl.int32)).to(tl.int32)
    q = thresh * (1.0 / 16777216.0)
    tl.store(flags_ptr + rows, active + kept, mask=rmask)
    tl.store(w_ptr + rows, w, mask=rmask)
    tl.store(q_ptr + rows, q, mask=rmask)
    tl.store(scale_ptr + rows, tl.div_rn(tl.full([BLOCK_R], 1.0, tl.float32), q), mask=rmask)
    tl.store(kept_count_ptr + pid, tl.sum(kept, axis=0))
    tl.store(active_count_ptr + pid, tl.sum(active, axis=0))
    tl.store(wmax_ptr + pid, tl.max(tl.where((w == w) & (w < float("inf")), w, 0.0), axis=0))  # for the cutoff


@triton.jit(do_not_specialize=["M", "NB", "count_ptr"])
def _sampled_compact_kernel(
    flags_ptr, kept_count_ptr, active_count_ptr, perm_ptr, count_ptr, hash_ptr, stats_ptr,
    M, NB, WARMUP,
    BLOCK_R: tl.constexpr, ROWS: tl.constexpr, BLOCK_NB: tl.constexpr,
):
    # Program pid places ROWS rows (a multiple of BLOCK_R): kept rows at [0, K), the other non-zero rows at
    # [K, A), zero rows from the back (K, A: the kept and non-zero totals).
    pid = tl.program_id(0)
    first = pid * (ROWS // BLOCK_R)  # blocks before this program's rows
    zero = tl.sum(tl.zeros([BLOCK_NB], dtype=tl.int32), axis=0)
    kept_before, act_before, kept_total = zero, zero, zero
    for s in range(0, NB, BLOCK_NB):
        idx = s + tl.arange(0, BLOCK_NB)
        kc = tl.load(kept_count_ptr + idx, mask=idx < NB, other=0)
        ac = tl.load(active_count_ptr + idx, mask=idx < first, other=0)
        kept_total += tl.sum(kc, axis=0)
        kept_before += tl.sum(tl.where(idx < first, kc, 0), axis=0)
        act_before += tl.sum(ac, axis=0)
    local = tl.arange(0, ROWS)
    rows = pid * ROWS + local
    rmask = rows < M
    f = tl.load(flags_ptr + rows, mask=rmask, other=0)
    is_kept = (f == 2).to(tl.int32)
    is_other = (f == 1).to(tl.int32)
    is_act = is_kept + is_other
    pos_kept = kept_before + tl.cumsum(is_kept, axis=0) - is_kept
    pos_other = kept_total + (act_before - kept_before) + tl.cumsum(is_other, axis=0) - is_other
    pos_zero = M - 1 - (pid * ROWS - act_before + local - (tl.cumsum(is_act, axis=0) - is_act))
    tl.store(perm_ptr + tl.where(f == 2, pos_kept, tl.where(f == 1, pos_other, pos_zero)), rows, mask=rmask)
    if pid == tl.cdiv(M, ROWS) - 1:
        act_total = act_before + tl.sum(is_act, axis=0)
        tl.store(count_ptr, kept_total)
        tl.store(count_ptr + 1, act_total)
        step = tl.load(hash_ptr + 1)
        if step >= WARMUP:  # the layer's counters of the rows it sampled (SampleState.counts)
            tl.store(stats_ptr, tl.load(stats_ptr) + M)
            tl.store(stats_ptr + 1, tl.load(stats_ptr + 1) + act_total.to(tl.int64))
            tl.store(stats_ptr + 2, tl.load(stats_ptr + 2) + kept_total.to(tl.int64))
        tl.store(hash_ptr + 1, step + 1)


_flags = FastLaunch(_sampled_flags_kernel)
_compact = FastLaunch(_sampled_compact_kernel)


def select_sampled(dy: torch.Tensor, tau: torch.Tensor, hash_state: torch.Tensor, stats: torch.Tensor,
                   warmup: int, interpret: bool = False):
    """(perm, counts, w, q, scale, wmax) of one sampled backward of 2-D ``dy`` (M, out): the int32 permutation
    (kept rows, the other non-zero rows, zero rows), int32 counts (2,) = (kept, non-zero), fp32 (M,) row norms,
    keep probabilities (1 on zero rows and in warm-up) and their inverses, and each row block's largest finite
    norm. ``tau``: the layer's fp32 cutoff (a device scalar); ``hash_state``: int64 (2,), the layer's stream
    key and backward count (advanced here); ``stats``: int64 (3,), the rows, non-zero rows and kept rows summed
    once the count reaches ``warmup``."""
    m, n = dy.shape
    block_r, block_c, warps = _row_blocks(n, interpret)  # the sum-of-squares pass's tiles: it too reads every column
    nb = cdiv(m, block_r)
    dev = dy.device
    perm, flags, kept_count, active_count, counts = torch.empty(2 * m + 2 * nb + 2, dtype=torch.int32,
                                                               device=dev).split((m, m, nb, nb, 2))
    w, q, scale, wmax = torch.empty(3 * m + nb, dtype=torch.float32, device=dev).split((m, m, m, nb))
    _flags[(nb,)](dy, tau, hash_state, flags, kept_count, active_count, w, q, scale, wmax, m, n, dy.stride(0),
                  dy.stride(1), warmup, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    n_compact, kw = compact_plan(m, block_r, interpret)
    _compact[(n_compact,)](flags, kept_count, active_count, perm, counts, hash_state, stats, m, nb, warmup, **kw)
    return perm, counts, w, q, scale, wmax
