"""The model's token embeddings skip the padding rows in their backward (:mod:`sebp_kernels.embedding`), with the
:class:`~sebp_kernels.pad_rows.PadRows` the SEBP linears take theirs from: :func:`patch_embeddings` is part of
:func:`~.patch.patch_model`'s padding rows, :func:`unpatch_embeddings` of its undoing."""
from __future__ import annotations

import types

from torch import nn

from sebp_kernels.embedding import real_rows, sebp_embedding


def _plain(module: nn.Module) -> bool:
    """An ``nn.Embedding`` itself (a subclass may scale or add to its output in a forward of its own) that takes
    none of the options the plain lookup leaves out."""
    return (type(module) is nn.Embedding and module.max_norm is None and not module.scale_grad_by_freq
            and not module.sparse)


def _forward(self, ids):
    return sebp_embedding(ids, self.weight, self.padding_idx, real_rows(self._sebp_pad_rows, ids))


def patch_embeddings(model: nn.Module, pad) -> list[str]:
    """Give each plain embedding of ``model`` the backward over the real rows of ``pad``'s batch; its names."""
    names = []
    for name, module in model.named_modules():
        if _plain(module):
            module._sebp_pad_rows = pad
            module.forward = types.MethodType(_forward, module)
            names.append(name)
    return names


def unpatch_embeddings(model: nn.Module) -> list[str]:
    """Undo :func:`patch_embeddings`; the embeddings' names."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and "_sebp_pad_rows" in vars(module):
            del module._sebp_pad_rows
            vars(module).pop("forward", None)
            names.append(name)
    return names
