"""Sampled mode's backward on the Triton kernels (:mod:`sebp_kernels.sampling` is the definition and the torch
reference): four launches (the exact mode's three and the cutoff update; ``budget="auto"`` adds a pass over X
and a norm of dW), all on the device, no host sync.

1. :func:`~.sample_select.select_sampled`: row norms, keep draws and 1/q scales in one pass over dY, then one
   compaction into a permutation whose first rows are the kept ones and whose next are the other non-zero rows.
2. The fused gradient kernel (:func:`~.grads.grads_rows`): dW and db over the kept rows, each row of dY times
   its 1/q inside the kernel; dX exact over every non-zero row (the same permutation, a larger count), or with
   ``sample_dx`` over the kept rows, each times its 1/q. Where nearly every row of dY was non-zero when last
   read back (:meth:`~sebp_kernels.sampling.SampleState.dense_dx`, exact mode's rule), the exact dX is the
   dense GEMM (cuBLAS) instead: there is nothing to skip in it.
3. The cutoff of the layer's next backward from this one's norms, written in place in one launch
   (:mod:`.sample_cutoff`; the torch reference's rule, :func:`~sebp_kernels.sampling.update_cutoff`), whose
   programs each bucket a share of the rows.

The reference takes over where this path does not apply: inputs the kernels do not take, the layer's first
backward (its cutoff comes from its own rows, solved before any draw) and the guard's backwards (they also
compute the exact dW). The keep decisions
are the reference's bit for bit given the same row norms; the norms are summed in another order than torch's,
so a row whose draw lands exactly on its threshold may differ (probability 2^-24 a row).
"""
from __future__ import annotations

import torch

from ..interpret import INTERPRET
from ..reference import dense_products, unit_col_stride, weight_view
from ..sampling import SampleState, layer_share, sampled_backward_torch, variance_budget
from .backward import _ieee, supported
from .grads import grads_rows
from .sample_cutoff import update_cutoff_device
from .sample_select import select_sampled
from .select import _sm_count, row_sumsq


def sampled_backward_triton(dy: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, config,
                            state: SampleState | None, need_dx: bool = True, need_dw: bool = True,
                            need_db: bool = True, dx_buffer=None):
    """(dX, dW, db) of ``Y = X Wᵀ + b`` for 2-D ``dy`` (M, out) in ``sampled`` mode, as
    :func:`~sebp_kernels.sampling.sampled_backward_torch` computes them, on the Triton kernels where they apply.
    ``dx_buffer``: a :class:`~sebp_kernels.zero_rows.ZeroRowBuffer` for dX, as in exact mode."""
    if (state is None or state.tau is None or state.armed
            or not supported(dy, x if need_dw else None, weight)):
        return sampled_backward_torch(dy, x, weight, config, state, need_dx, need_dw, need_db)
    dy, weight = unit_col_stride(dy), weight_view(weight)
    x = unit_col_stride(x) if x is not None else None
    dev = dy.device
    if state.tau.device != dev or state.tau.dtype != torch.float32 or state.tau.dim():
        state.tau = state.tau.to(dev, torch.float32).reshape(())  # e.g. loaded onto the CPU: once
    warm = state.calls < config.warmup
    perm, counts, w, q, scale, wmax = select_sampled(dy, state.tau, state.device_hash(config.seed, dev),
                                                     state.stats(dev), config.warmup, INTERPRET)
    state.calls += 1  # (the device's count, and the counters of rows, advanced in the compaction)
    sample_dx = config.sample_dx and not warm  # dX over the kept rows, scaled, too
    capturing = not INTERPRET and torch.cuda.is_current_stream_capturing()
    dense_dx = need_dx and not sample_dx and state.dense_dx(capturing)  # nearly all rows non-zero: cuBLAS
    dx = dw = db = None
    if need_dw or need_db or (need_dx and not dense_dx):
        dx, dw, db = grads_rows(dy, x, weight, perm, counts[:1], need_dx and not dense_dx, need_dw, need_db,
                                _ieee(dy.dtype), _sm_count(dev), INTERPRET, 1 if INTERPRET else None,
                                dx_buffer=dx_buffer, dx_count=counts[:1] if sample_dx else counts[1:],
                                scale=None if warm else scale, scale_dx=sample_dx)
    if dense_dx:
        dx = dense_products(dy, None, weight, True, False, False)[0]
    state.density.observe(counts[1:], dy.shape[0], capturing)
    # the next cutoff, in place; ||X_i||² for the variance rule only (a fixed share reads dY alone)
    if config.budget == "auto":
        xn2 = row_sumsq(x, INTERPRET) if need_dw else torch.ones_like(w)
        update_cutoff_device(state.tau, w, q, xn2, dw if need_dw else None, 1.0, variance_budget(config, state),
                             INTERPRET, wmax)
    else:
        update_cutoff_device(state.tau, w, q, None, None, layer_share(config, state), 0.0, INTERPRET, wmax)
    return dx, dw, db
