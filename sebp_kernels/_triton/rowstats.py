"""Statistics of the rows of a 2-D gradient, accumulated on the device in one launch, no host sync.

For a matrix ``g`` (rows x cols; float32, float16 or bfloat16) one kernel reads every element once and
adds into row ``slot`` of two caller-owned int64 buffers:

* ``stats[slot]``: ``[non-zero elements, rows holding a NaN/Inf, max bits, row histogram (nb buckets)]``;
* ``sample_hist[slot]``: histogram of the single elements of every ``row_step``-th row (rows 0, step, ...);
* optionally, given a group per row (int8, 0 = none, 1..G), ``group_hist[slot]``: G histograms of the rows'
  max ``|g|`` one after the other, in coarser buckets (``group_shift``), one per group.

Magnitudes are bucketed by the float32 bit pattern of ``|g|`` (``bits``, an int32 in [0, 2**31)): bucket
``ceil(bits / 2**shift)``, so bucket 0 holds exact zeros and every bucket edge is an exact float32. bfloat16
is the top half of a float32 (no conversion); float16 is widened exactly. Every NaN counts as the canonical
quiet NaN ``0x7FC00000`` (payloads say nothing about a gradient, and differ between conversions). "max bits"
is the largest bit pattern: NaN sorts above +Inf, so a diverging row wins. A row's histogram bucket is that
of its max ``|g|``; an all-zero row lands in bucket 0.

:func:`row_stats_many_` does the same for many gradients in one launch (the collector holds a layer's gradient
until a few have come, so a backward launches a few kernels, not one per layer): each program finds its
gradient in a small table of addresses, shapes and slots.

Counts live in int64 buffers and are added with int64 atomics, so they cannot overflow across calls and
batches; in registers they are per-row int32 (at most ``cols`` each) and summed as int64. A program
reduces its rows first: one atomic per scalar, one for its zero rows, one per non-zero row, and, for the
sampled rows, one per non-zero element plus one for the zeros. Row offsets are int64.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..interpret import INTERPRET
from .launch import FastLaunch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Columns of ``stats``: three scalars, then the row histogram. The kernel spells these (and the float32
# bits of +Inf, 0x7F800000, and of the canonical NaN, 0x7FC00000) as literals: every global constexpr a
# kernel reads is re-compared on each launch, which costs host time.
NONZERO, NONFINITE_ROWS, MAX_BITS, N_SCALARS = 0, 1, 2, 3
_FP16, _BF16, _FP32 = 0, 1, 2


@triton.jit
def _abs_bits(x, KIND: tl.constexpr):
    """float32 bit pattern of |x| as int32, every NaN as the canonical one."""
    if KIND == 1:  # bfloat16: the top half of a float32
        bits = (x.to(tl.int16, bitcast=True).to(tl.int32) << 16) & 0x7FFFFFFF
    else:  # float16 widens exactly
        bits = x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.where(bits > 0x7F800000, 0x7FC00000, bits)


@triton.jit
def _row_block(g_ptr, stats_ptr, sample_ptr, group_ptr, group_hist_ptr, r0, M, N, stride_m, slot, stats_stride,
               sample_stride, group_stride, row_step, use_groups,
               KIND: tl.constexpr, SHIFT: tl.constexpr, GROUPS: tl.constexpr, GROUP_SHIFT: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows ``r0 .. r0 + BLOCK_R`` of one gradient into row ``slot`` of the buffers (both kernels' body)."""
    rows = r0 + tl.arange(0, BLOCK_R)
    rmask = rows < M
    row_ptrs = g_ptr + rows.to(tl.int64)[:, None] * stride_m
    sampled = rmask & (rows % row_step == 0)
    # Does this program hold a sampled row? (skips the element scatter everywhere else)
    first = (r0 + row_step - 1) // row_step * row_step
    has_sample = first < tl.minimum(r0 + BLOCK_R, M)
    stats = stats_ptr + slot * stats_stride  # slot and strides are small: int32 is safe
    sample = sample_ptr + slot * sample_stride

    row_max = tl.zeros([BLOCK_R], dtype=tl.int32)
    nonzero = tl.zeros([BLOCK_R], dtype=tl.int32)
    sample_zero = tl.zeros([BLOCK_R], dtype=tl.int32)
    for c0 in range(0, N, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        m = rmask[:, None] & (cols < N)[None, :]
        x = tl.load(row_ptrs + cols[None, :], mask=m, other=0.0)
        bits = _abs_bits(x, KIND)
        nonzero += tl.sum((bits != 0).to(tl.int32), axis=1)
        row_max = tl.maximum(row_max, tl.max(bits, axis=1))
        if has_sample:
            in_sample = m & sampled[:, None]
            # ceil(bits / 2**SHIFT) without overflow near 2**31; zeros counted per row, not by atomics
            bucket = ((bits - 1) >> SHIFT) + 1
            tl.atomic_add(sample + bucket, tl.full(bucket.shape, 1, tl.int64), mask=in_sample & (bits != 0),
                          sem="relaxed")
            sample_zero += tl.sum((in_sample & (bits == 0)).to(tl.int32), axis=1)

    n_zero_rows = tl.sum((rmask & (row_max == 0)).to(tl.int64), axis=0)
    tl.atomic_add(stats + 0, tl.sum(nonzero.to(tl.int64), axis=0), sem="relaxed")  # NONZERO
    tl.atomic_add(stats + 1, tl.sum((rmask & (row_max >= 0x7F800000)).to(tl.int64), axis=0),  # NONFINITE_ROWS
                  sem="relaxed")
    tl.atomic_max(stats + 2, tl.max(row_max, axis=0).to(tl.int64), sem="relaxed")  # MAX_BITS
    row_hist = stats + 3  # N_SCALARS
    row_bucket = ((row_max - 1) >> SHIFT) + 1
    tl.atomic_add(row_hist + row_bucket, tl.full(row_bucket.shape, 1, tl.int64), mask=rmask & (row_max != 0),
                  sem="relaxed")
    tl.atomic_add(row_hist, n_zero_rows, mask=n_zero_rows > 0, sem="relaxed")
    if has_sample:
        tl.atomic_add(sample, tl.sum(sample_zero.to(tl.int64), axis=0), sem="relaxed")
    if GROUPS > 0:
        if use_groups != 0:  # zero rows summed per group first: pad rows would all hit one counter
            group = tl.load(group_ptr + rows, mask=rmask, other=0).to(tl.int32)
            hist = group_hist_ptr + slot * group_stride
            n_buckets = (1 << (31 - GROUP_SHIFT)) + 1
            at = (group - 1) * n_buckets + ((row_max - 1) >> GROUP_SHIFT) + 1
            tl.atomic_add(hist + at, tl.full(at.shape, 1, tl.int64), mask=rmask & (group > 0) & (row_max != 0),
                          sem="relaxed")
            for k in tl.static_range(GROUPS):
                zeros = tl.sum((rmask & (group == k + 1) & (row_max == 0)).to(tl.int64), axis=0)
                tl.atomic_add(hist + k * n_buckets, zeros, mask=zeros > 0, sem="relaxed")


# slot and row_step change from call to call: specialising on them (== 1, multiple of 16) would only compile
# more variants of the kernel.
@triton.jit(do_not_specialize=["slot", "row_step"])
def _row_stats_kernel(
    g_ptr, stats_ptr, sample_ptr, group_ptr, group_hist_ptr,
    M, N, stride_m,
    slot, stats_stride, sample_stride, group_stride, row_step,
    KIND: tl.constexpr, SHIFT: tl.constexpr, GROUPS: tl.constexpr, GROUP_SHIFT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    _row_block(g_ptr, stats_ptr, sample_ptr, group_ptr, group_hist_ptr, tl.program_id(0) * BLOCK_R, M, N,
               stride_m, slot, stats_stride, sample_stride, group_stride, row_step, 1,
               KIND, SHIFT, GROUPS, GROUP_SHIFT, BLOCK_R, BLOCK_C)


# A row of the many-gradient kernel's table holds 8 int64, read at these offsets: the gradient's address, its rows,
# cols and row stride, its slot, row_step and whether the groups split it, and its first program.
@triton.jit(do_not_specialize=["n_grads"])
def _row_stats_many_kernel(
    table_ptr, stats_ptr, sample_ptr, group_ptr, group_hist_ptr,
    n_grads, stats_stride, sample_stride, group_stride,
    KIND: tl.constexpr, SHIFT: tl.constexpr, GROUPS: tl.constexpr, GROUP_SHIFT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    t = pid * 0  # the gradient this program reads: the last whose first program is at or before pid
    for k in range(1, n_grads):
        t += (pid >= tl.load(table_ptr + k * 8 + 7)).to(tl.int32)  # row k's first program
    row = table_ptr + t * 8
    if KIND == 1:
        g_ptr = tl.load(row).to(tl.pointer_type(tl.bfloat16))
    elif KIND == 0:
        g_ptr = tl.load(row).to(tl.pointer_type(tl.float16))
    else:
        g_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
    # the host sends only gradients whose address is 16-byte aligned and whose width and row stride are
    # multiples of 16 (:func:`batchable`): with these hints the loads are as wide as the one-gradient kernel's
    g_ptr = tl.multiple_of(g_ptr, 16)
    n = tl.multiple_of(tl.load(row + 2), 16)
    stride_m = tl.multiple_of(tl.load(row + 3), 16)
    r0 = (pid - tl.load(row + 7)) * BLOCK_R
    _row_block(g_ptr, stats_ptr, sample_ptr, group_ptr, group_hist_ptr, r0, tl.load(row + 1), n, stride_m,
               tl.load(row + 4), stats_stride, sample_stride, group_stride, tl.load(row + 5), tl.load(row + 6),
               KIND, SHIFT, GROUPS, GROUP_SHIFT, BLOCK_R, BLOCK_C)


_row_stats = FastLaunch(_row_stats_kernel)
_row_stats_many = FastLaunch(_row_stats_many_kernel)
_KIND = {torch.float16: _FP16, torch.bfloat16: _BF16, torch.float32: _FP32}


def _tile(n: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) for rows ``n`` wide: tiles of up to 8K elements."""
    if INTERPRET:
        return 4, 16  # small tiles: several programs and column blocks on test shapes
    block_c = max(16, min(triton.next_power_of_2(n), 1024))
    return max(1, min(32, 8192 // block_c)), block_c


@functools.lru_cache(maxsize=1024)
def _blocks(m: int, n: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, grid): :func:`_tile`'s, rows per program halved until ~256 programs."""
    block_r, block_c = _tile(n)
    while not INTERPRET and block_r > 1 and triton.cdiv(m, block_r) < 256:
        block_r //= 2
    return block_r, block_c, triton.cdiv(m, block_r)


def supported(g: torch.Tensor) -> bool:
    """Whether :func:`row_stats_` runs this tensor (CUDA, or CPU under the interpreter; 2-D; its dtypes)."""
    return g.device.type == ("cpu" if INTERPRET else "cuda") and g.dtype in DTYPES and g.dim() == 2


def row_stats_(g: torch.Tensor, stats: torch.Tensor, sample_hist: torch.Tensor, slot: int, row_step: int,
               shift: int, groups: torch.Tensor | None = None, group_hist: torch.Tensor | None = None,
               n_groups: int = 0, group_shift: int = 23) -> None:
    """Add the statistics of the rows of 2-D ``g`` into ``stats[slot]`` and ``sample_hist[slot]`` (see the
    module docstring for the layout); both int64 with unit column stride, on ``g``'s device, with at least
    ``(1 << (31 - shift)) + 1`` buckets. With ``groups`` (int8, one per row of ``g``, values 0..n_groups), also
    into ``group_hist[slot]`` (int64, unit column stride, ``n_groups`` histograms of
    ``(1 << (31 - group_shift)) + 1`` buckets). Asynchronous: one kernel launch, no host sync."""
    m, n = g.shape
    if m == 0 or n == 0:
        return
    if g.stride(1) != 1 and n > 1:  # the kernel reads columns at unit stride
        g = g.contiguous()
    if groups is None:  # the kernel never reads these: any tensor of the device will do
        groups, group_hist, n_groups = stats, stats, 0
    block_r, block_c, grid = _blocks(m, n)
    _row_stats[(grid,)](
        g, stats, sample_hist, groups, group_hist, m, n, g.stride(0), slot, stats.stride(0), sample_hist.stride(0),
        group_hist.stride(0), row_step,
        KIND=_KIND[g.dtype], SHIFT=shift, GROUPS=n_groups, GROUP_SHIFT=group_shift, BLOCK_R=block_r,
        BLOCK_C=block_c, num_warps=1 if INTERPRET else 4,
    )


def batchable(g: torch.Tensor) -> bool:
    """Whether :func:`row_stats_many_` takes this 2-D gradient (a supported one, 16-byte aligned, its width and
    row stride multiples of 16, unit column stride); others go through :func:`row_stats_`."""
    n = g.shape[1]
    return (supported(g) and not g.data_ptr() & 15 and not n & 15 and not g.stride(0) & 15 and g.stride(1) == 1
            and g.shape[0] > 0 and n > 0)


def row_stats_many_(grads: list[tuple[torch.Tensor, int, int, bool]], stats: torch.Tensor, sample_hist: torch.Tensor,
                    shift: int, groups: torch.Tensor | None = None, group_hist: torch.Tensor | None = None,
                    n_groups: int = 0, group_shift: int = 23) -> None:
    """:func:`row_stats_` for many gradients in one launch per dtype: ``grads`` holds ``(g, slot, row_step,
    grouped)``, each ``g`` :func:`batchable`, all on one device; ``grouped`` says whether ``groups`` (one int8 per
    row, shared by all) splits that gradient's rows. The gradients' addresses go to the device in a small table
    (one copy from pinned memory, no host sync); the caller keeps nothing alive: the kernel is queued on the
    current stream before the gradients can be freed and their memory reused."""
    by_kind: dict[int, list] = {}
    for entry in grads:
        by_kind.setdefault(_KIND[entry[0].dtype], []).append(entry)
    if groups is None:
        groups, group_hist, n_groups = stats, stats, 0
    for kind, entries in by_kind.items():
        block_r, block_c = _tile(max(g.shape[1] for g, *_ in entries))  # many programs already: no halving
        table, first = [], 0
        for g, slot, row_step, grouped in entries:
            table += [g.data_ptr(), g.shape[0], g.shape[1], g.stride(0), slot, row_step, int(grouped), first]
            first += triton.cdiv(g.shape[0], block_r)
        device = entries[0][0].device
        table = torch.tensor(table, dtype=torch.int64)
        if device.type == "cuda":
            table = table.pin_memory().to(device, non_blocking=True)
        _row_stats_many[(first,)](
            table, stats, sample_hist, groups, group_hist, len(entries), stats.stride(0), sample_hist.stride(0),
            group_hist.stride(0),
            KIND=kind, SHIFT=shift, GROUPS=n_groups, GROUP_SHIFT=group_shift, BLOCK_R=block_r, BLOCK_C=block_c,
            num_warps=1 if INTERPRET else 4,
        )
