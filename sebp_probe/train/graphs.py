"""One training micro-step (forward to the loss, then its backward) as two CUDA graphs.

Replaying graphs removes the host's share of a step: every kernel launch, allocation and line of Python
between them. Where the GPU finishes a layer's backward faster than the host can issue it (BERT-base in
bf16 on an H100: about 12 ms of SEBP kernels against about 34 ms of host time to issue them), the eager
SEBP backward is slower than the dense one and only replays show what the kernels gain. The SEBP backward
makes no host sync, so it can be captured; the torch SEBP path (it gathers with a host-side row count)
cannot.

``accumulate=True`` is how a training loop uses it: every trainable parameter holds a ``.grad`` before the
capture, so the captured backward adds into those tensors in place, exactly as an eager backward into
existing gradients does. Gradient accumulation, clipping and the optimizer then run eagerly on the same
tensors, which must never be set to None (``zero_grad(set_to_none=False)``). The warm-up passes run with the
gradients set aside, so graphs can be built in the middle of an accumulation too. ``accumulate=False``
(timing) lets the capture allocate the gradients in the graphs' memory pool, as a first eager backward would.

Capture needs static shapes: the batch is copied into tensors the graphs own, so a loop keeps one
:class:`StepGraphs` per batch shape (:func:`shape_key`). They can share one memory pool (``pool``, from
``torch.cuda.graph_pool_handle()``) as long as each replays its forward and then its backward before another
replays: a step's activations only live between those two.
"""
from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable

import torch

WARMUP = 3  # eager iterations on a side stream before capture (compilation, allocator, cuBLAS workspaces)
_SIDE: dict = {}  # device index -> the one warm-up stream


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One warm-up stream per device for every capture: torch keeps a cuBLAS workspace for each stream a
    matmul ever ran on, for as long as the process lives (65 MiB a stream on an H100, measured with
    measured with a capture loop), so a fresh stream per capture leaked that much each time."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SIDE:
        _SIDE[idx] = torch.cuda.Stream(idx)
    return _SIDE[idx]


def shape_key(batch: dict) -> tuple:
    """What a batch must share with the one a :class:`StepGraphs` was captured on to replay it: its tensors'
    names, shapes and dtypes. Its other entries are host-side counts (the ints a causal LM's batch carries for
    the labelled-rows head, such as ``n_targets``), no input of the model's own forward, which the graphs
    replay: left out here and of the captured inputs."""
    return tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(_tensors(batch).items()))


def _tensors(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if torch.is_tensor(v)}


class CaptureError(RuntimeError):
    """The step could not be captured as it is; the message says why, in one line."""


class StepGraphs:
    """Captured ``loss = model(**batch, **call_kwargs).loss`` (under ``autocast``) and
    ``(loss * scale).backward()``.

    :meth:`forward` copies a batch into the static inputs and replays the forward graph, returning the static
    loss tensor (overwritten by the next replay); :meth:`backward` replays the backward graph. The RNG the
    warm-up and capture draw (dropout) is forked, so building the graphs leaves the training's RNG as it was;
    each replay then draws from the generator like an eager step."""

    def __init__(self, model: torch.nn.Module, batch: dict, autocast: Callable = contextlib.nullcontext,
                 scale: float = 1.0, accumulate: bool = True, warmup: int = WARMUP, pool=None,
                 call_kwargs: dict | None = None):
        if not torch.cuda.is_available():
            raise CaptureError("CUDA graphs need a CUDA GPU")
        self.model, self.autocast, self.scale = model, autocast, scale
        self.kwargs = call_kwargs or {}  # the model call's other arguments (``use_cache=False``)
        self.static = {k: v.detach().clone() for k, v in _tensors(batch).items()}
        dev = next(iter(self.static.values())).device
        params = [p for p in model.parameters() if p.requires_grad]
        kept = [p.grad for p in params]  # what an accumulation holds so far: set aside during the warm-up
        for p in params:
            p.grad = None
        with torch.random.fork_rng(devices=[dev.index or 0]):
            side = _side_stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    self._eager_step()
            torch.cuda.current_stream(dev).wait_stream(side)
            if accumulate:  # the gradients the captured backward adds into: the ones set aside, else zeros
                for p, g in zip(params, kept):
                    p.grad = g if g is not None else torch.zeros_like(p)
                before = [p.grad.data_ptr() for p in params]
            else:
                model.zero_grad(set_to_none=True)
            self.fwd, self.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(self.fwd, pool=pool), self.autocast():
                    self.loss = model(**self.static, **self.kwargs).loss
                with torch.cuda.graph(self.bwd, pool=self.fwd.pool()):
                    (self.loss * scale).backward()
            except RuntimeError as err:
                raise CaptureError(f"the training step could not be captured as a CUDA graph: "
                                   f"{str(err).splitlines()[0]}") from err
            if accumulate and [p.grad.data_ptr() for p in params] != before:
                raise CaptureError("the captured backward replaced parameter gradients instead of adding into them")
            # The replays need no autograd graph: without this the static loss would keep the captured one
            # alive, with its gradient-accumulation nodes bound to the capture stream, and an eager backward
            # (a batch of another shape) would then run those nodes across streams.
            self.loss = self.loss.detach()

    def _eager_step(self) -> None:
        with self.autocast():
            loss = self.model(**self.static, **self.kwargs).loss
        (loss * self.scale).backward()

    def fits(self, batch: dict) -> bool:
        """Whether ``batch`` has the static inputs' keys, shapes and dtypes."""
        return shape_key(batch) == shape_key(self.static)

    def forward(self, batch: dict | None = None) -> torch.Tensor:
        if batch is not None:
            for k, v in _tensors(batch).items():
                self.static[k].copy_(v, non_blocking=True)
        self.fwd.replay()
        return self.loss

    def backward(self) -> None:
        self.bwd.replay()

    def close(self) -> None:
        """Drop the graphs and their memory pool (the gradients stay where they are)."""
        self.fwd = self.bwd = self.loss = None
        self.static = {}


def replay_ms(model: torch.nn.Module, batch: dict, repeats: int, autocast: Callable = contextlib.nullcontext,
              skip: int = 0, call_kwargs: dict | None = None) -> tuple[float, float]:
    """Median forward and backward milliseconds (CUDA events) of ``repeats`` replays of the step on ``batch``
    (the model called with ``call_kwargs`` too), after ``skip`` untimed ones; the graphs are dropped and the
    gradients they wrote set to None."""
    step = StepGraphs(model, batch, autocast, accumulate=False, call_kwargs=call_kwargs)
    try:
        fwd, bwd = [], []
        for _ in range(skip + repeats):
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            e0.record()
            step.forward()
            e1.record()
            step.backward()
            e2.record()
            e2.synchronize()
            fwd.append(e0.elapsed_time(e1))
            bwd.append(e1.elapsed_time(e2))
        return statistics.median(fwd[skip:]), statistics.median(bwd[skip:])
    finally:
        step.close()
        model.zero_grad(set_to_none=True)
