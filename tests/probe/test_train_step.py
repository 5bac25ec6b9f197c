"""sebp_probe.train.train_step: what makes a step's batch a new shape (its first run on a GPU is warm-up, untimed)."""
from __future__ import annotations

from types import SimpleNamespace

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


class _TwoProcesses:
    """An accelerator of 2 processes whose other process reports ``other`` (loss, then one flag per reason)."""

    num_processes = 2

    def __init__(self, other: list[float]):
        self.other = torch.tensor(other)

    def reduce(self, t, op):
        assert op == "sum"
        return t + self.other


def _reduce(other: list[float], loss: float, untimed):
    from sebp_probe.train.loop import Run

    return Run._reduce_loss(SimpleNamespace(acc=_TwoProcesses(other)), torch.tensor(loss), untimed)


def test_a_step_another_process_compiled_in_is_untimed_on_every_process():
    """Under FSDP a process that recompiles holds the other up in the next collective for the whole compile: the
    step counts as compiled on both. The loss is the processes' mean."""
    assert _reduce([3.0, 1.0, 0.0, 0.0], 1.0, None) == (2.0, "compile")
    assert _reduce([3.0, 0.0, 0.0, 1.0], 1.0, "compile") == (2.0, "compile")  # the first reason wins
    assert _reduce([3.0, 0.0, 0.0, 1.0], 1.0, None) == (2.0, "new shape")
    assert _reduce([3.0, 0.0, 0.0, 0.0], 1.0, None) == (2.0, None)
    assert _reduce([3.0, 0.0, 1.0, 0.0], 1.0, "new shape") == (2.0, "graph capture")


def test_one_process_reduces_nothing_and_keeps_its_own_reason():
    class One:
        num_processes = 1

        def reduce(self, t, op):
            assert op == "mean"
            return t

    from sebp_probe.train.loop import Run

    assert Run._reduce_loss(SimpleNamespace(acc=One()), torch.tensor(2.5), "new shape") == (2.5, "new shape")
