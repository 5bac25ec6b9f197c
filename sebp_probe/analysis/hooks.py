"""Per-layer statistics of dL/dY, reduced on the device, read without a host sync.

A forward hook on every target linear asks its output for its gradient, one of two ways:

* retained (most outputs): the output keeps its gradient (``retain_grad``, autograd's own C++ hook, which stores
  a copy), and the collector reads the kept gradients when the block's backward is done: no Python runs in the
  backward, where each call costs a host tens of microseconds. Within a budget per block (``RETAIN_SHARE`` of
  the device's memory), since the outputs and the copies stay alive until the block ends. A layer whose output
  is changed in place after it (its version moved) kept the gradient of the changed tensor, not its dL/dY: that
  block leaves the layer out, with a warning, and later blocks hook it. A block that runs two backwards through
  one forward (two losses) counts a retained layer's summed gradient once, where a hook counts each.
* hooked (outputs past the budget): a tensor hook on the output hands dL/dY over in the backward, uncopied.

A collector made with ``graph=True`` (a compiled run's) puts neither on: taps in the linears themselves hand
dL/dY over from inside compiled graphs (:mod:`.graph_tap`), each read at once into the buffer below; a tapped
layer that runs eagerly calls the forward hook itself.

Either way the gradient (flattened to rows x features) then takes one of two paths, which give the same
numbers:

* Triton (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``): the collector holds the layer's dL/dY, and one
  kernel (:mod:`sebp_kernels._triton.rowstats`) reads the held ones at a time (up to ``HOLD_GRADS`` tensors or
  ``HOLD_BYTES``, and whatever is held when the block ends), adding each layer's counts, largest bit pattern
  and both histograms into a per-collector int64 buffer, preallocated once per device; a window (a batch, or
  a training step's micro-batches) ends with one device->host copy of it that nothing waits for
  (:class:`~sebp_probe.analysis.grad_records.Snapshot`); the host reads it later. The backward then costs a
  few launches, the window a few operations and no host sync: the steps of small models are bound by host
  time, and a launch from inside the backward costs a host tens of microseconds, so this is what keeps the
  collector cheap. A gradient the batched kernel cannot read with wide loads (unaligned, or a width or row
  stride not a multiple of 16) gets a launch of its own. A held gradient is read after later backward
  operations: autograd then adds into it out of place (it accumulates in place only into a gradient nothing
  else holds), but a backward that overwrites its incoming gradient (Liger's RMSNorm does, to save memory)
  would be read after its write where that incoming gradient is a target linear's output gradient. In Llama-
  and BERT-style blocks a norm's incoming gradient is a sum (of the next linears' input gradients, and of the
  residual's after a post-norm), never one linear's output gradient.
* torch (everything else, e.g. plain CPU runs): the collector keeps each row's max |g|, its count of non-zeros
  and a small sample (:func:`summarize_grad`); once per batch these are bucketed for all layers together
  (:func:`reduce_calls`, a few kernels whatever the number of layers) and travel in one transfer. Both
  paths' reductions live in :mod:`sebp_probe.analysis.grad_reduce`.

The hooks' Python is kept to a few attribute reads and an append per call: everything per model (targets,
names, buffers, the hook callables) is made once per collector, which can be entered again and again.

Magnitudes are bucketed by their float32 bit pattern (see :mod:`sebp_probe.analysis.knee`): an integer shift, no
logarithm, and every bucket edge is an exact float32, so row counts above a threshold at an edge are exact.
bfloat16 gradients map onto the same buckets without conversion; float16 and float64 are bucketed as
float32 (float64 magnitudes below ~1e-45 then count as zero, in the histograms and in the zero-row counts).
Every NaN is bucketed as the canonical quiet NaN (float32 bits ``0x7FC00000``): payloads carry no meaning
and torch's own reductions do not preserve them consistently.
The per-row statistics are exact; the histogram of single elements is taken on a strided sample of rows
when a gradient holds more than ``ELEMENT_SAMPLE`` values (see :func:`reduce_grad`).

Told which rows of a batch are padding and which are label-less (``row_groups``, one int8 per token, see
:mod:`sebp_probe.analysis.causes`), the collector also keeps, per layer and batch, the octave histogram of the row max
of each group, in the same reduction; it applies the groups to every hook call with one row per token.

Usage::

    with GradientStatsCollector(model) as collector:
        for batch in loader:
            with collector.batch(batch["attention_mask"]):
                model(**batch).loss.backward()
    stats = collector.stats()
"""
from __future__ import annotations

import contextlib
import warnings
from collections import deque
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
from torch import nn

from . import grad_reduce
from .grad_records import (_GROUPS_AT, _WIDTH, N_GROUPS, ROW_GROUPS, GradientStats, LayerStats, Snapshot, Totals,
                           append_batch)
from .grad_reduce import GradCall, bucket_counts, reduce_calls, reduce_grad, summarize_grad
from .graph_tap import GraphTaps
from .knee import FINE_SHIFT, N_FINE, OCTAVE_SHIFT
from ..model.linears import features
from ..model.patch import _logical_name, find_targets

__all__ = ["N_GROUPS", "ROW_GROUPS", "GradCall", "GradientStats", "GradientStatsCollector",
           "LayerStats", "Totals", "bucket_counts", "reduce_calls", "reduce_grad", "summarize_grad"]

# A layer's gradient waits in :class:`_DeviceBuffers` until this many have come, or this many bytes: then one
# launch reads them all. The bytes bound what a probed backward keeps alive beyond its own (dL/dY tensors it
# would otherwise have freed one layer earlier).
HOLD_GRADS, HOLD_BYTES = 32, 128 << 20

# Most gradients of a window are read without a Python call in the backward: the layer's output retains its
# gradient (autograd's own C++ hook, which keeps a copy of it), and the collector reads it when the block's backward
# is done. Every Python hook in a backward costs the host tens of microseconds (a no-op hook on each of BERT-base's
# 72 linears made a host-bound step 9% slower on an H100 host), which is what bounds a small model's probed step.
# Retained outputs and their gradients' copies stay alive until the block ends, so a block retains at most this
# share of the device's memory (an output counted twice: itself and the copy; 256 MiB on the CPU); outputs past
# it get a hook, as does a layer whose output was seen changed in place (its retained gradient is not dL/dY).
RETAIN_SHARE, RETAIN_CPU_BYTES = 0.02, 256 << 20


class _DeviceBuffers:
    """Where the row-statistics kernel accumulates a window, on one device (allocated once per collector).

    One int64 allocation holds ``stats`` (layers, _WIDTH; the layout of :func:`reduce_calls`) and
    ``sample`` (layers, N_FINE, this window's element histogram), so discarding a window is one memset;
    ``element_acc`` sums the element histograms of the kept windows. :meth:`add` holds gradients and launches
    one kernel for up to ``HOLD_GRADS`` of them (``HOLD_BYTES``); :meth:`flush` launches for those held.
    """

    def __init__(self, n_layers: int, device: torch.device, kernel) -> None:
        self._flat = torch.zeros(n_layers * (_WIDTH + N_FINE), dtype=torch.int64, device=device)
        self.stats = self._flat[: n_layers * _WIDTH].view(n_layers, _WIDTH)
        self.groups = self.stats[:, _GROUPS_AT:]  # the kernel's group histograms: in ``stats``, one transfer
        self.sample = self._flat[n_layers * _WIDTH:].view(n_layers, N_FINE)
        self.element_acc = torch.zeros(n_layers, N_FINE, dtype=torch.int64, device=device)
        self._kernel = kernel
        self._held: list[tuple[torch.Tensor, int, int, bool]] = []  # (grad2d, slot, row_step, grouped)
        self._held_bytes = 0
        self._row_groups: torch.Tensor | None = None  # the held gradients' row groups (one window's)
        if kernel is not None:  # (None: a compiled graph's buffer where the torch path adds, see views)
            buffers = dict(stats=self.stats, sample_hist=self.sample, shift=FINE_SHIFT, group_hist=self.groups,
                           group_shift=OCTAVE_SHIFT)
            self._one = partial(kernel.row_stats_, n_groups=N_GROUPS, **buffers)  # (grad2d, slot, row_step, groups)
            self._many = partial(kernel.row_stats_many_, n_groups=N_GROUPS, **buffers)  # (held, groups)

    def views(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(stats, sample, group histograms) of ``flat``, this buffer as a compiled graph hands it over (itself,
        or where the graph did not write in place, its copy)."""
        if flat is self._flat:
            return self.stats, self.sample, self.groups
        n = self.stats.shape[0]
        stats = flat[: n * _WIDTH].view(n, _WIDTH)
        return stats, flat[n * _WIDTH:].view(n, N_FINE), stats[:, _GROUPS_AT:]

    def add(self, grad2d: torch.Tensor, slot: int, row_step: int, groups: torch.Tensor | None) -> None:
        """Add one gradient's statistics to row ``slot`` (queued; no host sync)."""
        if not self._kernel.batchable(grad2d):
            self._one(grad2d, slot=slot, row_step=row_step, groups=groups)
            return
        if groups is not None and groups is not self._row_groups:
            self.flush()
            self._row_groups = groups
        self._held.append((grad2d, slot, row_step, groups is not None))
        self._held_bytes += grad2d.numel() * grad2d.element_size()
        if len(self._held) >= HOLD_GRADS or self._held_bytes >= HOLD_BYTES:
            self.flush()

    def flush(self) -> None:
        """Launch the kernel for the gradients held (queued; no host sync)."""
        if self._held:
            self._many(self._held, groups=self._row_groups)
        self._held, self._held_bytes = [], 0

    def fold_sample(self) -> None:
        """Add this window's element histogram to ``element_acc`` (queued, no sync)."""
        self.flush()
        self.element_acc += self.sample

    def discard(self) -> None:
        """Start over (after the window's ``stats`` were copied, or to drop them)."""
        self._held, self._held_bytes, self._row_groups = [], 0, None
        self._flat.zero_()


def _hook_ids(hooks: list[tuple[nn.Module, Callable]]) -> list[int]:
    """An id of torch's forward hooks for each (module, hook), never given to another hook.

    A probed step puts its hooks into the modules' hook dicts under these ids and takes them out after it, as
    ``register_forward_hook`` and the handle's ``remove`` would, without making a handle per layer and step:
    on this project's CPU, a 12-layer BERT's probed step cost the host 25 us a layer with the handles, 20 without
    (kernels left out)."""
    ids = []
    for m, hook in hooks:
        handle = m.register_forward_hook(hook)
        ids.append(handle.id)
        handle.remove()
    return ids


class GradientStatsCollector:
    """Context manager that gathers dL/dY statistics of target linears, window by window.

    Targets are found with :func:`sebp_probe.model.patch.find_targets` (same names as patching; default: the
    attention and MLP projections), so it works on plain and SEBP-patched models alike. Layer names are the
    logical ones (a peft ``...q_proj.base_layer`` is reported as ``...q_proj``). Everything per model (targets,
    buffers, hooks) is made once; entering the ``with`` block puts the forward hooks on, leaving it takes them
    off (also on error), and a collector can be entered again, as ``finetune --probe-every`` does each probed step.

    ``graph``: for a model that runs compiled, the statistics come from inside its graphs (:mod:`.graph_tap`;
    the linears get classes of their own until :meth:`close`). ``retain_bytes``: a block's budget of retained
    outputs (None: ``RETAIN_SHARE`` of the device's memory; 0: a hook on every output).

    Two ways to use it: :meth:`batch` keeps a record per batch (``analyze``; :meth:`stats`); :meth:`accumulate`
    adds the statistics of the block to the open window until :meth:`snapshot` sends them to the host
    (``finetune --probe-every``: a step's micro-batches, one transfer).
    """

    def __init__(self, model: nn.Module, target_modules=None, exclude_modules=None, retain_bytes: int | None = None,
                 graph: bool = False):
        self.model = model
        real = find_targets(model, target_modules, exclude_modules)
        if not real:
            raise ValueError("no linear layer to collect statistics from (check the target/exclude patterns)")
        # a peft layer's wrapper, not its base layer: the wrapper's output (base + adapter) has the same dL/dY,
        # and has one where the base layer's output, frozen on frozen inputs (a first layer), has none
        self._modules = {_logical_name(n): model.get_submodule(_logical_name(n)) for n in real}
        self.names = list(self._modules)
        self._layers = {n: LayerStats(n, *features(m)) for n, m in self._modules.items()}
        self._calls: list[tuple[int, GradCall]] = []  # torch-path calls of the open window
        self._pending: list[tuple[int, GradCall]] | None = None  # ``_calls`` while a block runs, else None
        self._element_acc: torch.Tensor | None = None  # (layers, N_FINE) on the device, torch path
        self._buffers: dict[torch.device, _DeviceBuffers] = {}  # Triton path
        self._route: dict = {}  # (device index, dtype) -> _DeviceBuffers, or None for the torch path
        n = len(self.names)
        self._rows, self._elements = [0] * n, [0] * n  # of the open window, per layer
        self._row_hist = np.zeros((n, N_FINE), dtype=np.int64)  # LayerStats.row_hist are rows of this
        self._lengths: list[np.ndarray] = []
        self._padded: list[int] = []
        self._batches = 0
        self._queue: deque[Snapshot] = deque()  # batches on their way to the host, oldest first
        self._groups: torch.Tensor | None = None  # the open window's row groups
        self._groups_on: dict[torch.device, torch.Tensor] = {}  # ... copied to other devices
        self._retain_bytes = retain_bytes  # None: RETAIN_SHARE of the device's memory; 0: a hook on every output
        self._retain_left: int | None = None  # of the open block's budget (None: not set yet)
        self._retained: list[tuple[int, torch.Tensor, int]] = []  # (layer, output, its version when retained)
        self._hooked: set[int] = set()  # layers whose output was changed in place: always a hook
        # made once: the hooks run every step
        self._grad_hooks = [partial(self._on_grad, i) for i in range(n)]
        self._forward_hooks = [(m, partial(self._on_forward, i)) for i, m in enumerate(self._modules.values())]
        self._hook_ids = _hook_ids(self._forward_hooks)
        self._entered = False
        self._taps = None if not graph else GraphTaps(
            self, list(self._modules.values()), lambda d: self._device_buffers(d, grad_reduce.kernel_on(d))._flat,
            lambda i: self._forward_hooks[i][1])

    def __enter__(self) -> "GradientStatsCollector":
        if self._taps is not None:
            self._taps.state.on = True
        else:  # what register_forward_hook does, without a new handle per hook and step
            for (m, hook), hook_id in zip(self._forward_hooks, self._hook_ids):
                m._forward_hooks[hook_id] = hook
        self._entered = True
        return self

    def __exit__(self, *exc) -> None:
        if self._taps is not None:
            self._taps.state.on = False
        elif self._entered:  # the forward hooks are in the modules' hook dicts
            for (m, _), hook_id in zip(self._forward_hooks, self._hook_ids):
                m._forward_hooks.pop(hook_id, None)
        self._entered = False
        self._pending = None

    def close(self) -> None:
        """Give the model back as it came (with ``graph``: the taps off its linears)."""
        if self._taps is not None:
            self._taps.remove()
            self._taps = None

    def _on_forward(self, index: int, module, args, output) -> None:
        if self._pending is None or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        size = 2 * output.numel() * output.element_size()
        if self._retain_left is None:
            self._retain_left = self._budget(output.device)
        if (size <= self._retain_left and output.grad_fn is not None and not output.retains_grad
                and index not in self._hooked):
            self._retain_left -= size
            output.retain_grad()
            self._retained.append((index, output, output._version))
        else:
            output.register_hook(self._grad_hooks[index])

    def _budget(self, device: torch.device) -> int:
        """Bytes a block may retain on ``device`` (see ``RETAIN_SHARE``)."""
        if self._retain_bytes is not None:
            return self._retain_bytes
        if device.type == "cuda":
            return int(RETAIN_SHARE * torch.cuda.get_device_properties(device).total_memory)
        return RETAIN_CPU_BYTES

    def _read_retained(self) -> None:
        """Hand the gradients the block's outputs retained to :meth:`_on_grad`, and let the outputs go."""
        retained, self._retained, self._retain_left = self._retained, [], None
        for index, output, version in retained:
            grad = output.grad
            if grad is None:  # no backward reached it
                continue
            output.grad = None
            if output._version != version:
                self._hooked.add(index)
                warnings.warn(f"{self.names[index]}: its output was changed in place after the layer, so the "
                              "gradient it kept is not the layer's dL/dY: this window leaves the layer out, later "
                              "ones read it through a hook", RuntimeWarning, stacklevel=2)
                continue
            self._on_grad(index, grad)

    def _counted(self, index: int, grad: torch.Tensor):
        """(``grad`` as rows x features, its row groups or None), counted in the open window; (None, None)
        outside a block or for an empty gradient."""
        if self._pending is None:
            return None, None
        g = grad_reduce.rows_view(grad)
        rows, cols = g.shape
        if not rows or not cols:
            return None, None
        self._rows[index] += rows
        self._elements[index] += rows * cols
        groups = self._groups
        if groups is not None:
            if groups.get_device() != g.get_device():
                groups = self._groups_for(g)
            if groups.shape[0] != rows:  # a pooler's or classifier's rows are sequences: no groups
                groups = None
        return g, groups

    def _on_grad(self, index: int, grad: torch.Tensor) -> None:
        g, groups = self._counted(index, grad)
        if g is None:
            return
        key = (g.get_device(), g.dtype)
        buffers = self._route[key] if key in self._route else self._add_route(key, g)
        if buffers is None:
            self._pending.append((index, summarize_grad(g, groups)))
        else:
            buffers.add(g, index, grad_reduce.sample_step(g), groups)

    def graph_grad(self, index: int, grad: torch.Tensor, flat: torch.Tensor) -> None:
        """dL/dY of layer ``index`` from a compiled graph (:mod:`.graph_tap`), added at once into ``flat``, the
        buffer of its device as the graph hands it over: the graph may reuse the gradient's memory as soon as
        this returns, so nothing is held."""
        g, groups = self._counted(index, grad)
        if g is None:
            return
        stats, sample, group_hist = self._buffers[g.device].views(flat)
        kernel = grad_reduce.kernel_for(g)
        if kernel is None:
            batch, element_hist = reduce_calls([summarize_grad(g, groups)], [index], len(self.names))
            stats += batch
            sample += element_hist
        else:
            kernel.row_stats_(g, stats, sample, index, grad_reduce.sample_step(g), FINE_SHIFT, groups, group_hist,
                              N_GROUPS, OCTAVE_SHIFT)

    def _groups_for(self, grad2d: torch.Tensor) -> torch.Tensor:
        """The window's row groups on the gradient's device (copied there once)."""
        groups = self._groups_on.get(grad2d.device)
        if groups is None:
            groups = self._groups_on[grad2d.device] = self._groups.to(grad2d.device, non_blocking=True)
        return groups

    def _add_route(self, key, grad2d: torch.Tensor) -> _DeviceBuffers | None:
        kernel = grad_reduce.kernel_for(grad2d)
        buffers = None if kernel is None else self._device_buffers(grad2d.device, kernel)
        self._route[key] = buffers
        return buffers

    def _device_buffers(self, device: torch.device, kernel) -> _DeviceBuffers:
        """The buffers of ``device`` (made on first use)."""
        buffers = self._buffers.get(device)
        if buffers is None:
            buffers = self._buffers[device] = _DeviceBuffers(len(self.names), device, kernel)
        return buffers

    @contextlib.contextmanager
    def accumulate(self, row_groups: torch.Tensor | None = None):
        """Add the statistics of the forward + backward run inside the block to the open window (no record,
        no transfer). ``row_groups`` (int8, one per token, flattened as the rows of dL/dY: 1 padding,
        2 label-less, 0 other) splits each layer's rows by group. If the block raises, the whole window is
        discarded."""
        if not self._entered:
            raise RuntimeError("use the collector inside its `with` block")
        if self._pending is not None:
            raise RuntimeError("batches cannot nest")
        self._pending = self._calls
        self._groups = None if row_groups is None else row_groups.reshape(-1).to(torch.int8)
        try:
            yield self
            self._read_retained()
            for buffers in self._buffers.values():  # the gradients held: launched while their groups are known
                buffers.flush()
        except BaseException:
            self.discard()
            raise
        finally:
            self._pending = None
            self._groups, self._groups_on = None, {}

    def discard(self) -> None:
        """Drop the open window's statistics (nothing was sent)."""
        for buffers in self._buffers.values():
            buffers.discard()
        self._calls, self._retained, self._retain_left = [], [], None
        n = len(self.names)
        self._rows, self._elements = [0] * n, [0] * n

    def snapshot(self, attention_mask: torch.Tensor | None = None) -> Snapshot:
        """Send the open window's statistics to the host (queued copies, no host sync) and start a new one."""
        n = len(self.names)
        parts = [buffers.stats for buffers in self._buffers.values()]  # one transfer per device
        for buffers in self._buffers.values():
            buffers.fold_sample()
        calls = self._calls
        if calls:
            batch, element_hist = reduce_calls([c for _, c in calls], [i for i, _ in calls], n)
            self._element_acc = element_hist if self._element_acc is None else self._element_acc + element_hist
            parts.append(batch)
        lengths = padded = None
        if attention_mask is not None:
            mask = attention_mask.reshape(attention_mask.shape[0], -1)
            lengths, padded = mask.sum(dim=1), int(mask.shape[1])
        snap = Snapshot(parts, self._rows, self._elements, n, lengths, padded)  # the copies are queued first
        self.discard()
        return snap

    @contextlib.contextmanager
    def batch(self, attention_mask: torch.Tensor | None = None, row_groups: torch.Tensor | None = None):
        """Collect the forward + backward run inside the block as one batch (a record of its own, see
        :meth:`accumulate`); ``attention_mask`` (batch x seq, 1 on real tokens) gives the token lengths for the
        padding statistics. The batch's numbers reach the host without a host sync: they are read at the start
        of a later batch (once arrived) or by :meth:`stats`."""
        self._drain(keep=1)
        with self.accumulate(row_groups):
            yield self
        self._queue.append(self.snapshot(attention_mask))

    def _drain(self, keep: int = 0) -> None:
        """Record the queued batches that have reached the host, waiting on the oldest while more than ``keep``
        are on their way."""
        while self._queue and (len(self._queue) > keep or self._queue[0].ready()):
            t = self._queue.popleft().wait()
            self._row_hist = append_batch(list(self._layers.values()), t, self._row_hist)
            if t.lengths is not None:
                self._lengths.append(t.lengths)
                self._padded.append(t.padded)
            self._batches += 1

    def stats(self) -> GradientStats:
        """The statistics gathered so far (histograms copied to the host)."""
        self._drain()
        accs = [b.element_acc for b in self._buffers.values()]
        accs += [self._element_acc] if self._element_acc is not None else []
        if accs:
            acc = sum(a.cpu().numpy().astype(np.int64) for a in accs)
            for i, layer in enumerate(self._layers.values()):
                layer.element_hist = acc[i]
        return GradientStats(layers=dict(self._layers), lengths=list(self._lengths),
                             padded_lengths=list(self._padded), batches=self._batches)
