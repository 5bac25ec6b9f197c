"""What the gradient-statistics collector (:mod:`sebp_probe.analysis.hooks`) hands back, and the host side of it.

The collector adds a window's statistics (a batch for ``analyze``, a training step's micro-batches for
``finetune --probe-every``) into per-layer int64 rows on the device. At the window's end they leave for the host
without a host sync (:class:`Snapshot`: non-blocking copies into pinned memory, a CUDA event after them); only
:meth:`Snapshot.wait`, where the numbers are read, waits for them. The per-batch bookkeeping of ``analyze``
(:func:`append_batch`, :class:`LayerStats`) runs on the host after that.

A row of a window's statistics (``_WIDTH`` int64 per layer, the layout of :mod:`sebp_kernels._triton.rowstats`
and of :func:`~sebp_probe.analysis.hooks.reduce_calls`): non-zero elements, non-finite rows, float32 bits of
the largest |g| (0 without a call), the fine-bucket histogram of the rows' max |g| (its bucket 0 counts the zero
rows), then one octave histogram of the rows' max |g| per row group.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .knee import N_FINE, N_OCTAVE, octave_histogram

_NONZERO, _NONFINITE_ROWS, _MAX_BITS = range(3)
_N_SCALARS = 3
# The row groups a batch can name (values 1, 2 of its int8 ``row_groups``; 0 is every other row).
ROW_GROUPS = ("padding", "label_less")
N_GROUPS = len(ROW_GROUPS)
_GROUPS_AT = _N_SCALARS + N_FINE
_WIDTH = _GROUPS_AT + N_GROUPS * N_OCTAVE


@dataclass
class LayerStats:
    """What the collector learned about one linear layer; per-batch lists hold one entry per batch.

    A batch in which the layer received no gradient has ``rows == 0``.
    """

    name: str
    in_features: int
    out_features: int
    rows: list[int] = field(default_factory=list)
    zero_rows: list[int] = field(default_factory=list)
    nonfinite_rows: list[int] = field(default_factory=list)
    elements: list[int] = field(default_factory=list)
    zero_elements: list[int] = field(default_factory=list)
    max_abs: list[float] = field(default_factory=list)
    row_octaves: list[np.ndarray] = field(default_factory=list)  # per batch, row max|g| per octave bucket
    group_octaves: list[np.ndarray] = field(default_factory=list)  # per batch, (N_GROUPS, N_OCTAVE): the same per group
    element_hist: np.ndarray = field(default_factory=lambda: np.zeros(N_FINE, dtype=np.int64))
    row_hist: np.ndarray = field(default_factory=lambda: np.zeros(N_FINE, dtype=np.int64))

    @property
    def seen(self) -> np.ndarray:
        """Mask of the batches in which this layer received a gradient."""
        return np.asarray(self.rows) > 0

    def zero_row_fraction(self) -> np.ndarray:
        """Per seen batch: share of rows of dL/dY that are exactly zero."""
        m = self.seen
        return np.asarray(self.zero_rows)[m] / np.asarray(self.rows)[m]

    def zero_element_fraction(self) -> np.ndarray:
        m = self.seen
        return np.asarray(self.zero_elements)[m] / np.asarray(self.elements)[m]

    def octaves(self) -> np.ndarray:
        """(batches, N_OCTAVE) row-max histograms of the seen batches."""
        rows = [o for o, s in zip(self.row_octaves, self.seen) if s]
        return np.stack(rows) if rows else np.zeros((0, N_OCTAVE), dtype=np.int64)

    def group_octaves_seen(self) -> np.ndarray:
        """(batches, N_GROUPS, N_OCTAVE) row-max histograms of each row group, seen batches."""
        rows = [o for o, s in zip(self.group_octaves, self.seen) if s]
        return np.stack(rows) if rows else np.zeros((0, N_GROUPS, N_OCTAVE), dtype=np.int64)


@dataclass
class GradientStats:
    """Everything a run of the collector gathered: per-layer statistics and the batches' token lengths."""

    layers: dict[str, LayerStats]
    lengths: list[np.ndarray] = field(default_factory=list)  # real tokens per sample, per batch
    padded_lengths: list[int] = field(default_factory=list)  # sequence length of each batch
    batches: int = 0


def merge(parts: list[np.ndarray], n_layers: int) -> np.ndarray:
    """Window statistics from several sources (devices, paths) in one array: sums, and the max of max bits."""
    if not parts:
        return np.zeros((n_layers, _WIDTH), dtype=np.int64)
    out = parts[0]
    for p in parts[1:]:
        top = np.maximum(out[:, _MAX_BITS], p[:, _MAX_BITS])
        out = out + p
        out[:, _MAX_BITS] = top
    return out


@dataclass
class Totals:
    """A window's statistics on the host: per layer its rows and elements (counted on the host as the hooks ran)
    and ``stats`` (layers, ``_WIDTH``); ``lengths``/``padded``: the batch's token lengths, when it gave a mask."""

    rows: list[int]
    elements: list[int]
    stats: np.ndarray
    lengths: np.ndarray | None = None
    padded: int | None = None


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` on its way to the host: into pinned memory without waiting on CUDA (torch's pinned
    allocator keeps the block until the copy is done), a plain copy elsewhere."""
    if not t.is_cuda:
        return t.detach().cpu().clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class Snapshot:
    """A window's statistics on their way to the host: the copies are queued, an event recorded after them on
    each CUDA device they come from; nothing waits until :meth:`wait`."""

    def __init__(self, parts: list[torch.Tensor], rows: list[int], elements: list[int], n_layers: int,
                 lengths: torch.Tensor | None = None, padded: int | None = None) -> None:
        self._host = [to_host(p) for p in parts]
        self._lengths = None if lengths is None else to_host(lengths)
        self._events = []
        for device in {t.device for t in parts + ([lengths] if lengths is not None else []) if t.is_cuda}:
            with torch.cuda.device(device):  # after the copies, on the stream they were queued on
                event = torch.cuda.Event()
                event.record()
                self._events.append(event)
        self._rows, self._elements, self._n, self._padded = rows, elements, n_layers, padded

    def ready(self) -> bool:
        """Have the copies arrived (without waiting)?"""
        return all(e.query() for e in self._events)

    def wait(self) -> Totals:
        """The statistics on the host, once the copies have arrived."""
        for e in self._events:
            e.synchronize()
        stats = merge([h.numpy() for h in self._host], self._n)
        lengths = None if self._lengths is None else self._lengths.numpy()
        return Totals(self._rows, self._elements, stats, lengths, self._padded)


def append_batch(layers: list[LayerStats], t: Totals, row_hist: np.ndarray) -> np.ndarray:
    """Add one batch's totals to each layer's per-batch lists; returns the new running row histogram
    (``row_hist + fine``: a new array per batch, so the ``row_hist`` a caller took earlier stays as it was)."""
    host, n = t.stats, len(layers)
    fine = host[:, _N_SCALARS:_GROUPS_AT]
    groups = host[:, _GROUPS_AT:].reshape(n, N_GROUPS, N_OCTAVE).astype(np.int32)
    zero_rows = fine[:, 0].tolist()
    nonfinite = host[:, _NONFINITE_ROWS].tolist()
    zero_elements = (np.asarray(t.elements, dtype=np.int64) - host[:, _NONZERO]).tolist()
    max_abs = host[:, _MAX_BITS].astype(np.int32).view(np.float32).tolist()  # bits in [0, 2**31)
    octaves = octave_histogram(fine).astype(np.int32)
    row_hist = row_hist + fine
    for i, layer in enumerate(layers):
        layer.rows.append(t.rows[i])
        layer.elements.append(t.elements[i])
        layer.zero_rows.append(zero_rows[i])
        layer.nonfinite_rows.append(nonfinite[i])
        layer.zero_elements.append(zero_elements[i])
        layer.max_abs.append(max_abs[i])
        layer.row_octaves.append(octaves[i])
        layer.group_octaves.append(groups[i])
        layer.row_hist = row_hist[i]
    return row_hist
