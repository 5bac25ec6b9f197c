"""The embedding backward without the padding rows.

An ``nn.Embedding``'s backward adds each row of dL/dY into the weight row its token names. In a padded batch
whose padding rows get no gradient (what :mod:`.pad_rows` checks on the linears' dL/dY: the residual stream
carries those same rows down to the embeddings) the padding rows add zeros, and PyTorch's kernel still walks
them: below 3072 tokens it goes through them a chunk after another on a few dozen SMs, 50-110 us a table for
2112 tokens of BERT-base's width on an H200, while it skips the rows of its ``padding_idx`` at a
fraction of that. :func:`sebp_embedding` hands the padding rows to that skip: in the backward each of them
names one more row of the table, which the kernel is told is the one to skip, so the result is the same sum over
the real rows (each weight row's sum keeps its order; only zeros are left out).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .pad_rows import ON


class _Embedding(torch.autograd.Function):
    """``F.embedding`` whose backward leaves out the rows where ``real`` is False."""

    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, padding_idx: int | None, real: Tensor) -> Tensor:
        ctx.save_for_backward(ids, real)
        ctx.n, ctx.padding_idx = weight.shape[0], padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        ids, real = ctx.saved_tensors
        n = ctx.n
        keep = real if ctx.padding_idx is None else real & (ids != ctx.padding_idx)
        skipped = torch.where(keep, ids, n)
        # a table of one row more, whose last row n is the one the kernel skips: an index past the table itself
        # made PyTorch's kernel for more than 3072 tokens read out of bounds (CUDA, torch 2.11)
        grad = torch.ops.aten.embedding_dense_backward(dy, skipped, n + 1, n, False)
        return None, grad[:n], None, None


def real_rows(pad, ids: Tensor) -> Tensor | None:
    """The real-token flags (batch, seq) of the batch ``pad`` (a :class:`~.pad_rows.PadRows`) was set with, for
    an embedding of ``ids``: only once its check found no gradient on the padding (``on``), only where ``ids``
    are the batch's tokens (batch, seq), never inside ``torch.compile`` (where the pre-hook names no rows);
    else None."""
    if torch.compiler.is_compiling():  # first: traced, reading the check's state would guard on it
        return None
    if pad is None or pad.state != ON or pad.real is None or tuple(ids.shape) != pad.shape:
        return None
    return pad.real


def sebp_embedding(ids: Tensor, weight: Tensor, padding_idx: int | None = None,
                   real: Tensor | None = None) -> Tensor:
    """``F.embedding(ids, weight, padding_idx)`` whose backward skips the rows where ``real`` (the shape of
    ``ids``) is False, whose dL/dY the caller knows to be zero (see the module docstring); ``real`` None: plain
    ``F.embedding``."""
    if real is None or not (torch.is_grad_enabled() and weight.requires_grad):
        return F.embedding(ids, weight, padding_idx)
    return _Embedding.apply(ids, weight, padding_idx, real)
