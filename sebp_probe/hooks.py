"""Per-layer statistics of dL/dY, reduced on the device while the backward pass runs.

A forward hook on every target linear puts a tensor hook on its output; in the backward that hook reduces
dL/dY (flattened to rows x features) to a few counts and two histograms, on the device, and never copies
the gradient itself. Once per batch the small results travel to the host in one transfer.

Magnitudes are bucketed by their float32 bit pattern (see :mod:`sebp_probe.knee`): an integer shift, no
logarithm, and every bucket edge is an exact float32, so row counts above a threshold at an edge are exact.
bfloat16 gradients map onto the same buckets without conversion; float16 and float64 are bucketed as
float32 (float64 magnitudes below ~1e-45 then count as zero in the histograms, never in the zero counts).

Usage::

    with GradientStatsCollector(model) as collector:
        for batch in loader:
            with collector.batch(batch["attention_mask"]):
                model(**batch).loss.backward()
    stats = collector.stats()
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
from torch import nn

from .knee import FINE_SHIFT, N_FINE, N_OCTAVE
from .patch import _logical_name, find_targets

_ABS_MASK = 0x7FFFFFFF
_INF_BITS = 0x7F800000
# layout of the per-call device vector
_ZERO_ROWS, _NONFINITE_ROWS, _ZERO_ELEMS, _MAX_BITS = range(4)
_N_SCALARS = 4


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


@dataclass
class GradientStats:
    """Everything a run of the collector gathered: per-layer statistics and the batches' token lengths."""

    layers: dict[str, LayerStats]
    lengths: list[np.ndarray] = field(default_factory=list)  # real tokens per sample, per batch
    padded_lengths: list[int] = field(default_factory=list)  # sequence length of each batch
    batches: int = 0


def reduce_grad(grad: torch.Tensor) -> tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, elements, scalars, element histogram, row-max histogram) of one dL/dY.

    rows and elements are ints; the rest stays on the gradient's device. scalars (int64): exactly-zero
    rows, non-finite rows, zero elements, float32 bits of the largest |g|. The histograms (int64, N_FINE
    fine buckets) count |g| and the per-row max |g|.
    """
    g = grad.detach()
    g2 = g.reshape(-1, g.shape[-1]) if g.dim() != 2 else g
    if g2.dtype == torch.bfloat16:
        bits = (g2.view(torch.int16).to(torch.int32) << 16) & _ABS_MASK  # bf16 = the top half of a float32
    else:
        f32 = g2 if g2.dtype == torch.float32 else g2.float()
        bits = f32.view(torch.int32) & _ABS_MASK
    rmax = bits.amax(dim=1)
    scalars = torch.stack([
        (rmax == 0).sum(),
        (rmax >= _INF_BITS).sum(),
        g2.numel() - torch.count_nonzero(g2),
        rmax.max().to(torch.int64),
    ])
    # bucket j >= 1 holds bits in ((j-1) << 20, j << 20]; zero stays in bucket 0 (-1 >> 20 == -1)
    bits -= 1
    bits >>= FINE_SHIFT
    bits += 1
    element_hist = torch.bincount(bits.view(-1), minlength=N_FINE)
    row_hist = torch.bincount(((rmax - 1) >> FINE_SHIFT) + 1, minlength=N_FINE)
    return g2.shape[0], g2.numel(), scalars, element_hist, row_hist


def _octaves(row_hist: torch.Tensor) -> torch.Tensor:
    """Fine row histogram -> octave buckets: fine buckets 8j-7..8j make octave j; bucket 0 stays."""
    return torch.cat([row_hist[:1], row_hist[1:].view(-1, 8).sum(dim=1)])


class GradientStatsCollector:
    """Context manager that gathers dL/dY statistics of target linears, batch by batch.

    Targets are found with :func:`sebp_probe.patch.find_targets` (same names as patching; default: the
    attention and MLP projections), so it works on plain and SEBP-patched models alike. Layer names are the
    logical ones (a peft ``...q_proj.base_layer`` is reported as ``...q_proj``). All hooks are removed when
    the ``with`` block ends, also on error.
    """

    def __init__(self, model: nn.Module, target_modules=None, exclude_modules=None):
        self.model = model
        real = find_targets(model, target_modules, exclude_modules)
        if not real:
            raise ValueError("no linear layer to collect statistics from (check the target/exclude patterns)")
        self._modules = {_logical_name(n): model.get_submodule(n) for n in real}
        self.names = list(self._modules)
        self._layers = {
            n: LayerStats(n, m.in_features, m.out_features) for n, m in self._modules.items()
        }
        self._handles: list = []
        self._pending: dict[str, list] | None = None
        self._element_acc: dict[str, torch.Tensor] = {}
        self._row_acc: dict[str, torch.Tensor] = {}
        self._lengths: list[np.ndarray] = []
        self._padded: list[int] = []
        self._batches = 0

    def __enter__(self) -> "GradientStatsCollector":
        for name, module in self._modules.items():
            self._handles.append(module.register_forward_hook(partial(self._on_forward, name)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._pending = None

    def _on_forward(self, name: str, module, args, output) -> None:
        if self._pending is not None and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(partial(self._on_grad, name))

    def _on_grad(self, name: str, grad: torch.Tensor) -> None:
        if self._pending is not None and grad.numel():
            self._pending[name].append(reduce_grad(grad))

    @contextlib.contextmanager
    def batch(self, attention_mask: torch.Tensor | None = None):
        """Collect the forward + backward run inside the block as one batch.

        ``attention_mask`` (batch x seq, 1 on real tokens) gives the token lengths for the padding
        statistics. If the block raises, the batch is discarded.
        """
        if not self._handles:
            raise RuntimeError("use the collector inside its `with` block")
        if self._pending is not None:
            raise RuntimeError("batches cannot nest")
        self._pending = {n: [] for n in self.names}
        try:
            yield self
            self._flush(attention_mask)
        finally:
            self._pending = None

    def _flush(self, attention_mask) -> None:
        rows = []
        for name in self.names:
            calls = self._pending[name]
            if not calls:
                rows.append(None)
                continue
            scalars = torch.stack([c[2] for c in calls])
            merged = scalars.sum(dim=0)
            merged[_MAX_BITS] = scalars[:, _MAX_BITS].max()
            element_hist = torch.stack([c[3] for c in calls]).sum(dim=0)
            row_hist = torch.stack([c[4] for c in calls]).sum(dim=0)
            if name in self._element_acc:
                self._element_acc[name] += element_hist
                self._row_acc[name] += row_hist
            else:
                self._element_acc[name], self._row_acc[name] = element_hist, row_hist
            rows.append(torch.cat([merged, _octaves(row_hist)]))
        present = [r for r in rows if r is not None]
        host = torch.stack(present).cpu().numpy() if present else None  # the one transfer of the batch
        it = iter(host if host is not None else [])
        for name, r in zip(self.names, rows):
            layer, calls = self._layers[name], self._pending[name]
            v = next(it) if r is not None else np.zeros(_N_SCALARS + N_OCTAVE, dtype=np.int64)
            layer.rows.append(sum(c[0] for c in calls))
            layer.elements.append(sum(c[1] for c in calls))
            layer.zero_rows.append(int(v[_ZERO_ROWS]))
            layer.nonfinite_rows.append(int(v[_NONFINITE_ROWS]))
            layer.zero_elements.append(int(v[_ZERO_ELEMS]))
            layer.max_abs.append(float(np.array([v[_MAX_BITS]], dtype=np.int32).view(np.float32)[0]))
            layer.row_octaves.append(v[_N_SCALARS:].astype(np.int32))
        if attention_mask is not None:
            mask = attention_mask.reshape(attention_mask.shape[0], -1)
            self._lengths.append(mask.sum(dim=1).cpu().numpy())
            self._padded.append(int(mask.shape[1]))
        self._batches += 1

    def stats(self) -> GradientStats:
        """The statistics gathered so far (histograms copied to the host)."""
        for name, layer in self._layers.items():
            if name in self._element_acc:
                layer.element_hist = self._element_acc[name].cpu().numpy().astype(np.int64)
                layer.row_hist = self._row_acc[name].cpu().numpy().astype(np.int64)
        return GradientStats(layers=dict(self._layers), lengths=list(self._lengths),
                             padded_lengths=list(self._padded), batches=self._batches)


@contextlib.contextmanager
def capture_output_grads(model: nn.Module, names: list[str]):
    """Copy dL/dY of the named linears to the host (float32), for pictures of small batches only.

    Yields a dict name -> tensor of shape (*output shape), filled during the backward.
    """
    modules = dict(model.named_modules())
    captured: dict[str, torch.Tensor] = {}
    handles = []

    def on_forward(name, module, args, output):
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda g: captured.__setitem__(name, g.detach().float().cpu()))

    try:
        for name in names:
            real = name if isinstance(modules.get(name), nn.Linear) else f"{name}.base_layer"
            if real not in modules:
                raise ValueError(f"layer {name!r} is not in this model")
            handles.append(modules[real].register_forward_hook(partial(on_forward, name)))
        yield captured
    finally:
        for h in handles:
            h.remove()
