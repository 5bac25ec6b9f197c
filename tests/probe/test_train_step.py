"""sebp_probe.train.train_step: what makes a step's batch a new shape (its first run on a GPU is warm-up, untimed)."""
from __future__ import annotations

import torch
from accelerate import Accelerator

from sebp_probe.train.graphs import shape_key
from sebp_probe.train.train_step import MicroBatches, StepTally


def _new(micro: MicroBatches, batch: dict) -> bool:
    tally = StepTally(torch.zeros(()), torch.zeros(()), torch.zeros((), dtype=torch.long))
    micro._count(tally, batch, shape_key(batch))
    return tally.new_shape


def test_counts_a_batch_carries_are_no_new_shape():
    micro = MicroBatches(Accelerator(cpu=True), 1, False)
    ids = torch.ones(2, 8, dtype=torch.long)
    batch = {"input_ids": ids, "attention_mask": ids, "labels": ids}
    assert _new(micro, {**batch, "n_targets": 9, "max_row_targets": 5})
    assert not _new(micro, {**batch, "n_targets": 11, "max_row_targets": 6})  # same tensors, other counts
    assert _new(micro, {k: v[:, :4] for k, v in batch.items()})  # another length
