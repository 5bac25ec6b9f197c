"""``finetune --probe-every N``: the collector of ``analyze`` on the backward of every Nth optimizer step.

Steps 1, N + 1, 2N + 1, ... are probed (step 1's backward is at the weights the run starts from). One collector
(:class:`~sebp_probe.analysis.hooks.GradientStatsCollector`) serves the whole run, made with the probe (targets,
buffers, hooks: nothing per model is redone per step). On a probed step its forward hooks are put on the
model before the micro-batches and taken off after them: the statistics come from that step's own forward and
backward, added up on the device over its micro-batches, then sent to the host in one copy that nothing waits
for; the steps in between run without a hook.
Under ``--compile`` a probed step runs compiled: the collector puts its taps into the graphs
(:mod:`~sebp_probe.analysis.graph_tap`; hooks would not enter them), so the run's first step, which is probed,
compiles the probed graphs and its second the unprobed ones; after that a step of either kind reuses its own,
without recompiles. CUDA-graph replays run no Python, so ``--cuda-graphs`` is refused with it
(:class:`~sebp_probe.config.FinetuneConfig`).

Inside a probed step the host neither waits for the device nor does per-layer bookkeeping: the copy is read in
:meth:`StepProbe.take`, after the step's own record, where the counts are summed over the processes (one
all-reduce) and the record (:func:`~sebp_probe.analysis.through_training.step_record`) is made: the host-side
summary is not in the step's time.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from ..analysis.causes import grouper
from ..analysis.hooks import GradientStatsCollector
from ..analysis.grad_records import Snapshot
from ..analysis.through_training import RECORD, StepCounts, series, step_record, totals_counts
from .metrics import MIN_TIMED_STEPS, medians_apart, timed_steps

Around = Callable[[dict], contextlib.AbstractContextManager]


class StepProbe:
    """The probe of one run: ``every`` None probes nothing. ``model`` is the unwrapped (plain or patched)
    model; ``compiled``: it runs compiled (the collector's taps go into its graphs); ``reduce`` sums a tensor
    over the processes (None: one process)."""

    def __init__(self, every: int | None, model: torch.nn.Module | None, task: str | None, compiled: bool,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None, device: torch.device | None = None):
        self.every, self.model, self.reduce, self.device = every, model, reduce, device
        self.groups = grouper(model, task) if every else None
        # made once per run (targets, buffers, hooks or taps); a probed step only turns them on and off
        self._collector = GradientStatsCollector(model, graph=compiled) if every else None
        self._snapshot: Snapshot | None = None  # the last probed step's counts, on their way to the host

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
        collector, groups = self._collector, self.groups
        self._snapshot = None
        with collector:
            try:
                yield lambda batch: collector.accumulate(groups(batch))
            except BaseException:
                collector.discard()  # a step that failed leaves nothing for the next probed step
                raise
        self._snapshot = collector.snapshot()

    def close(self) -> None:
        """Give the model back as it came (a compiled run's taps off)."""
        if self._collector is not None:
            self._collector.close()

    @property
    def _counts(self) -> StepCounts | None:
        """The probed step's counts on the host (waits for their copy); None when the last step was not probed."""
        if self._snapshot is None:
            return None
        return totals_counts(self._collector.names, self._snapshot.wait())

    def take(self, step: int) -> dict | None:
        """The record of the probed step just run (None when it was not probed); every process calls it."""
        counts, self._snapshot = self._counts, None
        if counts is None:
            return None
        if self.reduce is not None:
            total = self.reduce(torch.from_numpy(counts.pack()).to(self.device))
            counts = StepCounts.unpack(counts.names, total.cpu().numpy().astype(np.int64))
        return step_record(counts, step)

    def take_timed(self, step: int) -> dict | None:
        """:meth:`take`, its record with ``record_ms``: the host time it took after the step, in no step's time
        (finetune's metrics.jsonl line)."""
        t0 = time.perf_counter()
        rec = self.take(step)
        return rec if rec is None else {**rec, "record_ms": round((time.perf_counter() - t0) * 1e3, 3)}


def probe_summary(records: list[dict], every: int | None) -> dict | None:
    """summary.json's ``grad_stats``: the probes' series per layer type, what the probed steps cost (``cost``,
    :func:`probe_cost`, where the run timed enough of them) and the median host time of making a record after a
    probed step (``record_ms``, out of every step's time); None without --probe-every."""
    if not every:
        return None
    cost = probe_cost(records)
    made = [r["record_ms"] for r in records if r.get("type") == RECORD and "record_ms" in r]
    return {"every": every, **series(records), **({"cost": cost} if cost else {}),
            **({"record_ms": statistics.median(made)} if made else {})}


def probe_cost(records: list[dict]) -> dict | None:
    """The step time of a run's timed probed steps against its other timed steps (:func:`timed_steps`): each
    kind's median and interquartile range, their ratio, and ``within_noise`` (:func:`medians_apart`). The steps
    ran different batches, so this is the run's own figure, not a benchmark (``bench --probe`` times both kinds
    of step on the same batches). None under :data:`MIN_TIMED_STEPS` of either kind."""
    probed = {r["step"] for r in records if r.get("type") == RECORD}
    timed = timed_steps(records)
    kinds = [[r["step_ms"] for s, r in timed.items() if (s in probed) == p] for p in (True, False)]
    if min(map(len, kinds)) < MIN_TIMED_STEPS:
        return None
    (p1, p, p3), (o1, o, o3), ratio, noise = medians_apart(*kinds)
    return {"probed_steps": len(kinds[0]), "other_steps": len(kinds[1]), "probed_ms": p, "probed_iqr": [p1, p3],
            "other_ms": o, "other_iqr": [o1, o3], "ratio": ratio, "within_noise": noise}
