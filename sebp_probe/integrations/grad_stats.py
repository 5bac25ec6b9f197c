"""Gradient statistics through training in a Hugging Face ``Trainer`` or TRL ``SFTTrainer``: what
``finetune --probe-every`` records, logged through the trainer's own ``log`` (so ``report_to`` sends it to
TensorBoard, W&B or whatever the user set).

    from sebp_probe.integrations.hf import add_grad_stats

    stats = add_grad_stats(trainer, every=10)   # with or without apply_sebp(trainer)
    trainer.train()                              # logs grad_stats/<layer type>/rows_90 ... every 10 steps

Steps 1, every + 1, ... are probed: their micro-batches run through the collector of ``analyze``
(:class:`~sebp_probe.analysis.hooks.GradientStatsCollector`), the trainer's ``training_step`` wrapped for that
step only (each call is one micro-batch's forward and backward, whose rows it groups by cause). Under
``torch_compile`` the collector is made when training begins, with its taps in the model's linears, so the
compiled graphs carry them (:mod:`sebp_probe.analysis.graph_tap`): a probed graph beside the unprobed one, and
the probed steps run compiled. As in ``finetune``, one collector serves
the run, the step's micro-batches add up on the device and the counts go to the host in one copy, read after
the optimizer step. Under DDP every process all-reduces
its counts (a sum) and logs the same record; the trainer's loggers write from the main process. Per layer type
the log holds the rows by cause (shares of its rows) and the share of active rows holding 50/90/99% of the
squared norm of dL/dY and the knee (:mod:`sebp_probe.analysis.through_training`), and ``grad_stats/record_ms``:
the host time the record took after the optimizer step (reading the counts, the all-reduce, the record), in no
step's time, as ``finetune`` reports it; ``records`` keeps the whole records, per layer too.
"""
from __future__ import annotations

import contextlib
import time

import numpy as np
import torch
from transformers import TrainerCallback

from ..analysis.causes import CAUSES, grouper
from ..analysis.grad_records import Snapshot
from ..analysis.hooks import GradientStatsCollector
from ..analysis.through_training import SHARES, StepCounts, share_key, step_record, totals_counts

PREFIX = "grad_stats"


def log_values(record: dict) -> dict[str, float]:
    """A step record as the flat scalars a trainer logs: ``grad_stats/<layer type>/<key>``."""
    out: dict[str, float] = {}
    for t, e in record["types"].items():
        for cause in CAUSES:
            if cause in e.get("causes", {}):
                out[f"{PREFIX}/{t}/{cause}"] = float(e["causes"][cause])
        for key in [share_key(q) for q in SHARES] + ["knee"]:
            if e.get(key) is not None:
                out[f"{PREFIX}/{t}/{key}"] = float(e[key])
    if record.get("nonfinite_rows"):
        out[f"{PREFIX}/nonfinite_rows"] = float(record["nonfinite_rows"])
    if "record_ms" in record:
        out[f"{PREFIX}/record_ms"] = float(record["record_ms"])
    return out


def _all_reduce(counts: StepCounts, device) -> StepCounts:
    """The counts summed over the processes of the default group (as they are with one process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return counts
    t = torch.from_numpy(counts.pack()).to(device)
    dist.all_reduce(t)
    return StepCounts.unpack(counts.names, t.cpu().numpy().astype(np.int64))


class GradStatsCallback(TrainerCallback):
    """The callback :func:`add_grad_stats` adds; ``records``: the records of the probed steps so far."""

    def __init__(self, trainer, every: int = 10, task: str | None = None):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an integer >= 1, got {every!r}")
        self.trainer, self.every, self.task = trainer, every, task
        self.records: list[dict] = []
        self._stack: contextlib.ExitStack | None = None
        self._collector: GradientStatsCollector | None = None  # made at the first probed step, kept
        self._groups = None
        self._pending: tuple[Snapshot, int] | None = None  # a probed step's counts on their way, its number

    def due(self, step: int) -> bool:
        """Is optimizer step ``step`` (1-based) probed?"""
        return (step - 1) % self.every == 0

    def _collector_of(self, args) -> GradientStatsCollector:
        """The collector of the trainer's model (made once per model, kept; with its taps under torch_compile)."""
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        if self._collector is None or self._collector.model is not model:
            self._close()
            graph = bool(getattr(args, "torch_compile", False))
            self._collector, self._groups = GradientStatsCollector(model, graph=graph), grouper(model, self.task)
        return self._collector

    def _close(self) -> None:
        if self._collector is not None:
            self._collector.close()
            self._collector = None

    def on_train_begin(self, args, state, control, **kwargs):
        if getattr(args, "torch_compile", False):  # the taps in place before the model's first trace
            self._collector_of(args)

    def on_step_begin(self, args, state, control, **kwargs):
        if not self.due(state.global_step + 1):
            return
        trainer = self.trainer
        collector = self._collector_of(args)
        groups = self._groups
        stack = contextlib.ExitStack()
        stack.enter_context(collector)
        stack.callback(collector.discard)  # a step stopped half-way leaves nothing for the next
        had = "training_step" in vars(trainer)
        own, previous = trainer.training_step, vars(trainer).get("training_step")

        def training_step(model, inputs, *a, **kw):
            with collector.accumulate(groups(inputs)):  # the step's micro-batches add up on the device
                return own(model, inputs, *a, **kw)

        trainer.training_step = training_step
        stack.callback(lambda: setattr(trainer, "training_step", previous) if had
                       else vars(trainer).pop("training_step", None))
        self._stack = stack

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        """The step's backwards are done: hooks off, the counts sent to the host (nothing waits for them)."""
        if self._stack is None:
            return
        self._pending = (self._collector.snapshot(), state.global_step + 1)  # before the stack's discard
        self._stack.close()
        self._stack = None

    def on_step_end(self, args, state, control, **kwargs):
        """After the optimizer step: the counts read, reduced over the processes, the record made and logged."""
        if self._pending is None:
            return
        (snapshot, step), self._pending = self._pending, None
        t0 = time.perf_counter()
        counts = totals_counts(self._collector.names, snapshot.wait())
        record = step_record(_all_reduce(counts, args.device), step)
        record["record_ms"] = round((time.perf_counter() - t0) * 1e3, 3)  # host time after the step, as finetune's
        self.records.append(record)
        self.trainer.log(log_values(record))

    def on_train_end(self, args, state, control, **kwargs):
        if self._stack is not None:  # a run stopped inside a probed step
            self._stack.close()
            self._stack = None
        self._close()  # under torch_compile: the model's linears get their own classes back


def add_grad_stats(trainer, every: int = 10, task: str | None = None) -> GradStatsCallback:
    """Add the gradient statistics of every ``every``-th step to ``trainer``'s logs; ``task`` (classification,
    causal-lm, mlm) says which rows are label-less (default: from the batches' labels)."""
    callback = GradStatsCallback(trainer, every, task)
    trainer.add_callback(callback)
    return callback
