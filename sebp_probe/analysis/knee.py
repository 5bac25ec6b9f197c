"""From gradient histograms to SEBP settings: the noise threshold eps, the row capacity N, and what they save.

numpy, scipy and kneed only. The histograms come from :mod:`sebp_probe.analysis.hooks`, which buckets magnitudes by
their float32 bit pattern, so every bucket edge is an exact float32 value:

* fine buckets (8 per octave): bucket 0 holds exact zeros; bucket ``j >= 1`` holds values in
  ``(edge[j-1], edge[j]]`` with ``edge[j]`` the float32 whose bits are ``j << 20``;
* octave buckets: the same with ``j << 23``, so bucket ``j >= 1`` is ``(2**(j-128), 2**(j-127)]``.

How eps is found (:func:`detect_eps`), on the distribution of the per-row maximum ``max|dL/dY|`` (the
quantity the ``threshold`` mode compares with eps), exact-zero rows left out:

1. the histogram's CDF is put on a uniform log10 grid, its density smoothed with a Gaussian
   (``scipy.ndimage.gaussian_filter1d``) and integrated again;
2. the widest *gap* is searched: a run of at least ``min_gap_decades`` where the smoothed density stays
   below ``gap_floor`` times its peak, with mass on both sides (noise below, signal above);
3. on the CDF from the gap's start up to the signal's median, kneed (convex, increasing) finds the knee, the point of
   maximum slope change, which is where the signal bulk begins;
4. eps is the knee rounded down to a power of two and kept inside the gap, so that every row below the gap
   is inactive and every row above it active, and so that row counts from the octave buckets are exact.

Fallback (documented, never silent): when there are no non-zero rows, all magnitudes lie within one narrow
band, no gap exists (a unimodal or log-linear CDF: no noise floor to cut) or kneed finds no knee, the result
has ``eps = 0.0`` (``exact`` mode: only exactly-zero rows are skipped), ``knee_found = False`` and a reason.
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import numpy as np

FINE_SHIFT = 20
OCTAVE_SHIFT = 23
N_FINE = (1 << (31 - FINE_SHIFT)) + 1  # 2049: zero bucket + every 11-bit prefix of a non-negative float32
N_OCTAVE = (1 << (31 - OCTAVE_SHIFT)) + 1  # 257
# float32 bits of +inf, and the first bucket of each kind holding +inf (the buckets above it are NaN)
_INF_BITS = 0x7F800000
_NAN_BITS = 0x7FC00000  # every NaN is bucketed as this canonical quiet NaN

GRID_STEP = 0.05  # decades per point of the log grid the knee is searched on


def bucket_edges(shift: int = FINE_SHIFT) -> np.ndarray:
    """Upper edge of every bucket (float64 holding exact float32 values); 0 for bucket 0, NaN past +inf."""
    n = (1 << (31 - shift)) + 1
    bits = (np.arange(n, dtype=np.uint64) << np.uint64(shift)).astype(np.uint32)
    with np.errstate(invalid="ignore"):  # the NaN bit patterns past +inf
        edges = bits.view(np.float32).astype(np.float64)
    edges[n - 1] = np.nan  # 1 << 31 is the sign bit: past the last NaN pattern
    return edges


def lower_edges(edges: np.ndarray) -> np.ndarray:
    """Lower edge of every bucket; bucket 1 (down to the smallest float32) gets half its upper edge."""
    lo = np.concatenate([[0.0], edges[:-1]])
    if len(lo) > 1 and lo[1] == 0:
        lo[1] = edges[1] / 2
    return lo


def fine_histogram(values: np.ndarray) -> np.ndarray:
    """numpy twin of the device-side bucketing of :mod:`sebp_probe.analysis.hooks`: counts of |values| per fine
    bucket (float32 bits, 8 buckets per octave; bucket 0 = exact zeros; every NaN in the canonical NaN's)."""
    bits = np.abs(np.asarray(values, dtype=np.float32)).ravel().view(np.int32).astype(np.int64)
    bits[bits > _INF_BITS] = _NAN_BITS
    idx = ((bits - 1) >> FINE_SHIFT) + 1
    return np.bincount(idx, minlength=N_FINE)


def octave_histogram(fine: np.ndarray) -> np.ndarray:
    """Fine buckets -> octave buckets (fine 8j-7..8j make octave j; bucket 0 stays); works on (..., N_FINE)."""
    fine = np.asarray(fine)
    if (fine.shape[-1] - 1) % (1 << (OCTAVE_SHIFT - FINE_SHIFT)):
        raise ValueError(f"not a fine histogram: {fine.shape[-1]} buckets")
    starts = np.r_[0, 1:fine.shape[-1]:1 << (OCTAVE_SHIFT - FINE_SHIFT)]  # [0], [1..8], [9..16], ...
    wide = np.int64 if fine.dtype.kind in "biu" else None  # counts add up in int64, as np.sum would
    return np.add.reduceat(fine, starts, axis=-1, dtype=wide)  # ~3x faster than a reshaped sum(axis=-1)


def _power_of_two_floor(x: float) -> float:
    return 2.0 ** math.floor(math.log2(x))


def _power_of_two_ceil(x: float) -> float:
    return 2.0 ** math.ceil(math.log2(x))


@dataclass(frozen=True)
class EpsResult:
    """The threshold of one layer (or of all layers together) and how it was found.

    eps: the threshold (0.0 when no knee was found: ``exact`` mode).
    knee_found: whether a knee above a noise gap was found; when False, ``reason`` says why.
    knee: log10 of the knee's magnitude (before rounding to a power of two); None without a knee.
    gap: (low, high) log10 magnitudes of the empty band between noise and signal; None without a gap.
    noise_fraction: fraction of the non-zero values at or below eps.
    """

    eps: float
    knee_found: bool
    reason: str
    knee: float | None = None
    gap: tuple[float, float] | None = None
    noise_fraction: float = 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gap"] = list(self.gap) if self.gap is not None else None
        return d


def _fallback(reason: str) -> EpsResult:
    return EpsResult(eps=0.0, knee_found=False, reason=reason)


def log_cdf(counts: np.ndarray, edges: np.ndarray, step: float = GRID_STEP):
    """(x, cdf, density) of the finite non-zero part of a histogram, on a uniform log10 grid.

    ``counts[j]`` counts values in ``(edges[j-1], edges[j]]``; bucket 0 (zeros) and non-finite edges are
    ignored. Within a bucket the mass is spread uniformly in log magnitude. Returns None without mass.
    """
    counts = np.asarray(counts, dtype=np.float64)
    edges = np.asarray(edges, dtype=np.float64)
    if counts.shape != edges.shape:
        raise ValueError(f"counts {counts.shape} and edges {edges.shape} differ in shape")
    lo_edges = lower_edges(edges)
    ok = (np.arange(len(counts)) > 0) & np.isfinite(edges) & (lo_edges > 0) & (counts > 0)
    if not ok.any():
        return None
    idx = np.nonzero(ok)[0]
    lo = np.log10(lo_edges[idx])
    hi = np.log10(edges[idx])
    c = counts[idx]
    x = np.arange(math.floor(lo.min() / step) - 1, math.ceil(hi.max() / step) + 2) * step
    # cumulative mass at each grid point: full buckets below it plus the covered share of partial ones
    share = np.clip((x[:, None] - lo[None, :]) / (hi - lo)[None, :], 0.0, 1.0)
    cum = share @ c
    density = np.diff(cum, prepend=0.0)
    return x, cum / cum[-1], density


def knee_of_cdf(x: np.ndarray, cdf: np.ndarray, sensitivity: float = 1.0) -> float | None:
    """x of the knee of an increasing convex stretch of a CDF (kneed, point of maximum slope change)."""
    from kneed import KneeLocator

    x = np.asarray(x, dtype=np.float64)
    cdf = np.asarray(cdf, dtype=np.float64)
    if len(x) < 3 or np.ptp(cdf) <= 0 or np.ptp(x) <= 0:
        return None
    knee = KneeLocator(x, cdf, S=sensitivity, curve="convex", direction="increasing").knee
    return None if knee is None else float(knee)


class _LogGrid:
    """The uniform log10 grid every histogram over ``edges`` is put on (:func:`detect_eps_rows`): it spans all
    finite non-zero buckets, so a histogram's points do not depend on the histograms it is computed with.
    ``pad`` points beyond them on each side hold the Gaussian's tails."""

    def __init__(self, edges: np.ndarray, pad: int, step: float = GRID_STEP):
        self.pad = pad
        lo_edges = lower_edges(edges)
        self.finite = np.isfinite(edges) & (np.arange(len(edges)) > 0)
        self.valid = np.nonzero(self.finite & (lo_edges > 0))[0]  # the buckets a CDF spreads mass over
        if not len(self.valid):
            raise ValueError("no finite non-zero bucket edges")
        lo, hi = np.log10(lo_edges[self.valid]), np.log10(edges[self.valid])
        self.x = np.arange(math.floor(lo.min() / step) - 1 - pad, math.ceil(hi.max() / step) + 2 + pad) * step
        # grid point -> the valid bucket it falls in (len(valid): above them all) and the share of that
        # bucket's log width below it: a bucket's mass is spread uniformly in log magnitude
        self.bucket = np.searchsorted(hi, self.x, side="right")
        inside = np.minimum(self.bucket, len(hi) - 1)
        self.frac = np.where(self.bucket < len(hi),
                             np.clip((self.x - lo[inside]) / (hi - lo)[inside], 0.0, 1.0), 0.0)

    def density(self, counts: np.ndarray) -> tuple[slice, np.ndarray]:
        """(points, density): the stretch of the grid holding every row's mass and ``pad`` points more on each
        side, and each histogram row's mass between one of its points and the one below it (zero outside the
        stretch: a row's numbers do not depend on the stretch, see :func:`detect_eps_rows`)."""
        c = counts[:, self.valid]
        held = np.flatnonzero((c > 0).any(axis=0))
        h0, h1 = held[0], held[-1]
        held_points = np.flatnonzero((self.bucket >= h0) & (self.bucket <= h1 + 1))
        points = slice(max(0, held_points[0] - self.pad - 1), min(len(self.x), held_points[-1] + self.pad + 2))
        # the held buckets between a zero column below (the buckets under them) and one above (over them)
        zero = np.zeros((len(c), 1))
        held_c = np.concatenate([zero, c[:, h0:h1 + 1], zero], axis=1)
        below = np.concatenate([zero, np.cumsum(held_c, axis=1)], axis=1)  # exact: integer counts
        at = np.clip(self.bucket[points] - h0 + 1, 0, h1 - h0 + 2)
        cum = below[:, at] + held_c[:, at] * self.frac[points]
        return points, np.diff(cum, axis=1, prepend=0.0)


@functools.lru_cache(maxsize=8)
def _grid(edge_bytes: bytes, pad: int) -> _LogGrid:
    """The log grid of the float64 edges ``edge_bytes`` (kept: the same edges come again and again)."""
    return _LogGrid(np.frombuffer(edge_bytes), pad)


def _widest_gaps(x: np.ndarray, density: np.ndarray, floor_frac: float, min_width: float) -> list:
    """Per row of ``density``: (start, stop) grid indices of its widest low-density run with mass on both sides
    (the first of the widest; ``stop`` is the first point dense again), or None."""
    low = density < floor_frac * density.max(axis=1, keepdims=True)
    idx = np.arange(low.shape[1])
    high = ~low
    first = np.argmax(high, axis=1)
    last = low.shape[1] - 1 - np.argmax(high[:, ::-1], axis=1)
    inner = low & (idx > first[:, None]) & (idx < last[:, None])  # every such run ends at a dense point
    before = np.zeros_like(inner)
    before[:, 1:] = inner[:, :-1]
    rows, starts = np.nonzero(inner & ~before)
    _, stops = np.nonzero(~inner & before)  # runs of a row in order: the k-th start and stop pair up
    out: list = [None] * len(density)
    for r, a, b in zip(rows.tolist(), starts.tolist(), stops.tolist()):
        if out[r] is None or b - a > out[r][1] - out[r][0]:
            out[r] = (a, b)
    return [None if g is None or (x[g[1]] - x[g[0]]) < min_width else g for g in out]


def detect_eps(
    counts: np.ndarray,
    edges: np.ndarray | None = None,
    *,
    min_gap_decades: float = 1.0,
    gap_floor: float = 1e-3,
    smooth_decades: float = 0.1,
) -> EpsResult:
    """The noise threshold of a magnitude histogram: the knee above the gap between noise and signal.

    See the module docstring for the method and its fallback (eps 0.0, exact mode, with a reason).

    Args:
        counts: the histogram's counts, one per bucket (non-negative); bucket 0 holds exact zeros.
        edges: the upper edge of each bucket; None: the fine float32 buckets of :func:`bucket_edges`.
        min_gap_decades: the narrowest gap between noise and signal, in decades of magnitude, that counts.
        gap_floor: the smoothed density counts as empty below this share of its peak.
        smooth_decades: the width of the Gaussian that smooths the density, in decades (0: none).

    Returns:
        An :class:`EpsResult`: eps, whether a knee was found (else why not), the knee, the gap and the share
        of non-zero values at or below eps.

    Raises:
        ValueError: counts that are negative or NaN, or settings out of range.
    """
    counts = np.asarray(counts, dtype=np.float64)
    if counts.ndim != 1:
        raise ValueError(f"counts must be one histogram, got shape {counts.shape}")
    return detect_eps_rows(counts[None], edges, min_gap_decades=min_gap_decades, gap_floor=gap_floor,
                           smooth_decades=smooth_decades)[0]


def detect_eps_rows(
    counts: np.ndarray,
    edges: np.ndarray | None = None,
    *,
    min_gap_decades: float = 1.0,
    gap_floor: float = 1e-3,
    smooth_decades: float = 0.1,
) -> list[EpsResult]:
    """:func:`detect_eps` of each row of ``counts`` (histograms x buckets), in a few array operations for all of
    them: a row's result does not depend on the others (it is :func:`detect_eps` of that row)."""
    if min_gap_decades <= 0 or gap_floor <= 0 or smooth_decades < 0:
        raise ValueError("min_gap_decades and gap_floor must be > 0 and smooth_decades >= 0")
    counts = np.asarray(counts, dtype=np.float64)
    edges = bucket_edges() if edges is None else np.asarray(edges, dtype=np.float64)
    if counts.ndim != 2 or counts.shape[1:] != edges.shape:
        raise ValueError(f"counts {counts.shape} and edges {edges.shape} differ in shape")
    if np.isnan(counts).any() or (counts < 0).any():
        raise ValueError("histogram counts must be non-negative numbers")
    pad = int(math.ceil(4 * smooth_decades / GRID_STEP)) + 1
    grid = _grid(edges.tobytes(), pad)
    out: list = [None] * len(counts)
    has_mass = (counts[:, grid.valid] > 0).any(axis=1)
    for r in np.nonzero(~has_mass)[0]:
        out[r] = _fallback("no non-zero finite values (every row is exactly zero): eps=0, exact mode")
    mass = (counts > 0) & grid.finite
    first, last = np.argmax(mass, axis=1), counts.shape[1] - 1 - np.argmax(mass[:, ::-1], axis=1)
    with np.errstate(divide="ignore"):
        spread = np.log10(edges[last]) - np.log10(lower_edges(edges)[first])
    narrow = has_mass & (spread < min_gap_decades)
    for r in np.nonzero(narrow)[0]:
        out[r] = _fallback(f"all magnitudes lie within {spread[r]:.2g} decades (no noise floor): eps=0, exact mode")
    todo = np.nonzero(has_mass & ~narrow)[0]
    if not len(todo):
        return out
    # Only a stretch of the grid, the one the rows' mass and its smoothing reach: the grid points past it hold
    # zeros (the Gaussian reaches int(4 sigma + 0.5) <= pad points), and every operation below is elementwise or
    # sums in order (a cumulative sum, not np.sum's pairwise one), so the zeros left out change no bit.
    points, density = grid.density(counts[todo])
    if smooth_decades > 0:
        from scipy.ndimage import gaussian_filter1d

        density = gaussian_filter1d(density, smooth_decades / GRID_STEP, axis=1, mode="constant")
    cum = np.cumsum(density, axis=1)
    cdf = cum / cum[:, -1:]
    x = grid.x[points]
    for r, gap, c in zip(todo, _widest_gaps(x, density, gap_floor, min_gap_decades), cdf):
        out[r] = (_fallback(f"no gap of >= {min_gap_decades:g} decades between noise and signal (unimodal or "
                            f"log-linear CDF, no knee): eps=0, exact mode") if gap is None else
                  _eps_above_gap(counts[r], edges, grid, x, c, gap))
    return out


def _eps_above_gap(counts: np.ndarray, edges: np.ndarray, grid: _LogGrid, x: np.ndarray, cdf: np.ndarray,
                   gap: tuple[int, int]) -> EpsResult:
    """eps of a histogram with a noise gap: the knee of its CDF (over grid points ``x``) above the gap, kept
    inside the gap."""
    g0, g1 = gap
    # The convex stretch: from the gap's start up to the signal's median.
    top = g1 + int(np.searchsorted(cdf[g1:], 0.5 * (cdf[g1] + 1.0)))
    knee = knee_of_cdf(x[g0:top + 1], cdf[g0:top + 1])
    if knee is None:
        return _fallback("kneed found no knee above the noise gap: eps=0, exact mode")

    # eps stays between the highest value below the gap's middle and the lowest value above it, so the
    # noise rows are inactive and the signal rows (all > eps) active.
    lo_edges, finite = lower_edges(edges), grid.finite
    split = 10.0 ** (0.5 * (x[g0] + x[g1]))
    below = np.nonzero((counts > 0) & finite & (edges <= split))[0]
    above = np.nonzero((counts > 0) & (np.arange(len(counts)) > 0) & (lo_edges >= split))[0]
    noise_top = edges[below[-1]] if len(below) else 0.0
    signal_bottom = lo_edges[above[0]] if len(above) else math.inf
    eps = _power_of_two_floor(min(10.0 ** knee, signal_bottom))
    if eps < noise_top:
        eps = _power_of_two_ceil(noise_top)
    if not (noise_top <= eps <= signal_bottom):
        return _fallback("no power of two fits between noise and signal: eps=0, exact mode")
    nonzero = counts[finite].sum()
    noise = counts[finite & (edges <= eps)].sum()
    return EpsResult(
        eps=float(eps),
        knee_found=True,
        reason=f"knee at the onset of the signal above a {x[g1] - x[g0]:.1f}-decade gap",
        knee=round(float(knee), 4),
        gap=(round(float(x[g0]), 4), round(float(x[g1]), 4)),
        noise_fraction=float(noise / nonzero) if nonzero else 0.0,
    )


def rows_above(octave_counts: np.ndarray, eps: float) -> np.ndarray:
    """Rows with max|dL/dY| > eps per batch, from octave histograms of shape (batches, N_OCTAVE).

    Exact when eps is 0 or a power of two (an octave edge); otherwise it counts every row of the octave
    holding eps, an upper bound. Non-finite rows land in the top buckets and always count.
    """
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    octave_counts = np.atleast_2d(np.asarray(octave_counts))
    upper = bucket_edges(OCTAVE_SHIFT)
    keep = (upper > eps) | np.isnan(upper)
    keep[0] = False  # exact zeros are never above any eps >= 0
    return octave_counts[:, keep].sum(axis=1)


def recommend_top_n(
    active_rows: np.ndarray,
    max_rows: int,
    quantile: float = 0.99,
    margin: float = 0.1,
    tile: int = 64,
) -> int:
    """N for ``topk`` mode: the ``quantile`` of per-batch active row counts, plus ``margin``, rounded up to
    a multiple of ``tile`` and capped at ``max_rows`` (the most rows a batch had). Always >= 1."""
    if not 0 < quantile <= 1 or margin < 0 or tile < 1 or max_rows < 1:
        raise ValueError("need 0 < quantile <= 1, margin >= 0, tile >= 1, max_rows >= 1")
    active = np.asarray(active_rows, dtype=np.float64)
    if active.size == 0:
        raise ValueError("no batches to recommend N from")
    q = float(np.quantile(active, quantile, method="higher"))
    n = max(1, math.ceil(q * (1.0 + margin)))
    n = int(math.ceil(n / tile) * tile)
    return int(min(n, max_rows))


def backward_gemm_flops(rows: np.ndarray | int, in_features: int, out_features: int) -> float:
    """FLOPs of the two backward GEMMs of a linear layer over ``rows`` rows: dX (2·rows·out·in) and
    dW (2·out·rows·in), summed over batches when ``rows`` is per batch."""
    return float(4 * np.sum(rows) * in_features * out_features)


def padding_waste(lengths: list[np.ndarray], padded_lengths: list[int]) -> dict:
    """Padding statistics of a run: ``lengths[b]`` the real token counts of batch b, ``padded_lengths[b]``
    its padded sequence length.

    pad_fraction: share of processed tokens that are padding;
    dynamic_pad_fraction: the same with each batch padded to its longest sample;
    dynamic_saving: share of processed tokens dynamic padding would remove.
    """
    if len(lengths) != len(padded_lengths) or not lengths:
        raise ValueError("need one padded length per batch and at least one batch")
    real = sum(int(np.sum(lb)) for lb in lengths)
    processed = sum(len(lb) * int(p) for lb, p in zip(lengths, padded_lengths))
    dynamic = sum(len(lb) * int(np.max(lb)) for lb in lengths if len(lb))
    if processed == 0:
        raise ValueError("batches hold no tokens")
    return {
        "tokens": processed,
        "real_tokens": real,
        "pad_fraction": 1.0 - real / processed,
        "dynamic_pad_fraction": 1.0 - real / dynamic if dynamic else 0.0,
        "dynamic_saving": 1.0 - dynamic / processed,
    }
