"""The training loss of one batch, whatever its layout: the one call the loop, calibration and timing make."""
from __future__ import annotations

import torch

from .heads import HeadError, head_loss
from .packing import packed_call, packed_forward


def batch_loss(model: torch.nn.Module, batch: dict, labelled_head: bool = False) -> torch.Tensor:
    """``model(**batch).loss`` for padded batches; for packed ones (they carry ``cu_seqlens``) the same loss
    through :func:`~sebp_probe.packing.packed_forward` (attention per sequence).

    ``labelled_head``: the same loss through :func:`~sebp_probe.heads.head_loss` with the last layer and the
    head on the rows the loss reads only (causal LM: the labelled tokens; classification: the [CLS] rows, padded
    batches only)."""
    if not labelled_head:
        return packed_forward(model, batch).loss if "cu_seqlens" in batch else model(**batch).loss
    task = "classification" if batch["labels"].dim() == 1 else "causal-lm"
    if "cu_seqlens" not in batch:
        return head_loss(model, batch, task, last_layer_rows_only=True).loss
    if task == "classification":
        raise HeadError("the [CLS]-rows last layer takes padded batches only, not packed ones")
    with packed_call(model, batch) as inputs:
        return head_loss(model, inputs, task, last_layer_rows_only=True).loss


def token_counts(batch: dict) -> tuple[torch.Tensor, int]:
    """(real tokens as a device tensor, token slots) of a batch: what the loop logs as tokens and rows."""
    if "cu_seqlens" in batch:
        return batch["cu_seqlens"][-1], batch["input_ids"].numel()
    mask = batch["attention_mask"]
    return mask.sum(), mask.numel()
