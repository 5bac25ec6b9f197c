"""Sampled mode's backward on the Triton kernels (:mod:`sebp_kernels.sampling` is the definition and the torch
reference), all on the device, no host sync:

1. :func:`~.sample_select.select_sampled`: row norms, keep draws and 1/q scales in one pass over dY, then one
   compaction into a permutation whose first rows are the kept ones and whose next are the other non-zero rows.
2. :func:`~.sample_gather.gather_kept`: the kept rows of dY, each times its 1/q, and of X into ``cap`` dense
   slots (zeros past the kept count; a random window of the kept rows, scaled by kept / cap, when more were
   kept), ``cap`` being a little above the layer's kept count as last read back
   (:meth:`~sebp_kernels.sampling.SampleState.capacity`). dW and db are then cuBLAS's GEMM and a sum over the
   slots, and with ``sample_dx`` dX is their GEMM with W scattered into zero rows. The exact dX is the dense
   GEMM where nearly every row of dY was non-zero when last read back
   (:meth:`~sebp_kernels.sampling.SampleState.dense_dx`, exact mode's rule), else the fused gradient kernel's
   over the non-zero rows. Under ``auto``, before the layer's kept share was first read back, and during
   warm-up, the fused gradient kernel (:func:`~.grads.grads_rows`) computes all three from the permutation
   instead (dW and db over the kept rows, each row times its 1/q inside the kernel): it needs no capacity, but
   reads the rows through the permutation at about half cuBLAS's rate.
3. The cutoff of the layer's next backward from this one's norms, written in place in one launch
   (:mod:`.sample_cutoff`; the torch reference's rule, :func:`~sebp_kernels.sampling.update_cutoff`), whose
   programs each bucket a share of the rows (``budget="auto"`` adds a pass over X and a norm of dW).

The reference takes over where this path does not apply: inputs the kernels do not take, the layer's first
backward (its cutoff comes from its own rows, solved before any draw) and the guard's backwards (they also
compute the exact dW). The keep decisions
are the reference's bit for bit given the same row norms; the norms are summed in another order than torch's,
so a row whose draw lands exactly on its threshold may differ (probability 2^-24 a row). Given the same
``cap``, the window is the reference's too.
"""
from __future__ import annotations

import torch

from ..interpret import INTERPRET
from ..reference import dense_products, unit_col_stride, weight_view
from ..sampling import SampleState, layer_share, sampled_backward_torch, variance_budget
from .backward import _ieee, supported
from .grads import grads_rows
from .sample_cutoff import update_cutoff_device
from .sample_gather import gather_kept
from .sample_select import select_sampled
from .select import _sm_count, row_sumsq


def sampled_backward_triton(dy: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, config,
                            state: SampleState | None, need_dx: bool = True, need_dw: bool = True,
                            need_db: bool = True, dx_buffer=None, cap: int | None = None):
    """(dX, dW, db) of ``Y = X Wᵀ + b`` for 2-D ``dy`` (M, out) in ``sampled`` mode, as
    :func:`~sebp_kernels.sampling.sampled_backward_torch` computes them (with the same ``cap``), on the Triton
    kernels where they apply. ``dx_buffer``: a :class:`~sebp_kernels.zero_rows.ZeroRowBuffer` for dX, as in
    exact mode. ``cap``: the slots of the gathered kept rows (default: :meth:`SampleState.capacity`)."""
    if (state is None or state.tau is None or state.armed
            or not supported(dy, x if need_dw else None, weight)):
        return sampled_backward_torch(dy, x, weight, config, state, need_dx, need_dw, need_db)
    dy, weight = unit_col_stride(dy), weight_view(weight)
    x = unit_col_stride(x) if x is not None else None
    dev = dy.device
    if state.tau.device != dev or state.tau.dtype != torch.float32 or state.tau.dim():
        state.tau = state.tau.to(dev, torch.float32).reshape(())  # e.g. loaded onto the CPU: once
    warm = state.calls < config.warmup
    hash_state = state.device_hash(config.seed, dev)
    perm, counts, w, q, scale, wmax = select_sampled(dy, state.tau, hash_state, state.stats(dev), config.warmup,
                                                     INTERPRET)
    state.calls += 1  # (the device's count, and the counters of rows, advanced in the compaction)
    sample_dx = config.sample_dx and not warm  # dX over the kept rows, scaled, too
    capturing = not INTERPRET and torch.cuda.is_current_stream_capturing()
    dense_dx = need_dx and not sample_dx and state.dense_dx(capturing)  # nearly all rows non-zero: cuBLAS
    dx = dw = db = None
    if warm:  # every non-zero row, unscaled: the fused kernel
        cap = None
    else:
        cap = state.capacity(dy.shape[0], config, capturing) if cap is None else cap
        state.kept.observe(counts[:1], dy.shape[0], capturing)
    if cap is not None and (need_dw or need_db or (need_dx and sample_dx)):
        # the kept rows, scaled, in cap dense slots: dW, db (and a sampled dX) are cuBLAS's GEMMs over them
        dyk, xk, rows = gather_kept(dy, x if need_dw else None, perm, counts[:1], scale, hash_state, cap,
                                    INTERPRET)
        dw = dyk.t() @ xk if need_dw else None
        db = dyk.sum(0) if need_db else None  # (accumulated in fp32 by torch)
        if need_dx and sample_dx:
            dx = dy.new_zeros((dy.shape[0], weight.shape[1])).index_copy_(0, rows, dyk @ weight)
        elif need_dx and not dense_dx:
            dx = grads_rows(dy, None, weight, perm, counts[1:], True, False, False, _ieee(dy.dtype),
                            _sm_count(dev), INTERPRET, 1 if INTERPRET else None, dx_buffer=dx_buffer)[0]
    elif need_dw or need_db or (need_dx and not dense_dx):
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
