"""Y = X Wᵀ (+ b) over the real-token rows of a padded batch, zeros (the bias) on the padding rows, in one launch.

The forward of a token-wise linear computes every row of a padded batch, padding included, though nothing
reads the padding rows' outputs (see :mod:`sebp_kernels.pad_rows`, which checks that first). The dX kernel
already computes ``A[perm[:k]] @ B`` scattered to rows ``perm[:k]`` and zeros elsewhere, with the row count
``k`` on the device: with ``A = X`` and ``B = Wᵀ`` (W read through swapped strides, no copy) it is that forward,
and it adds the bias as it stores.

Each shape's launch is planned once (tiles, splits, integer arguments, keywords; :class:`~.launch.Plans`) and
launched through :meth:`~.launch.FastLaunch.launch_planned`, as the backward's fused kernel is: a compiled SEBP
linear calls this once per layer and step.
"""
from __future__ import annotations

import torch

from .dw import _tickets
from .dx import _dx, dx_launch_args
from .launch import Plans, fit_to_device, plan_ids
from .tuning import LEVELS, few_rows

_LEVEL: dict = {}  # device index -> the tile setting that launches there
_PLANS = Plans(_dx)
_N_TENSORS = 8  # X, W, Y, partial sums, perm, count, tickets, bias


def linear_rows_triton(x: torch.Tensor, weight: torch.Tensor, perm: torch.Tensor, count: torch.Tensor, ieee: bool,
                       n_sm: int, interpret: bool = False, bias: torch.Tensor | None = None) -> torch.Tensor:
    """2-D ``x`` (M, in) @ ``weight``ᵀ (+ ``bias``, added in fp32 before the rounding) on rows ``perm[:count]``,
    zeros (the bias) on the others; smaller tiles on a GPU whose shared memory does not hold the H100's (as
    :func:`~.grads.grads_rows`)."""
    return fit_to_device(_LEVEL, x.device, range(LEVELS), lambda level: _rows_at(
        level, x, weight, perm, count, ieee, n_sm, interpret, bias), "smaller GEMM tiles")


def _plan(m, k_in, n_out, dtype, x_stride, w_stride, ieee, n_sm, interpret, level, has_bias):
    """(plan number, programs, fp32 partial-sum elements, the integer arguments, the keywords) of one shape: the
    dX kernel's B = Wᵀ, whose row stride is W's column stride and the other way round."""
    return next(plan_ids), *dx_launch_args(m, n_out, k_in, dtype, x_stride, (w_stride[1], w_stride[0]), interpret,
                                           ieee, n_sm, 0, level, few_rows(m, n_out, n_sm), has_bias)


def _rows_at(level, x, weight, perm, count, ieee, n_sm, interpret, bias):
    m, k_in = x.shape
    n_out = weight.shape[0]
    key = (m, k_in, n_out, x.dtype, x.stride(), weight.stride(), ieee, n_sm, interpret, level, bias is not None)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.add(key, _plan(m, k_in, n_out, x.dtype, x.stride(), weight.stride(), ieee, n_sm, interpret,
                                     level, bias is not None))
    idx, programs, part_n, ints, kw = plan
    y = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    part = torch.empty(part_n, dtype=torch.float32, device=x.device) if part_n else y
    _dx.launch_planned((programs,), idx, _N_TENSORS, (x, weight, y, part, perm, count, _tickets(x.device, n_sm),
                                                       x if bias is None else bias, *ints), kw)
    return y
