"""dX = dY @ W over the active rows, zeros elsewhere, in one kernel.

The grid covers the worst case (all M rows). Program tile ``pid_m`` covers positions
``[pid_m * BLOCK_M, (pid_m + 1) * BLOCK_M)`` of the row permutation from the select pass. Tiles wholly past
the device-side count ``k`` hold inactive rows: they store zeros into those rows of dX and do no GEMM work;
a tile that straddles ``k`` loads its inactive rows as zeros, so they come out zero too. Every row of dX is
written exactly once, so dX needs no memset.

With ``REUSE`` (a :class:`~sebp_kernels.zero_rows.ZeroRowBuffer` as dX), dX is a buffer whose rows stay
zero between backwards, and ``dirty`` (int8 per row) says which rows may hold non-zeros. The computing tiles
mark their rows; the zero tiles past ``k`` write only the dirty rows, each program a run of one row tile's
column tiles, and the last program of a row tile to finish clears the marks (a ticket per row tile puts that
after every program's read). A backward then writes its active rows and the rows active the time before,
not all M. On an H100 (2026-11-23) one program per row tile was too few for M = 4096 (slower there than
writing every zero row) and one per tile too many for M = 16384; ``ZERO_PROGRAMS_PER_SM`` sets how many.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dw import _tickets
from .launch import FastLaunch
from .tiles import _store_split, grouped_tile
from .tuning import cdiv, gemm_config


@triton.jit
def _perm_rows(perm_ptr, pos, in_m, BIG: tl.constexpr):
    """The rows of dY/dX at permutation positions ``pos`` (int64 offsets when the tensors need them)."""
    rows = tl.load(perm_ptr + pos, mask=in_m, other=0)
    if BIG:
        rows = rows.to(tl.int64)
    return rows


@triton.jit
def _dx_acc(
    dy_ptr, w_ptr, rows, active, offs_n, n_mask, k_start, k_end, K,
    stride_dym, stride_dyk, stride_wk, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, IEEE: tl.constexpr, STAGES: tl.constexpr,
):
    """fp32 (BLOCK_M, BLOCK_N) = dY[rows, k_start:k_end] @ W[k_start:k_end, offs_n] (inactive rows: zero)."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = dy_ptr + rows[:, None] * stride_dym + offs_k[None, :] * stride_dyk
    b_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if IEEE:
        # fp32: a two-level sum over blocks of 8 x BLOCK_K (see the dW kernel).
        for k0 in range(k_start, k_end, 8 * BLOCK_K):
            part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k1 in range(k0, tl.minimum(k0 + 8 * BLOCK_K, k_end), BLOCK_K):
                k_in = (k1 + offs_k) < k_end
                a = tl.load(a_ptrs + k1 * stride_dyk, mask=active[:, None] & k_in[None, :], other=0.0)
                b = tl.load(b_ptrs + k1 * stride_wk, mask=k_in[:, None] & n_mask, other=0.0)
                part = tl.dot(a, b, part, input_precision="ieee")
            acc += part
    else:
        a_ptrs += k_start * stride_dyk
        b_ptrs += k_start * stride_wk
        for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
            if EVEN_K:  # every split boundary and K are multiples of BLOCK_K
                a = tl.load(a_ptrs, mask=active[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=n_mask, other=0.0)
            else:
                k_in = (k0 + offs_k) < K
                a = tl.load(a_ptrs, mask=active[:, None] & k_in[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_in[:, None] & n_mask, other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K * stride_dyk
            b_ptrs += BLOCK_K * stride_wk
    return acc


@triton.jit
def _dx_work(count, N, K, FILL, EXTRA, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MIN_K: tl.constexpr,
             MAX_SPLIT: tl.constexpr):
    """(T, S): the dX tiles that hold active rows and the K pieces each is split into (see ``_dx_program``);
    the first T * S programs of the dX grid compute, the rest write zero rows or exit."""
    t_act = tl.cdiv(count, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    t_div = tl.maximum(t_act, 1)
    # T * S stays within FILL: one more piece than the free SMs hold starts a second wave (measured on an
    # H100 with dX alone, where FILL is every SM: cdiv(FILL, T) here made k/v 3072 -> 1024 at d = 0.2 take
    # 35 us instead of 15, results/tuning/dx_only_splits_h100.json).
    n_split = tl.minimum(tl.minimum(1 + EXTRA // t_div, FILL // t_div),
                         tl.minimum(tl.maximum(K // MIN_K, 1), MAX_SPLIT))
    return t_act, tl.maximum(n_split, 1)


@triton.jit
def _dx_program(
    dy_ptr, w_ptr, dx_ptr, part_ptr, perm_ptr, ticket_ptr, dirty_ptr, zt_ticket_ptr, count, g, FILL, EXTRA,
    M, N, K,
    stride_dym, stride_dyk, stride_wk, stride_wn, stride_dxm, stride_dxn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, IEEE: tl.constexpr, BIG: tl.constexpr, STAGES: tl.constexpr,
    MIN_K: tl.constexpr, MAX_SPLIT: tl.constexpr, REUSE: tl.constexpr, ZERO_PROGRAMS: tl.constexpr,
    bias_ptr, HAS_BIAS: tl.constexpr, scale_ptr, SCALED: tl.constexpr,
):
    """Program ``g`` of the dX grid (``cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) + EXTRA`` programs; also called by
    the fused gradient kernel). STAGES: software-pipeline depth of the main loop.

    The T = cdiv(k, BLOCK_M) * cdiv(N, BLOCK_N) tiles that hold active rows come first. When they are fewer
    than FILL (the SMs free for dX), each is split over K into S pieces (S <= 1 + EXTRA // T, T * S <= FILL,
    pieces of at least MIN_K, at most MAX_SPLIT), chosen here from the device-side k: the spare EXTRA
    programs do the extra pieces, and the last piece to finish adds the fp32 partials in piece order
    (``part_ptr``: at least T * S tiles of BLOCK_M x BLOCK_N; ``ticket_ptr``: T counters, zero between
    launches). The programs after those write the zero rows of the tiles wholly past k (with ``REUSE``: only
    the dirty ones; ``zt_ticket_ptr``: a counter per row tile, zero between launches); the rest exit.
    ``HAS_BIAS`` (the forward over rows, never with ``REUSE``): every row gets ``bias_ptr``'s N values added,
    the computed ones in fp32 before their one rounding (to the first K piece's partial), the others as they are.
    ``SCALED`` (sampled mode's ``sample_dx``): each computed row times its fp32 factor ``scale_ptr[row]``.
    """
    # M rows of dY/dX, N = in_features, K = out_features.
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    m_act = tl.cdiv(count, BLOCK_M)
    t_act, n_split = _dx_work(count, N, K, FILL, EXTRA, BLOCK_M, BLOCK_N, MIN_K, MAX_SPLIT)
    offs_bm = tl.arange(0, BLOCK_M)
    offs_bn = tl.arange(0, BLOCK_N)
    if g < t_act * n_split:
        t = g % t_act
        pid_s = g // t_act
        pid_m, pid_n = grouped_tile(t, count, N, BLOCK_M, BLOCK_N, GROUP_M)
        pos = pid_m * BLOCK_M + offs_bm
        in_m = pos < M
        rows = _perm_rows(perm_ptr, pos, in_m, BIG)
        offs_n = pid_n * BLOCK_N + offs_bn
        n_mask = (offs_n < N)[None, :]
        chunk = tl.cdiv(tl.cdiv(K, n_split), BLOCK_K) * BLOCK_K
        k_start = pid_s * chunk
        acc = _dx_acc(dy_ptr, w_ptr, rows, pos < count, offs_n, n_mask, k_start, tl.minimum(k_start + chunk, K),
                      K, stride_dym, stride_dyk, stride_wk, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, IEEE,
                      STAGES)
        if SCALED:
            acc = acc * tl.load(scale_ptr + rows, mask=in_m, other=0.0)[:, None]
        if HAS_BIAS:
            b = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            acc += tl.where(pid_s == 0, 1.0, 0.0) * b[None, :]
        _store_split(dx_ptr, rows[:, None] * stride_dxm + offs_n[None, :] * stride_dxn,
                     part_ptr + t * (BLOCK_M * BLOCK_N), offs_bm[:, None] * BLOCK_N + offs_bn[None, :],
                     t_act * (BLOCK_M * BLOCK_N), ticket_ptr, t, acc, in_m[:, None] & n_mask, pid_s, n_split)
        if REUSE:
            if (pid_n == 0) & (pid_s == 0):  # every row of the tile is written: the active ones may be non-zero
                tl.store(dirty_ptr + rows, (pos < count).to(tl.int8), mask=in_m)
    elif REUSE:
        # The zero tiles as below, but only their dirty rows, and a program takes a run of a row tile's
        # column tiles: enough programs to spread over the GPU (ZERO_PROGRAMS) whether the row tiles past k
        # are few (Llama, M = 4096) or many (BERT, M = 16384), not a program per tile. The last program of a
        # row tile to finish (a ticket per row tile) clears the marks, after every program has read them.
        z = g - t_act * n_split
        n_zt = tl.cdiv(M, BLOCK_M) - m_act
        per = tl.cdiv(n_tiles_n, tl.minimum(tl.maximum(tl.cdiv(ZERO_PROGRAMS, tl.maximum(n_zt, 1)), 1),
                                            n_tiles_n))  # column tiles a program
        n_runs = tl.cdiv(n_tiles_n, per)
        if z < n_zt * n_runs:
            zt = m_act + z // n_runs
            pos = zt * BLOCK_M + offs_bm
            in_m = pos < M
            rows = _perm_rows(perm_ptr, pos, in_m, BIG)
            dirty = tl.load(dirty_ptr + rows, mask=in_m, other=0) != 0
            if tl.max(dirty.to(tl.int32), axis=0) > 0:
                zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=dx_ptr.dtype.element_ty)
                n0 = (z % n_runs) * per * BLOCK_N
                for n1 in range(n0, tl.minimum(n0 + per * BLOCK_N, N), BLOCK_N):
                    offs_n = n1 + offs_bn
                    tl.store(dx_ptr + rows[:, None] * stride_dxm + offs_n[None, :] * stride_dxn, zeros,
                             mask=dirty[:, None] & (offs_n < N)[None, :])
                if tl.atomic_add(zt_ticket_ptr + zt, 1, sem="acq_rel") == n_runs - 1:
                    tl.store(dirty_ptr + rows, tl.zeros([BLOCK_M], dtype=tl.int8), mask=dirty)
                    tl.atomic_xchg(zt_ticket_ptr + zt, 0)
    else:
        z = g - t_act * n_split  # zero tiles: row tiles m_act, m_act + 1, ... (all past k)
        if z < (tl.cdiv(M, BLOCK_M) - m_act) * n_tiles_n:
            pos = (m_act + z // n_tiles_n) * BLOCK_M + offs_bm
            in_m = pos < M
            rows = _perm_rows(perm_ptr, pos, in_m, BIG)
            offs_n = (z % n_tiles_n) * BLOCK_N + offs_bn
            fill = tl.zeros([BLOCK_M, BLOCK_N], dtype=dx_ptr.dtype.element_ty)
            if HAS_BIAS:
                fill += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(fill.dtype)[None, :]
            tl.store(dx_ptr + rows[:, None] * stride_dxm + offs_n[None, :] * stride_dxn, fill,
                     mask=in_m[:, None] & (offs_n < N)[None, :])


@triton.jit(do_not_specialize=["FILL", "EXTRA", "M", "count_ptr"])
def _dx_kernel(
    dy_ptr, w_ptr, dx_ptr, part_ptr, perm_ptr, count_ptr, ticket_ptr, bias_ptr, FILL, EXTRA,
    M, N, K,
    stride_dym, stride_dyk, stride_wk, stride_wn, stride_dxm, stride_dxn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, IEEE: tl.constexpr, BIG: tl.constexpr, STAGES: tl.constexpr,
    MIN_K: tl.constexpr, MAX_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    _dx_program(dy_ptr, w_ptr, dx_ptr, part_ptr, perm_ptr, ticket_ptr, perm_ptr, perm_ptr, tl.load(count_ptr),
                tl.program_id(0), FILL, EXTRA, M, N, K, stride_dym, stride_dyk, stride_wk, stride_wn, stride_dxm,
                stride_dxn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K, IEEE, BIG, STAGES, MIN_K, MAX_SPLIT, False,
                1, bias_ptr, HAS_BIAS, perm_ptr, False)


_dx = FastLaunch(_dx_kernel)


MIN_K = 512  # K per dX split at least (8 steps of BLOCK_K = 64), beside the dW tiles of the fused launch
# ... and when dX runs alone (frozen weight: every SM free, T small): pieces shorter than this lost to no split
# on an H100 (k/v 3072 -> 1024 at d = 0.05: 22.8 us in 2 pieces of 512, 14.3 us whole; Llama down at d = 0.05:
# 54.0 in 2 pieces of 1536, 51.3 whole), longer ones won (gate/up at d = 0.05: 51.1 in 5 pieces of 1638, 77.4
# whole). With 1600 the rule picks the faster of the two measured choices at all 21 points of
# results/tuning/dx_only_splits_h100.json (this value itself not re-run there).
MIN_K_ALONE = 1600
MAX_SPLIT = 16
ZERO_PROGRAMS_PER_SM = 1  # programs that zero a kept dX's dirty rows: 1-8 a SM, 1 best (results/tuning/zero_programs_sweep_h100.json)


def dx_split_args(m: int, n: int, k_dim: int, cfg: dict, n_sm: int, interpret: bool, busy: int = 0):
    """(programs, EXTRA, FILL, MIN_K, partial tiles) of a dX grid: one program per output tile plus EXTRA for
    the K splits, and room for T * S <= 2 * FILL partial tiles (the kernel splits only when T is below FILL).
    FILL = the SMs that ``busy`` programs of other work in the same launch (the dW tiles) leave free; no free
    SM (or the interpreter's stand-in of one SM) means no split, no extra programs, no partials."""
    tiles = cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"])
    fill = n_sm - busy
    if fill < 2:
        return tiles, 0, 1, cfg["BLOCK_K"], 0
    min_k = cfg["BLOCK_K"] if interpret else (MIN_K if busy else MIN_K_ALONE)
    return tiles + fill, fill, fill, min_k, 2 * fill


def dx_launch_args(m: int, n: int, k_dim: int, dtype, a_stride: tuple, b_stride: tuple, interpret: bool, ieee: bool,
                   n_sm: int, busy: int, level: int, small: bool, has_bias: bool) -> tuple[int, int, tuple, dict]:
    """(programs, fp32 partial-sum elements, the integer arguments after the tensors, the keywords) of a launch
    of :func:`_dx_kernel` computing rows of A (M, K; strides ``a_stride``) @ B (K, N; strides ``b_stride``) into
    a contiguous (M, N) output; ``busy``, ``level``, ``small`` as in :func:`dx_rows`."""
    cfg = gemm_config("dx", dtype, interpret, level, small)
    programs, extra, fill, min_k, part_tiles = dx_split_args(m, n, k_dim, cfg, n_sm, interpret, busy)
    big = max(a_stride[0], n) * m >= 2**31
    ints = (fill, extra, m, n, k_dim, *a_stride, *b_stride, n, 1)
    kw = dict(EVEN_K=k_dim % cfg["BLOCK_K"] == 0, IEEE=ieee, BIG=big, STAGES=cfg.get("num_stages", 1), MIN_K=min_k,
              MAX_SPLIT=MAX_SPLIT, HAS_BIAS=has_bias, **cfg)
    return programs, part_tiles * cfg["BLOCK_M"] * cfg["BLOCK_N"], ints, kw


def dx_rows(dy: torch.Tensor, weight: torch.Tensor, perm: torch.Tensor, count: torch.Tensor,
            interpret: bool = False, ieee: bool = True, n_sm: int = 1, busy: int = 0, level: int = 0,
            small: bool = False) -> torch.Tensor:
    """dX (M, in) = dY[perm[:k]] @ W scattered to rows perm[:k], zeros on the other rows (K splits when the
    active tiles cannot fill the ``n_sm - busy`` free SMs). ``level``, ``small``: the tile setting
    (:func:`~.tuning.gemm_config`). ``weight`` may be a transposed view. (The forward over rows launches the
    same kernel with its own plans, :mod:`.fwd`.)"""
    m, k_dim = dy.shape
    n = weight.shape[1]
    programs, part_n, ints, kw = dx_launch_args(m, n, k_dim, dy.dtype, dy.stride(), weight.stride(), interpret, ieee,
                                                n_sm, busy, level, small, False)
    dx = torch.empty((m, n), dtype=dy.dtype, device=dy.device)
    part = torch.empty(part_n, dtype=torch.float32, device=dy.device) if part_n else dx
    _dx[(programs,)](dy, weight, dx, part, perm, count, _tickets(dy.device, n_sm), dy, *ints, **kw)
    return dx
