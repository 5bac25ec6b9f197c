"""dX, dW and db of the SEBP backward in one launch.

The programs of one grid take the roles of the three separate kernels: the dW tiles (times their row
splits) and the computing dX programs (its active tiles, split over K when few are active), whichever
reduces over more (decided on the device from the active-row count) first; then the dX programs that write
the zero rows (or exit), then the db column blocks (times their row splits). Each role runs the same
device code as its own kernel (``_dw_tile``, ``_dx_program``, ``_db_cols``), on the permutation and device-side
count of the select pass. One launch instead of three saves host time (each Triton launch costs about
10-17 us on the device machine's host) and two kernel boundaries on the GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dw import DB_BLOCK_C, DB_BLOCK_R, DB_MIN_CHUNK, MIN_CHUNK, ROW_ALIGN, _db_cols, _db_splits, _dw_tile, \
    _tickets, dw_splits
from .tiles import _split_rows
from . import dx as _dx_module
from .dx import MAX_SPLIT, _dx_program, _dx_work, dx_split_args
from .launch import FastLaunch, Plans, fit_to_device, plan_ids
from .tuning import LEVELS, cdiv, few_rows, gemm_config


@triton.jit(do_not_specialize=["M", "DW_SPLIT", "DB_SPLIT", "DW_TILES", "N_DW", "N_DX", "DX_FILL",
                               "DX_EXTRA", "DB_COLS", "count_ptr", "dx_count_ptr"])
def _grads_kernel(
    dy_ptr, x_ptr, w_ptr, dx_ptr, dw_ptr, db_ptr, dw_part_ptr, db_part_ptr, dx_part_ptr, perm_ptr, count_ptr,
    dx_count_ptr, scale_ptr, ticket_ptr, dirty_ptr, zt_ticket_ptr, M, N_OUT, N_IN, DW_SPLIT, DB_SPLIT, DW_TILES,
    N_DW, N_DX, DB_COLS, DX_FILL, DX_EXTRA,
    stride_dym, stride_dyo, stride_xm, stride_xi, stride_wo, stride_wi, stride_dxm, stride_dxi,
    DO_DX: tl.constexpr, DO_DW: tl.constexpr, DO_DB: tl.constexpr,
    IEEE: tl.constexpr, BIG: tl.constexpr, EVEN_K: tl.constexpr,
    ROW_ALIGN: tl.constexpr, MIN_CHUNK: tl.constexpr, DB_ALIGN: tl.constexpr, DB_MIN_CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DB_BLOCK_R: tl.constexpr, DB_BLOCK_C: tl.constexpr, DX_STAGES: tl.constexpr, DX_MIN_K: tl.constexpr,
    DX_MAX_SPLIT: tl.constexpr, DX_REUSE: tl.constexpr, DX_ZERO_PROGRAMS: tl.constexpr, SCALED: tl.constexpr,
    SCALED_DX: tl.constexpr,
):
    # ticket_ptr: the dW tiles' split counters, then the db column blocks', then the dX tiles'.
    # count_ptr: the rows perm[:count] of dW and db; dx_count_ptr: dX's, perm[:dx_count] (the same count but in
    # sampled mode, where dW and db take the kept rows, each times its scale_ptr factor, and dX all non-zero ones,
    # or with SCALED_DX the kept rows too, scaled).
    pid = tl.program_id(0)
    count = tl.load(count_ptr)
    dx_count = tl.load(dx_count_ptr)
    # Longest programs first (the GPU starts programs in pid order): a dX tile reduces over N_OUT, a dW split
    # over its share of the k active rows. With the longer ones last, their tail runs on a few SMs. The dX
    # programs that only write zero rows (or exit) always come after both.
    dw_start, dw_end, _ = _split_rows(count, 0, DW_SPLIT, ROW_ALIGN, MIN_CHUNK)
    dw_pid = pid
    dx_pid = pid - N_DW
    if N_OUT > dw_end - dw_start:
        t_act, dx_split = _dx_work(dx_count, N_IN, N_OUT, DX_FILL, DX_EXTRA, BLOCK_M, BLOCK_N, DX_MIN_K,
                                   DX_MAX_SPLIT)
        n_first = tl.minimum(t_act * dx_split, N_DX)  # dX programs that compute
        dw_pid = pid - n_first
        dx_pid = tl.where(pid < n_first, pid, pid - N_DW)
    if (dw_pid >= 0) & (dw_pid < N_DW):
        if DO_DW:
            _dw_tile(dy_ptr, x_ptr, dw_ptr, dw_part_ptr, perm_ptr, count, ticket_ptr, dw_pid % DW_TILES,
                     dw_pid // DW_TILES, M, N_OUT, N_IN, DW_SPLIT, stride_dym, stride_dyo, stride_xm, stride_xi,
                     IEEE, BIG, ROW_ALIGN, MIN_CHUNK, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, scale_ptr, SCALED)
    elif (dx_pid >= 0) & (dx_pid < N_DX):
        if DO_DX:
            _dx_program(dy_ptr, w_ptr, dx_ptr, dx_part_ptr, perm_ptr, ticket_ptr + DW_TILES + DB_COLS, dirty_ptr,
                        zt_ticket_ptr, dx_count, dx_pid, DX_FILL, DX_EXTRA, M, N_IN, N_OUT,
                        stride_dym, stride_dyo, stride_wo, stride_wi, stride_dxm, stride_dxi,
                        BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K, IEEE, BIG, DX_STAGES, DX_MIN_K, DX_MAX_SPLIT,
                        DX_REUSE, DX_ZERO_PROGRAMS, dy_ptr, False, scale_ptr, SCALED_DX)
    else:
        if DO_DB:
            g = pid - N_DW - N_DX
            _db_cols(dy_ptr, db_ptr, db_part_ptr, perm_ptr, count, ticket_ptr + DW_TILES, g % DB_COLS,
                     g // DB_COLS, M, N_OUT, DB_SPLIT, stride_dym, stride_dyo, DB_ALIGN, DB_MIN_CHUNK,
                     DB_BLOCK_R, DB_BLOCK_C, scale_ptr, SCALED)


_grads = FastLaunch(_grads_kernel)
_PLANS = Plans(_grads)


class _Plan:
    """What one backward shape launches with, worked out once (host Python per backward is a real share of a
    small model's step): grid, allocation sizes, the integer arguments and the launch keywords."""

    __slots__ = ("idx", "grid", "part_n", "ints", "kw", "n_tickets")


_N_TENSORS = 16  # the kernel's leading tensor arguments


def _plan(m, n_out, n_in, dtype, need_dx, need_dw, need_db, ieee, n_sm, interpret, dw_split, db_split,
          dy_stride, xs_stride, w_stride, level, zero_programs=0, scaled=False, scaled_dx=False) -> _Plan:
    reuse = zero_programs > 0  # dX kept between backwards: ZERO_PROGRAMS programs zero its dirty rows
    small = few_rows(m, n_in, n_sm)
    cfg = dict(gemm_config("dw", dtype, interpret, level, small))
    warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages", None)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    dw_tiles = cdiv(n_out, bm) * cdiv(n_in, bn)
    if dw_split is None:  # the dX tiles (same tile shape, reduction length n_out) share the launch
        dx_work = cdiv(m, bm) * cdiv(n_in, bn) * n_out if need_dx else 0
        dw_split = dw_splits(n_out, n_in, m, n_sm, bm, bn, dx_work)
    db_block_r, db_block_c, db_min = (8, 16, 8) if interpret else (DB_BLOCK_R, DB_BLOCK_C, DB_MIN_CHUNK)
    db_cols = cdiv(n_out, db_block_c)
    if db_split is None:
        db_split = _db_splits(m, db_cols, n_sm, db_min)
    n_dw = dw_tiles * dw_split if need_dw else 0
    # dX splits over K only onto the SMs the dW tiles leave idle (with few rows dW runs one split per tile)
    n_dx, dx_extra, dx_fill, dx_min_k, dx_part_tiles = dx_split_args(m, n_in, n_out, cfg, n_sm, interpret,
                                                                     dw_tiles if need_dw else 0)
    if not need_dx:
        n_dx = dx_part_tiles = 0
    n_db = db_cols * db_split if need_db else 0
    plan = _Plan()
    plan.idx = next(plan_ids)
    plan.grid = (n_dw + n_dx + n_db,)
    plan.part_n = (dw_split * n_out * n_in if need_dw and dw_split > 1 else 0,
                   db_split * n_out if need_db and db_split > 1 else 0, dx_part_tiles * bm * bn)
    big = max(dy_stride[0], xs_stride[0], n_in) * m >= 2**31
    plan.ints = (m, n_out, n_in, dw_split, db_split, dw_tiles, n_dw, n_dx, db_cols, dx_fill, dx_extra,
                 *dy_stride, *xs_stride, *w_stride, n_in if need_dx else 0, 1)
    opts = {"num_warps": warps} if stages is None else {"num_warps": warps, "num_stages": stages}
    plan.kw = dict(
        DO_DX=need_dx, DO_DW=need_dw, DO_DB=need_db, IEEE=ieee, BIG=big, EVEN_K=n_out % cfg["BLOCK_K"] == 0,
        ROW_ALIGN=16 if interpret else ROW_ALIGN, MIN_CHUNK=16 if interpret else MIN_CHUNK,
        DB_ALIGN=db_block_r, DB_MIN_CHUNK=db_min, DB_BLOCK_R=db_block_r, DB_BLOCK_C=db_block_c,
        DX_STAGES=gemm_config("dx", dtype, interpret, level, small).get("num_stages", 1), DX_MIN_K=dx_min_k,
        DX_MAX_SPLIT=MAX_SPLIT, DX_REUSE=reuse, DX_ZERO_PROGRAMS=max(zero_programs, 1), SCALED=scaled,
        SCALED_DX=scaled_dx, **cfg, **opts)
    plan.n_tickets = dw_tiles + db_cols + 2 * n_sm
    return plan


_LEVEL: dict = {}  # device index -> the tile setting (tuning.gemm_config level) that launches there


def grads_rows(dy: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, perm: torch.Tensor,
               count: torch.Tensor, need_dx: bool, need_dw: bool, need_db: bool, ieee: bool, n_sm: int,
               interpret: bool = False, dw_split: int | None = None, db_split: int | None = None,
               dx_buffer=None, dx_count: torch.Tensor | None = None, scale: torch.Tensor | None = None,
               scale_dx: bool = False):
    """(dX or None, dW or None, db or None) over rows ``perm[:count]`` in one launch; the same results as
    :func:`~.dx.dx_rows` and :func:`~.dw.dw_db_rows` (the same device code).

    Sampled mode: ``dx_count`` (int32, (1,)) the rows ``perm[:dx_count]`` of dX, where ``perm[:count]`` (dW
    and db's) are its first ones; ``scale`` (fp32, M): each row's factor in dW and db (``scale_dx``: in dX too).

    ``dx_buffer``: a :class:`~.zero_rows.ZeroRowBuffer` of dX's shape and dtype; dX is then its tensor, and
    only the rows active now or marked dirty are written.

    On a GPU whose shared memory does not hold the tiles (Triton's ``OutOfResources`` at the first launch),
    it takes the next smaller setting of :data:`~.tuning.FALLBACK_CONFIGS`, keeps it for that device, and
    says so once."""
    return fit_to_device(_LEVEL, dy.device, range(LEVELS), lambda level: _grads_at(
        level, dy, x, weight, perm, count, need_dx, need_dw, need_db, ieee, n_sm, interpret, dw_split, db_split,
        dx_buffer, dx_count, scale, scale_dx), "smaller GEMM tiles")


def _grads_at(level, dy, x, weight, perm, count, need_dx, need_dw, need_db, ieee, n_sm, interpret, dw_split,
              db_split, dx_buffer=None, dx_count=None, scale=None, scale_dx=False):
    m, n_out = dy.shape
    n_in = weight.shape[1]
    xs = x if need_dw else dy
    zero_programs = _dx_module.ZERO_PROGRAMS_PER_SM * n_sm if dx_buffer is not None and need_dx else 0
    key = (m, n_out, n_in, dy.dtype, xs.dtype, weight.dtype, need_dx, need_dw, need_db, ieee, n_sm, interpret,
           dw_split, db_split, dy.stride(), xs.stride(), weight.stride(), level, zero_programs, scale is not None,
           scale_dx)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.add(key, _plan(m, n_out, n_in, dy.dtype, need_dx, need_dw, need_db, ieee, n_sm, interpret,
                                     dw_split, db_split, dy.stride(), xs.stride(), weight.stride(), level,
                                     zero_programs, scale is not None, scale_dx))
    dev = dy.device
    if zero_programs:
        dx, dirty, zt_tickets = dx_buffer.take(m, n_in, dy.dtype)
    else:
        dx = torch.empty((m, n_in), dtype=dy.dtype, device=dev) if need_dx else None
        dirty = zt_tickets = perm
    dw = torch.empty((n_out, n_in), dtype=weight.dtype, device=dev) if need_dw else None
    db = torch.empty(n_out, dtype=dy.dtype, device=dev) if need_db else None
    dw_part_n, db_part_n, dx_part_n = plan.part_n
    n_part = dw_part_n + db_part_n + dx_part_n
    part = torch.empty(n_part, dtype=torch.float32, device=dev) if n_part else None
    dw_part = part[:dw_part_n] if dw_part_n else (dw if dw is not None else dy)
    db_part = part[dw_part_n:dw_part_n + db_part_n] if db_part_n else (db if db is not None else dy)
    dx_part = part[dw_part_n + db_part_n:] if dx_part_n else (dx if dx is not None else dy)
    _grads.launch_planned(
        plan.grid, plan.idx, _N_TENSORS,
        (dy, xs, weight, dx if need_dx else dy, dw if need_dw else dy, db if need_db else dy, dw_part, db_part,
         dx_part, perm, count, count if dx_count is None else dx_count, perm if scale is None else scale,
         _tickets(dev, plan.n_tickets), dirty, zt_tickets, *plan.ints), plan.kw)
    return dx, dw, db
