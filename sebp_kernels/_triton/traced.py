"""The SEBP linear's backward as a ``torch.library.triton_op`` (``sebp::linear_grads_traced``): the row
selection and the fused gradient kernel launched through ``wrap_triton``, so that a compiled graph launches
them from Inductor's own code instead of calling a Python operator (:mod:`sebp_kernels.library`) for each
layer. On an H100 a compiled stack of 16 SEBP linears spent 174 us more host time per layer and step than dense
through the operator, and 35 us more this way (results/kernels.json, run op_triton).

What the body can read is fixed when the graph is traced, so it keeps only what needs no host decision at run
time: the rows are selected from dY on the device each time (exact, or above a threshold), then the fused
kernel computes dX, dW and db over them. Left to the operator path: the density fallback to the dense GEMMs
(:mod:`sebp_kernels.density`), the row hints of SEBP activations and padding rows, a reused dX buffer, top-N
selection and the smaller tile settings of GPUs with less shared memory than the H100's. The launch plan is
worked out when the body is traced, for the row count rounded up to a power of two (:func:`row_bucket`): a
graph traced with dynamic shapes serves every row count in that bucket, and recompiles in the next one.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.library import triton_op, wrap_triton

from .backward import INTERPRET, _ieee
from .grads import _grads_kernel, _plan
from .select import _compact_kernel, _row_flags_kernel, _select_plan, _sm_count


MIN_BUCKET = 256


def row_bucket(m) -> int:
    """The power of two (at least MIN_BUCKET) that row count ``m`` is planned for. ``m`` may be a symbolic size
    of a graph traced with dynamic shapes: the bucket comes from its example value, and the two comparisons
    below are the graph's guards, so a row count outside the bucket traces it again. The kernels take the true
    row count at run time: the programs a larger grid adds find no rows and exit."""
    hint = m if isinstance(m, int) else m.node.hint
    if hint is None:  # a size known only at run time (none in the SEBP layers): plan for it exactly
        hint = int(m)
    bucket = max(MIN_BUCKET, 1 << max(int(hint) - 1, 0).bit_length())
    if not (m <= bucket and (bucket == MIN_BUCKET or m > bucket // 2)):
        raise AssertionError(f"row count {m} outside its bucket {bucket}")
    return bucket


def select_rows_traced(dy: Tensor, eps: float, bucket: int) -> tuple[Tensor, Tensor]:
    """(perm, count) of 2-D ``dy``'s rows with any ``|value| > eps`` (eps 0: any non-zero), as
    :func:`~.select.select_rows_device` finds them (its plan, made for ``bucket`` rows), launched through
    ``wrap_triton``."""
    m, n = dy.shape
    _, nb, n_compact, flags_ints, flags_kw, compact_kw = _select_plan(
        bucket, n, dy.dtype, dy.stride(), "exact" if eps == 0 else "threshold", eps, INTERPRET)
    dev = dy.device
    # a tensor of its own for each (select.selection_buffers' views of one would alias under functionalization)
    flags = torch.empty(m, dtype=torch.int32, device=dev)
    block_count = torch.empty(nb, dtype=torch.int32, device=dev)
    perm = torch.empty(m, dtype=torch.int32, device=dev)
    count = torch.empty(1, dtype=torch.int32, device=dev)
    wrap_triton(_row_flags_kernel)[(nb,)](dy, flags, block_count, m, *flags_ints[1:], **flags_kw)
    wrap_triton(_compact_kernel)[(n_compact,)](flags, block_count, perm, count, m, **compact_kw)
    return perm, count


@triton_op("sebp::linear_grads_traced", mutates_args=())
def linear_grads_traced(dy: Tensor, x: Tensor, weight: Tensor, need_dx: bool, need_dw: bool, need_db: bool,
                        eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dX, dW, db) of ``Y = X Wᵀ + b`` over the rows of 2-D ``dy`` with a value above ``eps`` (0: exact);
    dX is zero on the other rows. An output not asked for is an empty tensor."""
    m, n_out = dy.shape
    n_in = weight.shape[1]
    bucket = row_bucket(m)
    perm, count = select_rows_traced(dy, eps, bucket)
    n_sm = _sm_count(dy.device)
    xs = x if need_dw else dy
    plan = _plan(bucket, n_out, n_in, dy.dtype, need_dx, need_dw, need_db, _ieee(dy.dtype), n_sm, INTERPRET,
                 1 if INTERPRET else None, None, dy.stride(), xs.stride(), weight.stride(), 0)
    dev = dy.device
    dx = torch.empty((m, n_in) if need_dx else (0,), dtype=dy.dtype, device=dev)
    dw = torch.empty((n_out, n_in) if need_dw else (0,), dtype=weight.dtype, device=dev)
    db = torch.empty((n_out,) if need_db else (0,), dtype=dy.dtype, device=dev)
    dw_part_n, db_part_n, dx_part_n = plan.part_n
    # a tensor of its own in every slot: one tensor in two slots would alias under functionalization
    parts = [torch.empty(max(k, 1), dtype=torch.float32, device=dev) for k in (dw_part_n, db_part_n, dx_part_n)]
    unused = [torch.empty(1, dtype=t, device=dev) for t in (torch.int8, torch.int32)]  # no reused dX
    tickets = torch.zeros(plan.n_tickets, dtype=torch.int32, device=dev)
    # count and perm again as dX's count and the (unused) row scales: both are only read
    wrap_triton(_grads_kernel)[plan.grid](dy, xs, weight, dx, dw, db, *parts, perm, count, count, perm, tickets,
                                          *unused, m, *plan.ints[1:], **plan.kw)
    return dx, dw, db
