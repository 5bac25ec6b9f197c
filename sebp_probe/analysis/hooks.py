"""Per-layer statistics of dL/dY, reduced on the device while the backward pass runs.

A forward hook on every target linear puts a tensor hook on its output; in the backward that hook reduces
dL/dY (flattened to rows x features) on the device and never copies the gradient itself. Two paths give
the same numbers:

* Triton (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``): the hook holds the layer's dL/dY, and one
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
* torch (everything else, e.g. plain CPU runs): the hook keeps each row's max |g|, its count of non-zeros
  and a small sample (:func:`summarize_grad`); once per batch these are bucketed for all layers together
  (:func:`reduce_calls`, a few kernels whatever the number of layers) and travel in one transfer.

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
import functools
import warnings
from collections import deque
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch import nn

from sebp_kernels.interpret import INTERPRET

from .grad_records import (_GROUPS_AT, _MAX_BITS, _N_SCALARS, _NONFINITE_ROWS, _NONZERO, _WIDTH, N_GROUPS,
                           ROW_GROUPS, GradientStats, LayerStats, Snapshot, Totals, append_batch)
from .knee import _INF_BITS, _NAN_BITS, FINE_SHIFT, N_FINE, N_OCTAVE, OCTAVE_SHIFT
from ..model.linears import features
from ..model.patch import _logical_name, find_targets

__all__ = ["ELEMENT_SAMPLE", "N_GROUPS", "ROW_GROUPS", "GradCall", "GradientStats", "GradientStatsCollector",
           "LayerStats", "Totals", "bucket_counts", "reduce_calls", "reduce_grad", "summarize_grad"]

_ABS_MASK = 0x7FFFFFFF


_HISTC_CHUNK = 1 << 24  # float32 counts are exact up to 2**24


def bucket_counts(ids: torch.Tensor, n: int, sync_free: bool | None = None) -> torch.Tensor:
    """int64 counts of the integers ``ids`` (all in [0, n)) per value.

    On CUDA ``torch.bincount`` reads ``ids.max()`` back to the host, a sync per call; ``torch.histc`` with a
    fixed range does not, so the GPU path (``sync_free``, default: on CUDA) uses it on bucket centres, in
    chunks small enough for its float32 counts to stay exact.
    """
    flat = ids.reshape(-1)
    if not (flat.is_cuda if sync_free is None else sync_free):
        return torch.bincount(flat, minlength=n)
    out = torch.zeros(n, dtype=torch.int64, device=flat.device)
    for chunk in flat.split(_HISTC_CHUNK):
        out += torch.histc(chunk.float().add_(0.5), bins=n, min=0, max=n).to(torch.int64)
    return out


ELEMENT_SAMPLE = 1 << 14  # the element histogram reads at most about this many values per call


def _abs_bits(x: torch.Tensor) -> torch.Tensor:
    """float32 bit patterns of |x| as int32, NaN as ``_NAN_BITS`` (bfloat16 is the top half of a float32:
    no conversion)."""
    if x.dtype == torch.bfloat16:
        bits = (x.view(torch.int16).to(torch.int32) << 16) & _ABS_MASK
    else:
        bits = (x if x.dtype == torch.float32 else x.float()).view(torch.int32) & _ABS_MASK
    return bits.masked_fill_(bits > _INF_BITS, _NAN_BITS)


def _buckets(bits: torch.Tensor) -> torch.Tensor:
    """Fine bucket of each bit pattern: ceil(bits / 2**20), so bucket j holds ((j-1) << 20, j << 20]."""
    return (bits.to(torch.int64) + ((1 << FINE_SHIFT) - 1)) >> FINE_SHIFT


@dataclass
class GradCall:
    """What the backward hook keeps of one dL/dY until the end of the batch (all small)."""

    rows: int
    elements: int
    row_max: torch.Tensor  # (rows,) max |g| of each row, on the device
    nonzero: torch.Tensor  # (rows,) count of non-zero elements of each row, on the device
    sample: torch.Tensor  # a copy of every ``step``-th row (all rows when small), for the element histogram
    groups: torch.Tensor | None = None  # (rows,) int8 row group of each row, when the batch named them


def summarize_grad(grad: torch.Tensor, groups: torch.Tensor | None = None) -> GradCall:
    """The per-call work of the hook: two row reductions over dL/dY and a small copy; no host sync.

    Everything else (bucketing, histograms) happens once per batch for all layers together in
    :func:`reduce_calls`, so the hook launches only a handful of kernels.
    """
    g = grad.detach()
    g2 = g.reshape(-1, g.shape[-1]) if g.dim() != 2 else g
    rows, cols = g2.shape
    if g2.is_cuda:  # fused reductions, no full-size temporary (count_nonzero would make an int64 copy)
        row_max = torch.linalg.vector_norm(g2, ord=float("inf"), dim=1)  # max |g| per row, NaN kept
        nonzero = torch.linalg.vector_norm(g2, ord=0, dim=1, dtype=torch.float32)  # exact: <= cols
    else:  # on the CPU these are ~10x faster than the norms
        row_max = g2.abs().amax(dim=1)
        nonzero = (g2 != 0).sum(dim=1)
    return GradCall(rows, rows * cols, row_max, nonzero, g2[::_sample_step(g2)].clone(), groups)


def _sample_step(grad2d: torch.Tensor) -> int:
    """Every how many rows the element histogram reads one (both paths)."""
    return max(1, -(-grad2d.numel() // ELEMENT_SAMPLE))


@functools.lru_cache(maxsize=None)
def _rowstats():
    """The Triton row-statistics module, imported on first use; None when triton cannot be used here."""
    try:
        from sebp_kernels._triton import rowstats
    except Exception as exc:  # no triton, or one that fails to initialise: the torch path still works
        if torch.cuda.is_available() or INTERPRET:
            warnings.warn(f"Triton row statistics unavailable ({exc!r}); the collector uses torch ops",
                          RuntimeWarning, stacklevel=3)
        return None
    assert (rowstats.NONZERO, rowstats.NONFINITE_ROWS, rowstats.MAX_BITS, rowstats.N_SCALARS) == \
        (_NONZERO, _NONFINITE_ROWS, _MAX_BITS, _N_SCALARS)
    return rowstats


def _kernel_for(grad2d: torch.Tensor):
    """The rowstats module when its kernel handles this 2-D gradient, else None (torch path)."""
    if not (grad2d.is_cuda or INTERPRET):
        return None
    mod = _rowstats()
    return mod if mod is not None and mod.supported(grad2d) else None


def _per_layer(layer: torch.Tensor, counts: list[int], total: int) -> torch.Tensor:
    """The layer index of every row: layer[i] repeated counts[i] times (output size given: no sync)."""
    return torch.repeat_interleave(layer, torch.tensor(counts, device=layer.device), output_size=total)


def _group_hist(calls: list[GradCall], row_layer: torch.Tensor, rbits: torch.Tensor, n_layers: int) -> torch.Tensor:
    """(L, N_GROUPS * N_OCTAVE) octave histograms of the rows' max |g| per layer and row group."""
    size = n_layers * N_GROUPS * N_OCTAVE
    if all(c.groups is None for c in calls):
        return torch.zeros(n_layers, N_GROUPS * N_OCTAVE, dtype=torch.int64, device=rbits.device)
    group = torch.cat([c.groups if c.groups is not None else
                       torch.zeros(c.rows, dtype=torch.int8, device=rbits.device) for c in calls]).to(torch.int64)
    octave = (rbits.to(torch.int64) + ((1 << OCTAVE_SHIFT) - 1)) >> OCTAVE_SHIFT
    ids = torch.where(group > 0, row_layer * (N_GROUPS * N_OCTAVE) + (group - 1) * N_OCTAVE + octave, size)
    return bucket_counts(ids, size + 1)[:size].view(n_layers, N_GROUPS * N_OCTAVE)  # the last bin: no group


def reduce_calls(calls: list[GradCall], layer_of_call: list[int], n_layers: int):
    """Per-layer statistics of a batch's calls, on the device: (batch (L, _WIDTH), element hist
    (L, N_FINE)), int64.

    A row of ``batch``: non-zero elements, non-finite rows, float32 bits of the largest |g| (0: no call),
    then the histogram of the rows' max |g| (bucket 0: zero rows), then that of each row group in octave
    buckets (zeros where the calls named no groups). The row statistics are exact; the
    element histogram counts every value of a gradient of at most ``ELEMENT_SAMPLE`` values and otherwise
    an evenly strided sample of its rows (it only draws the CDF of |g|; every decision uses the exact row
    statistics).
    """
    device = calls[0].row_max.device
    layer = torch.tensor(layer_of_call, device=device)
    rows = [c.rows for c in calls]
    row_layer = _per_layer(layer, rows, sum(rows))
    rbits = _abs_bits(torch.cat([c.row_max.reshape(-1) for c in calls]))
    row_hist = bucket_counts(row_layer * N_FINE + _buckets(rbits), n_layers * N_FINE).view(n_layers, N_FINE)
    nonfinite = bucket_counts(row_layer * 2 + (rbits >= _INF_BITS), n_layers * 2).view(n_layers, 2)[:, 1]
    max_bits = torch.zeros(n_layers, dtype=torch.int64, device=device)
    max_bits.scatter_reduce_(0, row_layer, rbits.to(torch.int64), "amax")
    nonzero = torch.zeros(n_layers, dtype=torch.int64, device=device)
    nonzero.index_add_(0, row_layer, torch.cat([c.nonzero for c in calls]).to(torch.int64))
    samples = [c.sample.reshape(-1) for c in calls]
    sizes = [s.numel() for s in samples]
    sample_layer = _per_layer(layer, sizes, sum(sizes))
    ebits = _abs_bits(torch.cat(samples))
    element_hist = bucket_counts(sample_layer * N_FINE + _buckets(ebits), n_layers * N_FINE).view(n_layers, N_FINE)
    scalars = torch.stack([nonzero, nonfinite, max_bits], dim=1)
    return torch.cat([scalars, row_hist, _group_hist(calls, row_layer, rbits, n_layers)], dim=1), element_hist


def _rows_view(grad: torch.Tensor) -> torch.Tensor:
    return grad if grad.dim() == 2 else grad.reshape(-1, grad.shape[-1])


def reduce_grad(grad: torch.Tensor) -> tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """All statistics of one dL/dY: (rows, elements, scalars, element histogram, row-max histogram), with
    scalars = [zero rows, non-finite rows, zero elements, float32 bits of the largest |g|]. Takes the path
    the collector would take for this tensor (Triton or torch)."""
    g2 = _rows_view(grad.detach())
    rows, elements = g2.shape[0], g2.numel()
    kernel = _kernel_for(g2)
    if kernel is None:
        batch, element_hist = reduce_calls([summarize_grad(g2)], [0], 1)
    else:
        batch = torch.zeros(1, _WIDTH, dtype=torch.int64, device=g2.device)
        element_hist = torch.zeros(1, N_FINE, dtype=torch.int64, device=g2.device)
        kernel.row_stats_(g2, batch, element_hist, 0, _sample_step(g2), FINE_SHIFT)
    b = batch[0]
    scalars = torch.stack([b[_N_SCALARS], b[_NONFINITE_ROWS], elements - b[_NONZERO], b[_MAX_BITS]])
    return rows, elements, scalars, element_hist[0], b[_N_SCALARS:_GROUPS_AT]


# A layer's gradient waits in :class:`_DeviceBuffers` until this many have come, or this many bytes: then one
# launch reads them all. The bytes bound what a probed backward keeps alive beyond its own (dL/dY tensors it
# would otherwise have freed one layer earlier).
HOLD_GRADS, HOLD_BYTES = 32, 128 << 20


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
        buffers = dict(stats=self.stats, sample_hist=self.sample, shift=FINE_SHIFT, group_hist=self.groups,
                       group_shift=OCTAVE_SHIFT)
        self._one = partial(kernel.row_stats_, n_groups=N_GROUPS, **buffers)  # (grad2d, slot, row_step, groups)
        self._many = partial(kernel.row_stats_many_, n_groups=N_GROUPS, **buffers)  # (held, groups)

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


class GradientStatsCollector:
    """Context manager that gathers dL/dY statistics of target linears, window by window.

    Targets are found with :func:`sebp_probe.model.patch.find_targets` (same names as patching; default: the
    attention and MLP projections), so it works on plain and SEBP-patched models alike. Layer names are the
    logical ones (a peft ``...q_proj.base_layer`` is reported as ``...q_proj``). Everything per model (targets,
    buffers, hooks) is made once; entering the ``with`` block puts the forward hooks on, leaving it takes them
    off (also on error), and a collector can be entered again, as ``finetune --probe-every`` does each probed step.

    Two ways to use it: :meth:`batch` keeps a record per batch (``analyze``; :meth:`stats`); :meth:`accumulate`
    adds the statistics of the block to the open window until :meth:`snapshot` sends them to the host
    (``finetune --probe-every``: a step's micro-batches, one transfer).
    """

    def __init__(self, model: nn.Module, target_modules=None, exclude_modules=None):
        self.model = model
        real = find_targets(model, target_modules, exclude_modules)
        if not real:
            raise ValueError("no linear layer to collect statistics from (check the target/exclude patterns)")
        self._modules = {_logical_name(n): model.get_submodule(n) for n in real}
        self.names = list(self._modules)
        self._layers = {n: LayerStats(n, *features(m)) for n, m in self._modules.items()}
        self._handles: list = []
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
        # made once: the hooks run every step
        self._grad_hooks = [partial(self._on_grad, i) for i in range(n)]
        self._forward_hooks = [(m, partial(self._on_forward, i)) for i, m in enumerate(self._modules.values())]

    def __enter__(self) -> "GradientStatsCollector":
        self._handles = [m.register_forward_hook(hook) for m, hook in self._forward_hooks]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._pending = None

    def _on_forward(self, index: int, module, args, output) -> None:
        if self._pending is not None and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._grad_hooks[index])

    def _on_grad(self, index: int, grad: torch.Tensor) -> None:
        if self._pending is None:
            return
        g = grad if grad.dim() == 2 else grad.reshape(-1, grad.shape[-1])
        rows, cols = g.shape
        if not rows or not cols:
            return
        self._rows[index] += rows
        self._elements[index] += rows * cols
        key = (g.get_device(), g.dtype)
        buffers = self._route[key] if key in self._route else self._add_route(key, g)
        groups = self._groups
        if groups is not None:
            if groups.get_device() != g.get_device():
                groups = self._groups_for(g)
            if groups.shape[0] != rows:  # a pooler's or classifier's rows are sequences: no groups
                groups = None
        if buffers is None:
            self._pending.append((index, summarize_grad(g, groups)))
        else:
            buffers.add(g, index, max(1, -(-rows * cols // ELEMENT_SAMPLE)), groups)

    def _groups_for(self, grad2d: torch.Tensor) -> torch.Tensor:
        """The window's row groups on the gradient's device (copied there once)."""
        groups = self._groups_on.get(grad2d.device)
        if groups is None:
            groups = self._groups_on[grad2d.device] = self._groups.to(grad2d.device, non_blocking=True)
        return groups

    def _add_route(self, key, grad2d: torch.Tensor) -> _DeviceBuffers | None:
        kernel = _kernel_for(grad2d)
        buffers = None
        if kernel is not None:
            buffers = self._buffers.get(grad2d.device)
            if buffers is None:
                buffers = self._buffers[grad2d.device] = _DeviceBuffers(len(self.names), grad2d.device, kernel)
        self._route[key] = buffers
        return buffers

    @contextlib.contextmanager
    def accumulate(self, row_groups: torch.Tensor | None = None):
        """Add the statistics of the forward + backward run inside the block to the open window (no record,
        no transfer). ``row_groups`` (int8, one per token, flattened as the rows of dL/dY: 1 padding,
        2 label-less, 0 other) splits each layer's rows by group. If the block raises, the whole window is
        discarded."""
        if not self._handles:
            raise RuntimeError("use the collector inside its `with` block")
        if self._pending is not None:
            raise RuntimeError("batches cannot nest")
        self._pending = self._calls
        self._groups = None if row_groups is None else row_groups.reshape(-1).to(torch.int8)
        try:
            yield self
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
        self._calls = []
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
