"""A training step's parts: its micro-batches run eagerly or as CUDA-graph replays, their backward timed and
their tokens, rows and batch shapes counted; why a step is left out of the run's times; the stop request read
at step boundaries. The optimizer step, the logging and the run around them are :mod:`.loop`'s."""
from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .graphs import StepGraphs, shape_key
from ..model.losses import has_no_target, no_cache, token_counts


class StopRequest:
    """Turns the first SIGINT/SIGTERM into a flag read at the next step boundary; a second one interrupts."""

    def __init__(self):
        self.requested = False
        self._old: dict = {}

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)
        return False


UNTIMED = ("compile", "graph capture", "new shape")  # why a step is untimed, first reason first


def untimed_reason(compiled: bool, captured: bool, new_shape: bool) -> str | None:
    """Why a step is left out of the run's times (None: it is timed): Dynamo compiled during it, a CUDA graph was
    captured, or the GPU ran a batch of its shape for the first time in this run (cuBLAS heuristics, allocator
    blocks, kernel loads: the first run of a --compare would pay these and the second find them warm)."""
    return next((r for r, on in zip(UNTIMED, (compiled, captured, new_shape)) if on), None)


@dataclass
class StepTally:
    """What one step's micro-batches add up to. The tensors stay on the device until the step's one wait."""

    loss_sum: torch.Tensor
    tokens: torch.Tensor
    empty: torch.Tensor  # micro-batches without a target
    rows: int = 0
    epoch: int = 0  # of the last micro-batch
    new_shape: bool = False  # a batch shape this run had not stepped on (the GPU's first run of one is warm-up)
    replayed: int = 0  # micro-batches run as graph replays (--cuda-graphs)
    timers: list = field(default_factory=list)  # the backward's CUDA events, read after the wait for the loss
    host_ms: float = 0.0  # the backward's host time where no CUDA events time it

    def backward_ms(self) -> float:
        """The step's backward time; called after the wait for the loss, when its events are done."""
        ms = self.host_ms
        for ev0, ev1 in self.timers:
            ev1.synchronize()  # (done by now)
            ms += ev0.elapsed_time(ev1)
        return ms


class MicroBatches:
    """Runs the ``grad_accum`` micro-batches of a step: eagerly, the gradients synchronized across processes on
    the last one only, or (``--cuda-graphs``) as replays of the graphs captured at each batch shape's first
    batch, which add into the ``.grad`` tensors."""

    def __init__(self, acc, grad_accum: int, cuda_graphs: bool):
        self.acc, self.accum, self.cuda_graphs = acc, grad_accum, cuda_graphs
        self.use_events = acc.device.type == "cuda"
        self.graphs: dict = {}  # batch shape -> its StepGraphs, captured at its first batch
        self.pool = torch.cuda.graph_pool_handle() if cuda_graphs else None  # one memory pool for all of them
        self.seen_shapes: set = set()  # batch shapes this run has stepped on

    def run(self, batches: Iterator, model: torch.nn.Module, loss_fn: Callable,
            around: Callable[[dict], contextlib.AbstractContextManager] | None = None) -> StepTally:
        """Forward and backward of the step's micro-batches, drawn from ``batches`` ((epoch, batch) pairs);
        ``around(batch)``: a context each eager micro-batch runs in (the gradient probe's)."""
        dev = self.acc.device
        tally = StepTally(torch.zeros((), device=dev), torch.zeros((), device=dev),
                          torch.zeros((), dtype=torch.long, device=dev))
        for i in range(self.accum):
            tally.epoch, batch = next(batches)
            key = shape_key(batch)
            self._count(tally, batch, key)
            if self.cuda_graphs:
                self._replay(tally, model, batch, key)
            else:
                with around(batch) if around is not None else contextlib.nullcontext():
                    self._eager(tally, model, batch, loss_fn, last=i == self.accum - 1)
        return tally

    def close(self) -> None:
        """Free the graphs, and with the last of them their memory pool."""
        for step_graphs in self.graphs.values():
            step_graphs.close()
        self.graphs.clear()

    def _count(self, tally: StepTally, batch, key) -> None:
        # the tensors' (name, shape, dtype): a count a batch carries (n_targets, max_seqlen) is no new shape
        tally.new_shape |= key not in self.seen_shapes
        self.seen_shapes.add(key)
        real, slots = token_counts(batch)
        tally.tokens += real
        tally.empty += has_no_target(batch)
        tally.rows += slots

    def _replay(self, tally: StepTally, model, batch, key) -> None:
        step_graphs = self.graphs.get(key)
        if step_graphs is None:  # adds into the .grad tensors, keeping what they hold
            step_graphs = self.graphs[key] = StepGraphs(model, batch, scale=1.0 / self.accum, pool=self.pool,
                                                        call_kwargs=no_cache(model))
        tally.loss_sum += step_graphs.forward(batch).detach().float()
        self._timed(tally, step_graphs.backward)
        tally.replayed += 1

    def _eager(self, tally: StepTally, model, batch, loss_fn: Callable, last: bool) -> None:
        acc = self.acc
        with acc.no_sync(model) if not last else contextlib.nullcontext():
            with acc.autocast():  # the head path calls the backbone past the prepared forward
                loss = loss_fn(model, batch)
            tally.loss_sum += loss.detach().float()
            self._timed(tally, lambda: acc.backward(loss / self.accum))

    def _timed(self, tally: StepTally, backward: Callable[[], None]) -> None:
        """Run ``backward`` between two CUDA events (read after the step's wait), or on the host's clock."""
        if self.use_events:
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
            backward()
            ev1.record()
            tally.timers.append((ev0, ev1))
        else:
            t0 = time.perf_counter()
            backward()
            tally.host_ms += (time.perf_counter() - t0) * 1e3
