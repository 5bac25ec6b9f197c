"""Per-layer statistics of dL/dY, reduced on the device while the backward pass runs.

A forward hook on every target linear puts a tensor hook on its output; in the backward that hook reduces
dL/dY (flattened to rows x features) on the device to its per-row max |g|, its count of non-zeros and a
small sample, and never copies the gradient itself. Once per batch these are bucketed for all layers
together (a few kernels, whatever the number of layers) and travel to the host in one transfer.

Magnitudes are bucketed by their float32 bit pattern (see :mod:`sebp_probe.knee`): an integer shift, no
logarithm, and every bucket edge is an exact float32, so row counts above a threshold at an edge are exact.
bfloat16 gradients map onto the same buckets without conversion; float16 and float64 are bucketed as
float32 (float64 magnitudes below ~1e-45 then count as zero, in the histograms and in the zero-row counts).
The per-row statistics are exact; the histogram of single elements is taken on a strided sample of rows
when a gradient holds more than ``ELEMENT_SAMPLE`` values (see :func:`reduce_grad`).

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

from .knee import _INF_BITS, FINE_SHIFT, N_FINE, N_OCTAVE, octave_histogram
from .patch import _logical_name, find_targets

_ABS_MASK = 0x7FFFFFFF
# layout of the per-layer scalars of :func:`reduce_calls`
_NONZERO, _NONFINITE_ROWS, _MAX_BITS, _ZERO_ROWS = range(4)
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
    """float32 bit patterns of |x| as int32 (bfloat16 is the top half of a float32: no conversion)."""
    if x.dtype == torch.bfloat16:
        return (x.view(torch.int16).to(torch.int32) << 16) & _ABS_MASK
    return (x if x.dtype == torch.float32 else x.float()).view(torch.int32) & _ABS_MASK


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


def summarize_grad(grad: torch.Tensor) -> GradCall:
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
    step = max(1, -(-g2.numel() // ELEMENT_SAMPLE))
    return GradCall(rows, rows * cols, row_max, nonzero, g2[::step].clone())


def _per_layer(layer: torch.Tensor, counts: list[int], total: int) -> torch.Tensor:
    """The layer index of every row: layer[i] repeated counts[i] times (output size given: no sync)."""
    return torch.repeat_interleave(layer, torch.tensor(counts, device=layer.device), output_size=total)


def reduce_calls(calls: list[GradCall], layer_of_call: list[int], n_layers: int):
    """Per-layer statistics of a batch's calls, on the device: (scalars (L, 4), element hist (L, N_FINE),
    row-max hist (L, N_FINE)), int64.

    scalars: non-zero elements, non-finite rows, float32 bits of the largest |g| (-1: no call), zero
    rows. The row statistics are exact; the element histogram counts every value of a gradient of at most
    ``ELEMENT_SAMPLE`` values and otherwise an evenly strided sample of its rows (it only draws the CDF of
    |g|; every decision uses the exact row statistics).
    """
    device = calls[0].row_max.device
    layer = torch.tensor(layer_of_call, device=device)
    rows = [c.rows for c in calls]
    row_layer = _per_layer(layer, rows, sum(rows))
    rbits = _abs_bits(torch.cat([c.row_max.reshape(-1) for c in calls]))
    row_hist = bucket_counts(row_layer * N_FINE + _buckets(rbits), n_layers * N_FINE).view(n_layers, N_FINE)
    nonfinite = bucket_counts(row_layer * 2 + (rbits >= _INF_BITS), n_layers * 2).view(n_layers, 2)[:, 1]
    max_bits = torch.full((n_layers,), -1, dtype=torch.int64, device=device)
    max_bits.scatter_reduce_(0, row_layer, rbits.to(torch.int64), "amax")
    nonzero = torch.zeros(n_layers, dtype=torch.int64, device=device)
    nonzero.index_add_(0, row_layer, torch.cat([c.nonzero for c in calls]).to(torch.int64))
    samples = [c.sample.reshape(-1) for c in calls]
    sizes = [s.numel() for s in samples]
    sample_layer = _per_layer(layer, sizes, sum(sizes))
    ebits = _abs_bits(torch.cat(samples))
    element_hist = bucket_counts(sample_layer * N_FINE + _buckets(ebits), n_layers * N_FINE).view(n_layers, N_FINE)
    scalars = torch.stack([nonzero, nonfinite, max_bits, row_hist[:, 0]], dim=1)
    return scalars, element_hist, row_hist


def reduce_grad(grad: torch.Tensor) -> tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """All statistics of one dL/dY: (rows, elements, scalars, element histogram, row-max histogram), with
    scalars = [zero rows, non-finite rows, zero elements, float32 bits of the largest |g|]."""
    call = summarize_grad(grad)
    scalars, element_hist, row_hist = (t[0] for t in reduce_calls([call], [0], 1))
    nonzero, nonfinite, max_bits, zero_rows = scalars
    return call.rows, call.elements, torch.stack([zero_rows, nonfinite, call.elements - nonzero, max_bits]), \
        element_hist, row_hist


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
        self._pending: list[tuple[int, GradCall]] | None = None
        self._element_acc: torch.Tensor | None = None  # (layers, N_FINE) on the device
        self._lengths: list[np.ndarray] = []
        self._padded: list[int] = []
        self._batches = 0

    def __enter__(self) -> "GradientStatsCollector":
        for i, module in enumerate(self._modules.values()):
            self._handles.append(module.register_forward_hook(partial(self._on_forward, i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._pending = None

    def _on_forward(self, index: int, module, args, output) -> None:
        if self._pending is not None and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(partial(self._on_grad, index))

    def _on_grad(self, index: int, grad: torch.Tensor) -> None:
        if self._pending is not None and grad.numel():
            self._pending.append((index, summarize_grad(grad)))

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
        self._pending = []
        try:
            yield self
            self._flush(attention_mask)
        finally:
            self._pending = None

    def _flush(self, attention_mask) -> None:
        n = len(self.names)
        rows, elements = [0] * n, [0] * n
        for i, call in self._pending:
            rows[i] += call.rows
            elements[i] += call.elements
        if self._pending:
            scalars, element_hist, row_hist = reduce_calls([c for _, c in self._pending],
                                                           [i for i, _ in self._pending], n)
            if self._element_acc is None:
                self._element_acc = element_hist
            else:
                self._element_acc += element_hist
            host = torch.cat([scalars, row_hist], dim=1).cpu().numpy()  # the one transfer of the batch
        else:
            host = np.zeros((n, _N_SCALARS + N_FINE), dtype=np.int64)
        for i, layer in enumerate(self._layers.values()):
            v = host[i]
            fine = v[_N_SCALARS:]
            layer.rows.append(rows[i])
            layer.elements.append(elements[i])
            layer.zero_rows.append(int(v[_ZERO_ROWS]))
            layer.nonfinite_rows.append(int(v[_NONFINITE_ROWS]))
            layer.zero_elements.append(elements[i] - int(v[_NONZERO]))
            layer.max_abs.append(float(np.array([max(v[_MAX_BITS], 0)], dtype=np.int32).view(np.float32)[0]))
            layer.row_octaves.append(octave_histogram(fine).astype(np.int32))
            layer.row_hist = layer.row_hist + fine
        if attention_mask is not None:
            mask = attention_mask.reshape(attention_mask.shape[0], -1)
            self._lengths.append(mask.sum(dim=1).cpu().numpy())
            self._padded.append(int(mask.shape[1]))
        self._batches += 1

    def stats(self) -> GradientStats:
        """The statistics gathered so far (histograms copied to the host)."""
        if self._element_acc is not None:
            acc = self._element_acc.cpu().numpy().astype(np.int64)
            for i, layer in enumerate(self._layers.values()):
                layer.element_hist = acc[i]
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
