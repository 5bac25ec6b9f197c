"""The reductions of dL/dY behind :class:`~sebp_probe.analysis.hooks.GradientStatsCollector`: the torch path
(every device, the oracle of the Triton kernel) and :func:`reduce_grad`, all of one gradient's statistics.

See :mod:`sebp_probe.analysis.hooks` for the statistics and the buckets they are kept in.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch

from sebp_kernels.interpret import INTERPRET

from .grad_records import _GROUPS_AT, _MAX_BITS, _N_SCALARS, _NONFINITE_ROWS, _NONZERO, _WIDTH, N_GROUPS
from .knee import _INF_BITS, _NAN_BITS, FINE_SHIFT, N_FINE, N_OCTAVE, OCTAVE_SHIFT

__all__ = ["ELEMENT_SAMPLE", "GradCall", "bucket_counts", "kernel_for", "kernel_on", "reduce_calls", "reduce_grad",
           "rows_view", "sample_step", "summarize_grad"]

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


def rows_view(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` as rows x features (a view where it can be)."""
    return grad if grad.dim() == 2 else grad.reshape(-1, grad.shape[-1])


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
    g2 = rows_view(grad.detach())
    rows, cols = g2.shape
    if g2.is_cuda:  # fused reductions, no full-size temporary (count_nonzero would make an int64 copy)
        row_max = torch.linalg.vector_norm(g2, ord=float("inf"), dim=1)  # max |g| per row, NaN kept
        nonzero = torch.linalg.vector_norm(g2, ord=0, dim=1, dtype=torch.float32)  # exact: <= cols
    else:  # on the CPU these are ~10x faster than the norms
        row_max = g2.abs().amax(dim=1)
        nonzero = (g2 != 0).sum(dim=1)
    return GradCall(rows, rows * cols, row_max, nonzero, g2[::sample_step(g2)].clone(), groups)


def sample_step(grad2d: torch.Tensor) -> int:
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


def kernel_on(device: torch.device):
    """The rowstats module when its kernel runs on ``device``, else None (torch path)."""
    if device.type != ("cpu" if INTERPRET else "cuda"):
        return None
    return _rowstats()


def kernel_for(grad2d: torch.Tensor):
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


def reduce_grad(grad: torch.Tensor) -> tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """All statistics of one dL/dY: (rows, elements, scalars, element histogram, row-max histogram), with
    scalars = [zero rows, non-finite rows, zero elements, float32 bits of the largest |g|]. Takes the path
    the collector would take for this tensor (Triton or torch)."""
    g2 = rows_view(grad.detach())
    rows, elements = g2.shape[0], g2.numel()
    kernel = kernel_for(g2)
    if kernel is None:
        batch, element_hist = reduce_calls([summarize_grad(g2)], [0], 1)
    else:
        batch = torch.zeros(1, _WIDTH, dtype=torch.int64, device=g2.device)
        element_hist = torch.zeros(1, N_FINE, dtype=torch.int64, device=g2.device)
        kernel.row_stats_(g2, batch, element_hist, 0, sample_step(g2), FINE_SHIFT)
    b = batch[0]
    scalars = torch.stack([b[_N_SCALARS], b[_NONFINITE_ROWS], elements - b[_NONZERO], b[_MAX_BITS]])
    return rows, elements, scalars, element_hist[0], b[_N_SCALARS:_GROUPS_AT]
