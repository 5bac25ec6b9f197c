"""``finetune --probe-every N``: the collector of ``analyze`` on the backward of every Nth optimizer step.

Steps 1, N + 1, 2N + 1, ... are probed (step 1's backward is at the weights the run starts from). On a probed
step the collector's hooks (:class:`~sebp_probe.analysis.hooks.GradientStatsCollector`) are put on the model
before its micro-batches and taken off after them: the statistics come from that step's own forward and
backward, reduced on the device, one host transfer per micro-batch; the steps in between run without a hook.
Under ``--compile`` a probed step runs eagerly (``torch.compiler.set_stance("force_eager")``, as the held-out
evaluation does): the compiled graphs do not run hooks added after they were traced, and eager steps add
neither graphs nor recompiles. CUDA-graph replays run no hooks either, so ``--cuda-graphs`` is refused with it
(:class:`~sebp_probe.config.FinetuneConfig`).

A probed step's counts are summed over the processes (one all-reduce) before its record
(:func:`~sebp_probe.analysis.through_training.step_record`) is made, after the step's own record: the
host-side summary is not in the step's time.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np
import torch

from ..analysis.causes import grouper
from ..analysis.hooks import GradientStatsCollector
from ..analysis.through_training import StepCounts, series, step_counts, step_record
from .compiling import evaluating_eagerly

Around = Callable[[dict], contextlib.AbstractContextManager]


class StepProbe:
    """The probe of one run: ``every`` None probes nothing. ``model`` is the unwrapped (plain or patched)
    model; ``reduce`` sums a tensor over the processes (None: one process)."""

    def __init__(self, every: int | None, model: torch.nn.Module | None, task: str | None, compiled: bool,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None, device: torch.device | None = None):
        self.every, self.model, self.compiled, self.reduce, self.device = every, model, compiled, reduce, device
        self.groups = grouper(model, task) if every else None
        self._counts: StepCounts | None = None

    def due(self, step: int) -> bool:
        """Is optimizer step ``step`` (1-based) probed?"""
        return bool(self.every) and (step - 1) % self.every == 0

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[Around | None]:
        """Around a step's micro-batches: yields None on a step that is not probed, else the context each
        micro-batch's forward and backward run in."""
        if not self.due(step):
            yield None
            return
        collector = GradientStatsCollector(self.model)
        with evaluating_eagerly(self.compiled), collector:
            yield lambda batch: collector.batch(batch.get("attention_mask"), self.groups(batch))
        self._counts = step_counts(collector.stats())

    def take(self, step: int) -> dict | None:
        """The record of the probed step just run (None when it was not probed); every process calls it."""
        counts, self._counts = self._counts, None
        if counts is None:
            return None
        if self.reduce is not None:
            total = self.reduce(torch.from_numpy(counts.pack()).to(self.device))
            counts = StepCounts.unpack(counts.names, total.cpu().numpy().astype(np.int64))
        return step_record(counts, step)


def probe_summary(records: list[dict], every: int | None) -> dict | None:
    """summary.json's ``grad_stats``: the probes' series per layer type (None without --probe-every)."""
    if not every:
        return None
    return {"every": every, **series(records)}
