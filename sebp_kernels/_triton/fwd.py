"""Y = X Wᵀ over the real-token rows of a padded batch, zeros on the padding rows, in one launch.

The forward of a token-wise linear computes every row of a padded batch, padding included, though nothing
reads the padding rows' outputs (see :mod:`sebp_kernels.pad_rows`, which checks that first). The dX kernel
already computes ``A[perm[:k]] @ B`` scattered to rows ``perm[:k]`` and zeros elsewhere, with the row count
``k`` on the device: with ``A = X`` and ``B = Wᵀ`` (a strided view, no copy) it is that forward.
"""
from __future__ import annotations

import torch

from .dx import dx_rows
from .launch import fit_to_device
from .tuning import LEVELS, few_rows

_LEVEL: dict = {}  # device index -> the tile setting that launches there


def linear_rows_triton(x: torch.Tensor, weight: torch.Tensor, perm: torch.Tensor, count: torch.Tensor, ieee: bool,
                       n_sm: int, interpret: bool = False, bias: torch.Tensor | None = None) -> torch.Tensor:
    """2-D ``x`` (M, in) @ ``weight``ᵀ (+ ``bias``, added in fp32 before the rounding) on rows ``perm[:count]``,
    zeros (the bias) on the others; smaller tiles on a GPU whose shared memory does not hold the H100's (as
    :func:`~.grads.grads_rows`)."""
    small = few_rows(x.shape[0], weight.shape[0], n_sm)
    return fit_to_device(_LEVEL, x.device, range(LEVELS), lambda level: dx_rows(
        x, weight.t(), perm, count, interpret, ieee, n_sm, 0, level, small, bias), "smaller GEMM tiles")
