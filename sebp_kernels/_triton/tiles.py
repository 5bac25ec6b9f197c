"""Device helpers shared by the GEMM kernels."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, ROWS, COLS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program ``pid`` over a ROWS x COLS output in grouped order: GROUP_M row tiles are
    walked together, so neighbouring programs share operand tiles in L2."""
    num_m = tl.cdiv(ROWS, BLOCK_M)
    num_n = tl.cdiv(COLS, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % group) % size_m, (pid % group) // size_m


@triton.jit
def _split_rows(count, pid_s, SPLIT, ROW_ALIGN: tl.constexpr, MIN_CHUNK: tl.constexpr):
    """(start, end, n_split): the compacted-row range of split ``pid_s`` (empty past the last split that holds
    rows) and how many splits hold rows (at least 1: split 0 always runs)."""
    chunk = tl.maximum(tl.cdiv(tl.cdiv(count, SPLIT), ROW_ALIGN) * ROW_ALIGN, MIN_CHUNK)
    start = pid_s * chunk
    return start, tl.minimum(start + chunk, count), tl.maximum(tl.cdiv(count, chunk), 1)


@triton.jit
def _store_split(out_ptr, out_offs, part_ptr, part_offs, part_stride, ticket_ptr, ticket, acc, mask, pid_s,
                 n_split):
    """Write fp32 ``acc`` to ``out_ptr + out_offs`` (in the output's dtype) when one split holds the whole
    reduction. Otherwise store it as split ``pid_s``'s partial at ``part_ptr + pid_s * part_stride +
    part_offs`` and take a ticket from counter ``ticket``; the last split to arrive adds the partials in split
    order (a result that depends only on the data), writes the output and resets the counter for the next
    launch (and graph replay)."""
    if n_split == 1:
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + pid_s * part_stride + part_offs, acc, mask=mask)
        # release our partial, acquire everyone else's
        if tl.atomic_add(ticket_ptr + ticket, 1, sem="acq_rel") == n_split - 1:
            total = tl.zeros_like(acc)
            for s in range(0, n_split):
                total += tl.load(part_ptr + s * part_stride + part_offs, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(out_ptr + out_offs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(ticket_ptr + ticket, 0)
