"""Backward of LayerNorm and RMSNorm over the rows of dL/dY that hold a non-zero, in one pass over dY.

A norm works row by row, so a zero row of dY gives a zero row of dX and adds nothing to dW (= sum of
dY * x_hat) or db (= sum of dY): exact mode, the same gradients as the dense backward. Unlike the linear
layer, a norm needs no row selection pass: each program reads its rows of dY (which the exact test needs
anyway), and loads x, mean and rstd only for the rows that turn out to hold a non-zero (predicated loads of
the other rows move no memory). Zero rows get zeros in dX from the same program.

Each program owns a contiguous range of rows and keeps fp32 column sums of dY * x_hat and dY; a second small
kernel adds the programs' sums, in blocks of programs summed as trees, in a fixed order (deterministic), into
dW and db.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import FastLaunch, Plans, fit_to_device, plan_ids
from .tuning import cdiv

MAX_N = 16384  # wider rows go to the torch reference (one row must fit in a program's registers)


@triton.jit(do_not_specialize=["M", "ROWS"])
def _norm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, part_ptr, dirty_ptr,
    M, N, ROWS, stride_dy, stride_x, stride_dx,
    HAS_MEAN: tl.constexpr, HAS_W: tl.constexpr, DO_DX: tl.constexpr, DO_DB: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, ACC2D: tl.constexpr,
    KEEP: tl.constexpr,
):
    # KEEP: dX is a kept buffer (sebp_kernels.zero_rows): of its zero rows only those marked in dirty_ptr
    # are written, and each row is left marked as active or not (a program owns its rows, all columns).
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    if ACC2D:  # column sums kept per tile row, reduced over the rows once at the end
        acc_w = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    else:
        acc_w = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_N], dtype=tl.float32)
    start = pid * ROWS
    end = tl.minimum(start + ROWS, M)
    for r0 in tl.range(start, end, BLOCK_R, num_stages=STAGES):  # the next tiles' loads in flight
        rows = r0 + tl.arange(0, BLOCK_R)
        rmask = rows < end
        r64 = rows.to(tl.int64)
        m2 = rmask[:, None] & cmask[None, :]
        dy = tl.load(dy_ptr + r64[:, None] * stride_dy + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        active = tl.max((dy != 0).to(tl.int32), axis=1) > 0  # NaN compares unequal to 0: active
        am = active[:, None] & cmask[None, :]
        rstd = tl.load(rstd_ptr + rows, mask=active, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=am, other=0.0).to(tl.float32)
        if HAS_MEAN:
            mean = tl.load(mean_ptr + rows, mask=active, other=0.0).to(tl.float32)
            xhat = tl.where(am, (x - mean[:, None]) * rstd[:, None], 0.0)
        else:
            xhat = x * rstd[:, None]
        if DO_DX:
            if HAS_W:
                g = dy * w[None, :]
            else:
                g = dy
            c1 = tl.sum(g * xhat, axis=1) / N
            if HAS_MEAN:
                c2 = tl.sum(g, axis=1) / N
                dx = (g - c2[:, None] - xhat * c1[:, None]) * rstd[:, None]
            else:
                dx = (g - xhat * c1[:, None]) * rstd[:, None]
            store = m2
            if KEEP:
                dirty = tl.load(dirty_ptr + rows, mask=rmask, other=0) != 0
                store = m2 & (active | dirty)[:, None]
                tl.store(dirty_ptr + rows, active.to(tl.int8), mask=rmask)
            tl.store(dx_ptr + r64[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=store)
        if ACC2D:
            acc_w += dy * xhat
            if DO_DB:
                acc_b += dy
        else:
            acc_w += tl.sum(dy * xhat, axis=0)
            if DO_DB:
                acc_b += tl.sum(dy, axis=0)
    if ACC2D:
        acc_w = tl.sum(acc_w, axis=0)
        acc_b = tl.sum(acc_b, axis=0)
    base = part_ptr + pid.to(tl.int64) * 2 * N
    tl.store(base + cols, acc_w, mask=cmask)
    if DO_DB:
        tl.store(base + N + cols, acc_b, mask=cmask)


@triton.jit
def _sum_parts_kernel(part_ptr, dw_ptr, db_ptr, P, N, DO_DW: tl.constexpr, DO_DB: tl.constexpr,
                      BLOCK: tl.constexpr, BLOCK_P: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cm = cols < N
    aw = tl.zeros([BLOCK], dtype=tl.float32)
    ab = tl.zeros([BLOCK], dtype=tl.float32)
    ps = tl.arange(0, BLOCK_P)
    # BLOCK_P programs' sums at a time, added as a tree (a running sum over hundreds of programs loses fp32
    # digits); the same order every time, so the result depends on the data only
    for p0 in range(0, P, BLOCK_P):
        rows = (p0 + ps).to(tl.int64) * 2 * N
        m2 = ((p0 + ps) < P)[:, None] & cm[None, :]
        if DO_DW:
            aw += tl.sum(tl.load(part_ptr + rows[:, None] + cols[None, :], mask=m2, other=0.0), axis=0)
        if DO_DB:
            ab += tl.sum(tl.load(part_ptr + rows[:, None] + N + cols[None, :], mask=m2, other=0.0), axis=0)
    if DO_DW:
        tl.store(dw_ptr + cols, aw.to(dw_ptr.dtype.element_ty), mask=cm)
    if DO_DB:
        tl.store(db_ptr + cols, ab.to(db_ptr.dtype.element_ty), mask=cm)


_norm_bwd = FastLaunch(_norm_bwd_kernel)
_sum_parts = FastLaunch(_sum_parts_kernel)
_PLANS = Plans(_norm_bwd, _sum_parts)


# Chosen by a sweep on an H100 (results/tuning/norm_sweep_h100.json; bf16, BERT-base LayerNorm 16384 x 768
# and Llama-3.2-3B RMSNorm 4096 x 3072, d = 0.05 and 1.0): one program per SM walking its rows three tiles
# deep, column sums kept per tile row until the end. 2 or 4 programs per SM were 6-25% slower (more partial
# sums to add up); per-iteration column reductions made the LayerNorm 1.8x slower.
PROGRAMS_PER_SM = 1  # each program adds 2 x N fp32 sums for the reduction to read
TILE = 8192  # elements of one program's tile (whole rows)
STAGES = 3  # tiles in flight per program (software pipelining of the row loop)
SUM_BLOCK = 32  # columns per program of the reduction
ACC2D = True  # column sums per tile row until the end (no cross-row reduction in the loop)
WARPS = 8  # per program (16 for rows of 8192+ elements); 4 or 16 were slower at both shapes


def _blocks(n: int, interpret: bool) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_R, num_warps): whole rows, about TILE elements a tile."""
    block_n = triton.next_power_of_2(n)
    if interpret:
        return block_n, 2, 1
    return block_n, max(1, min(16, TILE // block_n)), 16 if block_n >= 8192 else WARPS


def _plan(m, n, n_sm, interpret, has_mean, has_w, need_dx, do_dw, do_db, strides, stages, keep=False):
    """(plan number, programs, the main kernel's integer arguments and keywords, the reduction's grid and
    keywords): what one shape launches with, worked out once."""
    block_n, block_r, warps = _blocks(n, interpret)
    rows = max(block_r, cdiv(cdiv(m, PROGRAMS_PER_SM * n_sm), block_r) * block_r)
    programs = cdiv(m, rows)
    kw = dict(HAS_MEAN=has_mean, HAS_W=has_w, DO_DX=need_dx, DO_DB=do_db, BLOCK_R=block_r, BLOCK_N=block_n,
              STAGES=1 if interpret else stages, ACC2D=ACC2D, KEEP=keep, num_warps=warps)
    block = 16 if interpret else SUM_BLOCK
    sum_kw = dict(DO_DW=do_dw, DO_DB=do_db, BLOCK=block, BLOCK_P=4 if interpret else 32,
                  num_warps=1 if interpret else 4)
    return next(plan_ids), programs, (m, n, rows, *strides), kw, (cdiv(n, block),), sum_kw


_STAGES: dict = {}  # device index -> position in (STAGES, 1) of the pipeline depth that launches there


def norm_backward_triton(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor | None,
                         rstd: torch.Tensor, need_dx: bool, need_dw: bool, need_db: bool, n_sm: int,
                         interpret: bool = False, bias_dtype: torch.dtype | None = None, keep=None):
    """(dX or None, dW or None, db or None) of a LayerNorm (``mean`` given) or RMSNorm over the non-zero rows
    of 2-D ``dy`` (see :func:`~sebp_kernels.reference.norm_backward_torch`, the same results).

    On a GPU whose shared memory does not hold STAGES tiles in flight (Triton's ``OutOfResources`` at the
    first launch; fp32 tiles take 64 KB a stage), it runs with one from then on for that device, and says so
    once. ``keep``: a :class:`~sebp_kernels.zero_rows.ZeroRowBuffer` that dX is written into (of its zero
    rows only the marked ones), or None."""
    return fit_to_device(_STAGES, dy.device, (STAGES, 1), lambda stages: _norm_at(
        stages, dy, x, weight, mean, rstd, need_dx, need_dw, need_db, n_sm, interpret, bias_dtype, keep),
        "one norm tile in flight")


def _norm_at(stages, dy, x, weight, mean, rstd, need_dx, need_dw, need_db, n_sm, interpret, bias_dtype,
             keep=None):
    m, n = dy.shape
    do_dw = need_dw and weight is not None
    dev = dy.device
    keep = keep if need_dx else None
    dirty = rstd
    if keep is not None:
        dx, dirty, _ = keep.take(m, n, x.dtype)
    else:
        dx = torch.empty((m, n), dtype=x.dtype, device=dev) if need_dx else None
    strides = (dy.stride(0), x.stride(0), dx.stride(0) if need_dx else 0)
    key = (m, n, n_sm, interpret, mean is not None, weight is not None, need_dx, do_dw, need_db, strides,
           dy.dtype, x.dtype, weight.dtype if weight is not None else None, rstd.dtype,
           mean.dtype if mean is not None else None, bias_dtype, stages, keep is not None)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.add(key, _plan(m, n, n_sm, interpret, mean is not None, weight is not None, need_dx, do_dw,
                                     need_db, strides, stages, keep is not None))
    idx, programs, ints, kw, sum_grid, sum_kw = plan
    part = torch.empty(programs * 2 * n, dtype=torch.float32, device=dev)
    _norm_bwd.launch_planned((programs,), idx, 8, (dy, x, weight if weight is not None else dy,
                             mean if mean is not None else rstd, rstd, dx if need_dx else dy, part, dirty, *ints),
                             kw)
    dw = torch.empty(n, dtype=weight.dtype, device=dev) if do_dw else None
    db = torch.empty(n, dtype=bias_dtype or dy.dtype, device=dev) if need_db else None
    if do_dw or need_db:
        _sum_parts.launch_planned(sum_grid, idx, 3, (part, dw if do_dw else part, db if need_db else part,
                                                     programs, n), sum_kw)
    return dx, dw, db
