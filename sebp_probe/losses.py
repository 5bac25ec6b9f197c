"""The training loss of one batch, whatever its layout: the one call the loop, calibration and timing make."""
from __future__ import annotations

import torch

from .packing import packed_forward


def batch_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """``model(**batch).loss`` for padded batches; for packed ones (they carry ``cu_seqlens``) the same loss
    through :func:`~sebp_probe.packing.packed_forward` (attention per sequence)."""
    if "cu_seqlens" in batch:
        return packed_forward(model, batch).loss
    return model(**batch).loss


def token_counts(batch: dict) -> tuple[torch.Tensor, int]:
    """(real tokens as a device tensor, token slots) of a batch: what the loop logs as tokens and rows."""
    if "cu_seqlens" in batch:
        return batch["cu_seqlens"][-1], batch["input_ids"].numel()
    mask = batch["attention_mask"]
    return mask.sum(), mask.numel()
