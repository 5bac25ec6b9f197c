"""dW = dY[active]ᵀ X[active] and db = dY[active].sum(0), reducing over the gathered rows in fp32.

Each program owns an (out, in) tile of dW and walks a contiguous range of the compacted row list. When the
dW tiles alone cannot fill the GPU (small layers), the rows are split over ``SPLIT`` programs per tile: a
split's range is ``chunk = max(ceil(k / SPLIT), MIN_CHUNK)`` rows (rounded to ``ROW_ALIGN``), computed on
the device from the device-side count k, so few rows use few splits. Splits write fp32 partials that
``_dw_reduce_kernel`` adds in a fixed order: the result is deterministic. With ``SPLIT == 1`` the kernel
writes dW directly. db rides along in the programs of the first ``in`` tile, from the dY tiles they load
anyway.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tuning import FP32_CONFIG, INTERPRET_CONFIG, dw_configs, tuned_launch_kwargs

ROW_ALIGN = 64  # split boundaries are multiples of this (and so of every BLOCK_K)
MIN_CHUNK = 512  # rows per split at least: a split must amortise its partial's write and read


@triton.jit
def _split_chunk(count, SPLIT, ROW_ALIGN: tl.constexpr, MIN_CHUNK: tl.constexpr):
    per = tl.cdiv(tl.cdiv(count, SPLIT), ROW_ALIGN) * ROW_ALIGN
    return tl.maximum(per, MIN_CHUNK)


@triton.jit
def _dw_loop(
    dy_ptr, x_ptr, perm_ptr, start, end,
    offs_o, offs_i, o_mask, i_mask,
    stride_dym, stride_dyo, stride_xm, stride_xi,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    WITH_DB: tl.constexpr, IEEE: tl.constexpr,
):
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_M], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    if IEEE:
        # fp32: sum blocks of 8 x BLOCK_K rows apart, then add them up (a two-level sum keeps the rounding
        # error near cuBLAS's; a single fused accumulator over thousands of rows doubles it).
        for j0 in range(start, end, 8 * BLOCK_K):
            part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for j in range(j0, tl.minimum(j0 + 8 * BLOCK_K, end), BLOCK_K):
                pos = j + offs_k
                valid = pos < end
                rows = tl.load(perm_ptr + pos, mask=valid, other=0).to(tl.int64)
                a = tl.load(dy_ptr + rows[:, None] * stride_dym + offs_o[None, :] * stride_dyo,
                            mask=valid[:, None] & o_mask[None, :], other=0.0)
                b = tl.load(x_ptr + rows[:, None] * stride_xm + offs_i[None, :] * stride_xi,
                            mask=valid[:, None] & i_mask[None, :], other=0.0)
                part = tl.dot(tl.trans(a), b, part, input_precision="ieee")
                if WITH_DB:
                    db += tl.sum(a.to(tl.float32), axis=0)
            acc += part
    else:
        # The row indices of the next block are loaded one iteration ahead: with the index load feeding
        # the data loads of the same iteration, the pipeliner keeps only two stages in flight.
        pos = start + offs_k
        rows = tl.load(perm_ptr + pos, mask=pos < end, other=0).to(tl.int64)
        for j in range(start, end, BLOCK_K):
            nxt = j + BLOCK_K + offs_k
            rows_next = tl.load(perm_ptr + nxt, mask=nxt < end, other=0).to(tl.int64)
            valid = (j + offs_k) < end
            a = tl.load(dy_ptr + rows[:, None] * stride_dym + offs_o[None, :] * stride_dyo,
                        mask=valid[:, None] & o_mask[None, :], other=0.0)  # (BLOCK_K, BLOCK_M) of dY
            b = tl.load(x_ptr + rows[:, None] * stride_xm + offs_i[None, :] * stride_xi,
                        mask=valid[:, None] & i_mask[None, :], other=0.0)  # (BLOCK_K, BLOCK_N) of X
            acc = tl.dot(tl.trans(a), b, acc)
            if WITH_DB:
                db += tl.sum(a.to(tl.float32), axis=0)
            rows = rows_next
    return acc, db


@triton.jit
def _dw_kernel(
    dy_ptr, x_ptr, dw_ptr, db_ptr, perm_ptr, count_ptr,
    M, N_OUT, N_IN, SPLIT, ROWS_HINT,
    stride_dym, stride_dyo, stride_xm, stride_xi,
    HAS_DB: tl.constexpr, USE_PARTIAL: tl.constexpr, IEEE: tl.constexpr,
    ROW_ALIGN: tl.constexpr, MIN_CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # dw_ptr/db_ptr are the final dW/db (USE_PARTIAL False) or fp32 partials [SPLIT, N_OUT*N_IN] / [SPLIT, N_OUT].
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    num_m = tl.cdiv(N_OUT, BLOCK_M)
    num_n = tl.cdiv(N_IN, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m

    count = tl.load(count_ptr)
    chunk = _split_chunk(count, SPLIT, ROW_ALIGN, MIN_CHUNK)
    start = pid_s * chunk
    end = tl.minimum(start + chunk, count)
    # A split past the last row does nothing; the reduce pass never reads it. (Split 0 always writes.)
    if (pid_s == 0) | (start < count):
        offs_o = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_i = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        o_mask = offs_o < N_OUT
        i_mask = offs_i < N_IN
        if HAS_DB and pid_n == 0:
            acc, db = _dw_loop(dy_ptr, x_ptr, perm_ptr, start, end, offs_o, offs_i, o_mask, i_mask,
                               stride_dym, stride_dyo, stride_xm, stride_xi,
                               BLOCK_M, BLOCK_N, BLOCK_K, True, IEEE)
            if USE_PARTIAL:
                tl.store(db_ptr + pid_s * N_OUT + offs_o, db, mask=o_mask)
            else:
                tl.store(db_ptr + offs_o, db.to(db_ptr.dtype.element_ty), mask=o_mask)
        else:
            acc, db = _dw_loop(dy_ptr, x_ptr, perm_ptr, start, end, offs_o, offs_i, o_mask, i_mask,
                               stride_dym, stride_dyo, stride_xm, stride_xi,
                               BLOCK_M, BLOCK_N, BLOCK_K, False, IEEE)
        offs = offs_o.to(tl.int64)[:, None] * N_IN + offs_i[None, :]
        mask = o_mask[:, None] & i_mask[None, :]
        if USE_PARTIAL:
            tl.store(dw_ptr + pid_s.to(tl.int64) * N_OUT * N_IN + offs, acc, mask=mask)
        else:
            tl.store(dw_ptr + offs, acc.to(dw_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dw_reduce_kernel(
    part_ptr, dbpart_ptr, dw_ptr, db_ptr, count_ptr,
    NUMEL, N_OUT, SPLIT, NBLK_W,
    HAS_DB: tl.constexpr, ROW_ALIGN: tl.constexpr, MIN_CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    count = tl.load(count_ptr)
    n_eff = tl.maximum(tl.cdiv(count, _split_chunk(count, SPLIT, ROW_ALIGN, MIN_CHUNK)), 1)
    if pid < NBLK_W:
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < NUMEL
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(0, n_eff):  # fixed order: deterministic
            acc += tl.load(part_ptr + s * NUMEL + offs, mask=mask, other=0.0)
        tl.store(dw_ptr + offs, acc.to(dw_ptr.dtype.element_ty), mask=mask)
    elif HAS_DB:
        offs = (pid - NBLK_W).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N_OUT
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(0, n_eff):
            acc += tl.load(dbpart_ptr + s * N_OUT + offs, mask=mask, other=0.0)
        tl.store(db_ptr + offs, acc.to(db_ptr.dtype.element_ty), mask=mask)


_dw_tuned = None
_CHOSEN: dict = {}  # autotune key -> chosen launch kwargs


def _tuned_kernel():
    global _dw_tuned
    if _dw_tuned is None:
        key = ["M", "N_OUT", "N_IN", "SPLIT", "ROWS_HINT"]
        _dw_tuned = triton.autotune(configs=dw_configs(), key=key)(_dw_kernel)
    return _dw_tuned


def dw_splits(n_out: int, n_in: int, m: int, n_sm: int) -> int:
    """Row splits per dW tile: the fewest that fill the GPU in whole waves (>= 85%), at most 8, and none
    that would leave a split fewer than MIN_CHUNK rows at full density."""
    tiles = triton.cdiv(n_out, 128) * triton.cdiv(n_in, 128)
    best = 1
    for s in range(1, 9):
        if s > 1 and m < s * MIN_CHUNK:
            break
        best = s
        waves = triton.cdiv(tiles * s, n_sm)
        if tiles * s / (waves * n_sm) >= 0.85:
            break
    return best


def dw_db_rows(dy: torch.Tensor, x: torch.Tensor, perm: torch.Tensor, count: torch.Tensor,
               need_db: bool, split: int, interpret: bool = False, ieee: bool = True,
               w_dtype: torch.dtype | None = None, rows_hint: int | None = None):
    """(dW, db or None) over rows perm[:count]; ``split`` row splits per tile (see :func:`dw_splits`);
    ``rows_hint`` (expected k) only picks tuned tile shapes."""
    m, n_out = dy.shape
    n_in = x.shape[1]
    dev = dy.device
    dw = torch.empty((n_out, n_in), dtype=w_dtype or x.dtype, device=dev)
    db = torch.empty(n_out, dtype=dy.dtype, device=dev) if need_db else None
    use_partial = split > 1
    if use_partial:
        part = torch.empty((split, n_out * n_in), dtype=torch.float32, device=dev)
        dbpart = torch.empty((split, n_out), dtype=torch.float32, device=dev) if need_db else part
        out_w, out_b = part, dbpart
    else:
        out_w, out_b = dw, (db if need_db else dw)
    args = (dy, x, out_w, out_b, perm, count, m, n_out, n_in, split, rows_hint or m,
            dy.stride(0), dy.stride(1), x.stride(0), x.stride(1))
    consts = dict(HAS_DB=need_db, USE_PARTIAL=use_partial, IEEE=ieee, ROW_ALIGN=ROW_ALIGN, MIN_CHUNK=MIN_CHUNK)
    if interpret or dy.dtype == torch.float32:
        cfg = INTERPRET_CONFIG if interpret else FP32_CONFIG
        if interpret:
            consts.update(ROW_ALIGN=16, MIN_CHUNK=16)
        grid = (triton.cdiv(n_out, cfg["BLOCK_M"]) * triton.cdiv(n_in, cfg["BLOCK_N"]), split)
        _dw_kernel[grid](*args, **consts, **cfg)
    else:
        def grid(meta):
            return (triton.cdiv(n_out, meta["BLOCK_M"]) * triton.cdiv(n_in, meta["BLOCK_N"]), split)

        key = (m, n_out, n_in, split, args[10], dy.dtype, need_db)
        kw = tuned_launch_kwargs(_tuned_kernel(), _CHOSEN, key, lambda tuned: tuned[grid](*args, **consts),
                                 rows_known=rows_hint is not None)
        if kw is not None:
            _dw_kernel[grid(kw)](*args, **consts, **kw)
    if use_partial:
        block = 1024
        nblk_w = triton.cdiv(n_out * n_in, block)
        nblk_b = triton.cdiv(n_out, block) if need_db else 0
        _dw_reduce_kernel[(nblk_w + nblk_b,)](
            part, dbpart, dw, db if need_db else dw, count, n_out * n_in, n_out, split, nblk_w,
            HAS_DB=need_db, ROW_ALIGN=consts["ROW_ALIGN"], MIN_CHUNK=consts["MIN_CHUNK"], BLOCK=block,
            num_warps=1 if interpret else 4)
    return dw, db
