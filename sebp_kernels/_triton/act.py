"""The MLP activation between two SEBP linears (SwiGLU ``silu(g) * u``, or GELU), forward and backward.

Forward: one pass computes the activation, with the formula and the roundings of torch's own kernels (the
same values: checked bit for bit on an H100 for SwiGLU), and a flag per row: does the row of its inputs
hold a NaN or Inf? GELU's forward stays torch's (a Triton GELU gave other values than torch's in 1.4% of bf16
and 9% of fp32 results on an H100, with libdevice's erf or Triton's: torch's erff rounds differently); for it
the pass only writes the flags. The backward's values are torch's bit for bit for SwiGLU; GELU's differ from
torch's gelu_backward in the last bits of some elements.

Backward: one pass reads dL/dH, and loads the saved inputs only where dL/dH is non-zero or the row is
flagged (predicated loads move no memory elsewhere). Every other element of the input gradients is an exact
zero: 0 times a finite number. A row whose inputs hold a NaN/Inf is computed in full, so a NaN reaches the
gradients as it would in the dense backward. The pass also writes a 0/1 flag per row (non-zero dL/dH, or a
flagged row) and each block's count, in the layout of the row-selection pass: the compaction kernel then
gives the permutation and count of the rows that can be non-zero in the input gradients, which the SEBP
linears below take instead of selecting again (:class:`~sebp_kernels.activations.RowHint`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..reference import unit_col_stride
from .launch import FastLaunch, Plans, plan_ids
from .select import _compact, compact_plan, selection_buffers
from .tuning import cdiv

SWIGLU, GELU = 0, 1
_KINDS = {"swiglu": SWIGLU, "gelu": GELU}
# The kernels spell torch's GELU constants as literals (a global a kernel reads costs host time per launch):
# 0.7071067811865476 = 1/sqrt(2), 0.3989422804014327 = 2/sqrt(pi) * 1/sqrt(2) * 0.5 (computed in double).


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    # torch's kernels call expf; tl.exp is a faster approximation (the interpreter has no libdevice)
    if LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _erf(x, LIBDEVICE: tl.constexpr):
    # torch's kernels call erff; tl.math.erf computes other values (27% of fp32 results differed on an H100)
    if LIBDEVICE:
        return libdevice.erf(x)
    else:
        return tl.math.erf(x)


@triton.jit
def _nonfinite(x):
    return (x != x) | (tl.abs(x) == float("inf"))


@triton.jit(do_not_specialize=["M"])
def _act_fwd_kernel(
    a_ptr, b_ptr, h_ptr, bad_ptr, M, N, stride_a, stride_b, stride_h,
    KIND: tl.constexpr, FLAGS: tl.constexpr, STORE_H: tl.constexpr, LIBDEVICE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < M
    r64 = rows.to(tl.int64)
    bad = tl.zeros([BLOCK_R], dtype=tl.int32)
    for c0 in range(0, N, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        m2 = rmask[:, None] & (cols < N)[None, :]
        a_in = tl.load(a_ptr + r64[:, None] * stride_a + cols[None, :], mask=m2, other=0.0)
        a = a_in.to(tl.float32)
        if KIND == 0:  # silu(a) rounded to the dtype (torch's silu kernel), times b (torch's mul)
            b_in = tl.load(b_ptr + r64[:, None] * stride_b + cols[None, :], mask=m2, other=0.0)
            s = tl.math.div_rn(a, 1.0 + _exp(-a, LIBDEVICE)).to(a_in.dtype)
            h = s.to(tl.float32) * b_in.to(tl.float32)
            if FLAGS:
                bad = tl.maximum(bad, tl.max((_nonfinite(a) | _nonfinite(b_in.to(tl.float32))).to(tl.int32), 1))
        else:  # erf GELU, torch's formula
            if STORE_H:
                h = a * 0.5 * (1.0 + _erf(a * 0.7071067811865476, LIBDEVICE))
            if FLAGS:
                bad = tl.maximum(bad, tl.max(_nonfinite(a).to(tl.int32), 1))
        if STORE_H:
            tl.store(h_ptr + r64[:, None] * stride_h + cols[None, :], h.to(a_in.dtype), mask=m2)
    if FLAGS:
        tl.store(bad_ptr + rows, bad.to(tl.int8), mask=rmask)


@triton.jit(do_not_specialize=["M"])
def _act_bwd_kernel(
    dh_ptr, a_ptr, b_ptr, da_ptr, db_ptr, bad_ptr, flags_ptr, block_count_ptr, dirty_a_ptr, dirty_b_ptr,
    M, N, stride_dh, stride_a, stride_b, stride_da, stride_db,
    KIND: tl.constexpr, NEED_A: tl.constexpr, NEED_B: tl.constexpr, FLAGS: tl.constexpr,
    LIBDEVICE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    KEEP_A: tl.constexpr, KEEP_B: tl.constexpr,
):
    # KEEP_A / KEEP_B: dA / dB is a kept buffer (sebp_kernels.zero_rows) whose rows marked clean in
    # dirty_*_ptr are zero already: a tile of zero rows writes only the marked ones, and the program, which
    # owns its rows in every column, leaves each row marked as it wrote it (non-zero input gradient or not).
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < M
    r64 = rows.to(tl.int64)
    bad = tl.load(bad_ptr + rows, mask=rmask, other=0) != 0
    active = bad.to(tl.int32)
    dirty_a = rmask
    dirty_b = rmask
    if KEEP_A:
        dirty_a = tl.load(dirty_a_ptr + rows, mask=rmask, other=0) != 0
    if KEEP_B:
        dirty_b = tl.load(dirty_b_ptr + rows, mask=rmask, other=0) != 0
    any_a = tl.max(dirty_a.to(tl.int32), axis=0) > 0
    any_b = tl.max(dirty_b.to(tl.int32), axis=0) > 0
    for c0 in range(0, N, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        m2 = rmask[:, None] & (cols < N)[None, :]
        dh_in = tl.load(dh_ptr + r64[:, None] * stride_dh + cols[None, :], mask=m2, other=0.0)
        dh = dh_in.to(tl.float32)
        nz = dh != 0  # NaN too
        active = tl.maximum(active, tl.max(nz.to(tl.int32), 1))
        need = m2 & (nz | bad[:, None])  # elsewhere the gradient is 0 x (a finite number)
        offs_a = r64[:, None] * stride_da + cols[None, :]
        offs_b = r64[:, None] * stride_db + cols[None, :]
        if tl.max(need.to(tl.int32)) > 0:
            a = tl.load(a_ptr + r64[:, None] * stride_a + cols[None, :], mask=need, other=0.0).to(tl.float32)
            if KIND == 0:
                b_in = tl.load(b_ptr + r64[:, None] * stride_b + cols[None, :], mask=need, other=0.0)
                e = _exp(-a, LIBDEVICE)
                if NEED_B:  # torch: dL/db = dL/dh * silu(a), silu(a) as the forward stored it
                    s_act = tl.math.div_rn(a, 1.0 + e).to(dh_in.dtype).to(tl.float32)
                    tl.store(db_ptr + offs_b, (dh * s_act).to(dh_in.dtype), mask=m2)
                if NEED_A:  # torch: g = dL/dh * b (rounded), then silu_backward(g, a)
                    g = (dh * b_in.to(tl.float32)).to(dh_in.dtype).to(tl.float32)
                    sig = tl.math.div_rn(1.0, 1.0 + e)
                    da = g * sig * tl.fma(a, 1.0 - sig, 1.0)
                    tl.store(da_ptr + offs_a, da.to(dh_in.dtype), mask=m2)
            else:  # torch's gelu_backward: dy * (cdf + x * pdf)
                cdf = 0.5 * (1.0 + _erf(a * 0.7071067811865476, LIBDEVICE))
                pdf = _exp(-0.5 * a * a, LIBDEVICE) * 0.3989422804014327
                da = dh * tl.fma(a, pdf, cdf)
                tl.store(da_ptr + offs_a, da.to(dh_in.dtype), mask=m2)
        else:  # a tile of zero rows (padding): zeros (kept buffers: on the marked rows only), none of the math
            zero = tl.zeros([BLOCK_R, BLOCK_C], dtype=dh_in.dtype)
            if NEED_A:
                if any_a:
                    tl.store(da_ptr + offs_a, zero, mask=m2 & dirty_a[:, None])
            if NEED_B:
                if any_b:
                    tl.store(db_ptr + offs_b, zero, mask=m2 & dirty_b[:, None])
    if KEEP_A:
        tl.store(dirty_a_ptr + rows, active.to(tl.int8), mask=rmask)
    if KEEP_B:
        tl.store(dirty_b_ptr + rows, active.to(tl.int8), mask=rmask)
    if FLAGS:
        tl.store(flags_ptr + rows, active, mask=rmask)
        tl.store(block_count_ptr + pid, tl.sum(tl.where(rmask, active, 0), axis=0))


_fwd = FastLaunch(_act_fwd_kernel)
_bwd = FastLaunch(_act_bwd_kernel)
_PLANS = Plans(_fwd, _bwd, _compact)


def _row_blocks(n: int, interpret: bool) -> tuple[int, int, int]:
    """(rows per program, columns per tile, warps): 4 x up to 1024, 4 warps. From a sweep on
    an H100 (``results/tuning/act_sweep_h100.json``, 9 settings): at the Llama-3.2-3B SwiGLU shape the forward
    took 79.6 us and the backward 95.0 us against 94.0 / 105.0 with the selection pass's 8 x 512, 8 warps; at
    the BERT-base GELU shape both were within 2% of each other (46.8 / 103.5 against 47.0 / 101.6 us)."""
    if interpret:
        return 8, 16, 1
    return 4, max(64, min(triton.next_power_of_2(n), 1024)), 4


def _plan(kind, m, n, interpret):
    """(plan number, blocks, kernel keywords, compaction keywords)."""
    block_r, block_c, warps = _row_blocks(n, interpret)
    kw = dict(KIND=_KINDS[kind], LIBDEVICE=not interpret, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return next(plan_ids), cdiv(m, block_r), kw, compact_plan(m, block_r, interpret)


def _get_plan(key, kind, m, n, interpret):
    """The plan of one launch: ``key`` holds all that Triton specialises on (shape, strides, dtypes, flags)."""
    plan = _PLANS.get(key)
    return plan if plan is not None else _PLANS.add(key, _plan(kind, m, n, interpret))


def act_forward_triton(kind: str, a: torch.Tensor, b: torch.Tensor | None, flags: bool, interpret: bool = False,
                       store_h: bool = True):
    """(h, bad): the activation of 2-D ``a`` (and ``b`` for SwiGLU; None without ``store_h``: flags only),
    and int8 per-row NaN/Inf flags of the inputs (None unless ``flags``)."""
    a = unit_col_stride(a)
    b = unit_col_stride(b) if b is not None else a
    m, n = a.shape
    key = ("fwd", kind, m, n, flags, store_h, interpret, a.dtype, b.dtype, a.stride(0), b.stride(0))
    idx, nb, kw, _ = _get_plan(key, kind, m, n, interpret)
    h = torch.empty((m, n), dtype=a.dtype, device=a.device) if store_h else None
    bad = torch.empty(m, dtype=torch.int8, device=a.device) if flags else None
    hh = h if store_h else a
    _fwd.launch_planned((nb,), idx, 4, (a, b, hh, bad if flags else hh, m, n, a.stride(0), b.stride(0),
                                        hh.stride(0)), dict(kw, FLAGS=flags, STORE_H=store_h))
    return h, bad


def act_backward_triton(kind: str, dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, bad: torch.Tensor,
                        need_a: bool, need_b: bool, want_rows: bool, interpret: bool = False, keep_a=None,
                        keep_b=None):
    """(dA or None, dB or None, rows): the input gradients of the activation for 2-D ``dh``, and with
    ``want_rows`` the (permutation, device-side count) of the rows that can be non-zero in them (else None).
    ``keep_a`` / ``keep_b``: :class:`~sebp_kernels.zero_rows.ZeroRowBuffer` s that dA / dB are written into
    (only the rows active now or marked are written), or None."""
    keep_a = keep_a if need_a else None
    keep_b = keep_b if need_b else None
    dh, a = unit_col_stride(dh), unit_col_stride(a)
    b = unit_col_stride(b) if b is not None else a
    m, n = dh.shape
    key = ("bwd", kind, m, n, need_a, need_b, want_rows, interpret, dh.dtype, a.dtype, b.dtype, dh.stride(0),
           a.stride(0), b.stride(0), keep_a is not None, keep_b is not None)
    idx, nb, kw, (n_compact, compact_kw) = _get_plan(key, kind, m, n, interpret)
    dev = dh.device
    dirty_a = dirty_b = bad
    if keep_a is not None:
        da, dirty_a, _ = keep_a.take(m, n, dh.dtype)
    else:
        da = torch.empty((m, n), dtype=dh.dtype, device=dev) if need_a else None
    if keep_b is not None:
        db, dirty_b, _ = keep_b.take(m, n, dh.dtype)
    else:
        db = torch.empty((m, n), dtype=dh.dtype, device=dev) if need_b else None
    if want_rows:
        perm, flags, block_count, count = selection_buffers(m, nb, dev)
    else:
        perm = flags = block_count = count = None
    # outputs not asked for (or no flags) get another tensor as a pointer the kernel never touches; the
    # outputs are new (m, n) tensors: row stride n
    _bwd.launch_planned(
        (nb,), idx, 10,
        (dh, a, b, da if need_a else dh, db if need_b else dh, bad,
         flags if want_rows else bad, block_count if want_rows else bad, dirty_a, dirty_b,
         m, n, dh.stride(0), a.stride(0), b.stride(0), n, n),
        dict(kw, NEED_A=need_a, NEED_B=need_b, FLAGS=want_rows, KEEP_A=keep_a is not None,
             KEEP_B=keep_b is not None))
    rows = None
    if want_rows:
        _compact.launch_planned((n_compact,), idx, 4, (flags, block_count, perm, count, m), compact_kw)
        rows = (perm, count)
    return da, db, rows
