"""knee.py on synthetic data with known answers: knees, noise gaps, degenerate CDFs, N, FLOPs, padding."""
from __future__ import annotations

import math

import numpy as np
import pytest

from sebp_probe.analysis.knee import (
    GRID_STEP,
    N_FINE,
    N_OCTAVE,
    bucket_edges,
    detect_eps,
    detect_eps_rows,
    fine_histogram,
    knee_of_cdf,
    log_cdf,
    octave_histogram,
    padding_waste,
    recommend_top_n,
    rows_above,
)


def _lognormal(rng, center, n, width=0.3):
    return 10.0 ** rng.normal(center, width, n)


@pytest.mark.parametrize("x0", [2.0, 5.0, 7.5])
def test_knee_of_piecewise_cdf_is_its_corner(x0):
    x = np.linspace(0, 10, 201)
    y = np.clip(x - x0, 0, None)
    y = y / y[-1]
    assert knee_of_cdf(x, y) == pytest.approx(x0, abs=0.05)


def test_knee_of_flat_or_tiny_input_is_none():
    assert knee_of_cdf(np.arange(5.0), np.ones(5)) is None
    assert knee_of_cdf(np.arange(2.0), np.arange(2.0)) is None


@pytest.mark.parametrize(
    "noise_center, signal_center, n_noise, n_signal",
    [(-8, -3, 1000, 3000), (-9, -4, 9000, 300), (-8, -3, 100, 30000), (-7, -2.5, 2000, 2000)],
)
def test_eps_sits_in_the_gap_between_noise_and_signal(noise_center, signal_center, n_noise, n_signal):
    rng = np.random.default_rng(1)
    noise = _lognormal(rng, noise_center, n_noise).astype(np.float32)
    signal = _lognormal(rng, signal_center, n_signal).astype(np.float32)
    res = detect_eps(fine_histogram(np.concatenate([noise, signal, np.zeros(50)])))
    assert res.knee_found, res.reason
    assert noise.max() <= res.eps < signal.min()
    assert math.log2(res.eps) == int(math.log2(res.eps))  # a power of two: octave counts are exact
    assert res.noise_fraction == pytest.approx(n_noise / (n_noise + n_signal))
    # the knee is where the signal begins: below the signal's centre, above the gap's lower end
    lo, hi = res.gap
    assert lo < res.knee < signal_center
    assert hi > math.log10(noise.max())
    assert res.knee > math.log10(signal.min()) - 0.5


@pytest.mark.parametrize(
    "values, words",
    [
        (np.zeros(100), "exactly zero"),
        (np.full(100, 0.01), "within"),
        (10.0 ** np.random.default_rng(0).uniform(-9, -1, 100_000), "no gap"),
        (10.0 ** np.random.default_rng(0).normal(-3, 0.4, 100_000), "no gap"),
        (10.0 ** np.concatenate([np.random.default_rng(0).normal(-6, 0.3, 1000),
                                 np.random.default_rng(1).normal(-5, 0.3, 1000)]), "no gap"),
    ],
    ids=["all-zero", "single-magnitude", "log-linear", "unimodal", "overlapping"],
)
def test_degenerate_cdfs_fall_back_to_exact_mode(values, words):
    res = detect_eps(fine_histogram(values))
    assert not res.knee_found
    assert res.eps == 0.0 and res.knee is None and res.gap is None
    assert words in res.reason and "exact" in res.reason


def test_empty_histogram_and_bad_counts():
    assert not detect_eps(np.zeros(N_FINE)).knee_found
    with pytest.raises(ValueError, match="non-negative"):
        detect_eps(-np.ones(N_FINE))
    with pytest.raises(ValueError, match="shape"):
        detect_eps(np.ones(10), bucket_edges())


def _random_histograms(n: int, seed: int) -> np.ndarray:
    """Mixtures of 1-3 log-normal bumps anywhere in float32's range (gaps and none), some with zeros, inf and
    NaN, some nearly empty."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(n):
        v = np.concatenate([10.0 ** rng.normal(rng.uniform(-30, 3), rng.uniform(0.05, 2.0), rng.integers(1, 3000))
                            for _ in range(rng.integers(1, 4))]).astype(np.float32)
        if t % 5 == 4:
            v = v[:rng.integers(0, 3)]
        extra = [np.zeros(10)] if t % 3 == 0 else []
        extra += [[np.inf, np.nan]] if t % 7 == 0 else []
        out.append(fine_histogram(np.concatenate([v, *extra]).astype(np.float32)))
    return np.stack(out)


def _reference_gap(counts: np.ndarray, min_gap: float = 1.0, floor: float = 1e-3, smooth: float = 0.1):
    """The widest noise gap by the plain path: the histogram's CDF on its own log grid (:func:`log_cdf`, a
    matrix of bucket shares), padded, smoothed, and walked point by point; (low, high) log10, or None."""
    from scipy.ndimage import gaussian_filter1d

    x, _, density = log_cdf(counts, bucket_edges())
    pad = math.ceil(4 * smooth / GRID_STEP) + 1
    x = np.concatenate([x[0] - GRID_STEP * np.arange(pad, 0, -1), x, x[-1] + GRID_STEP * np.arange(1, pad + 1)])
    density = gaussian_filter1d(np.pad(density, pad), smooth / GRID_STEP, mode="constant")
    low = density < floor * density.max()
    high = np.flatnonzero(~low)
    best, start = None, None
    for i in range(high[0], high[-1] + 1):
        if low[i] and start is None:
            start = i
        elif not low[i] and start is not None:
            if best is None or i - start > best[1] - best[0]:
                best = (start, i)
            start = None
    if best is None or x[best[1]] - x[best[0]] < min_gap:
        return None
    return round(float(x[best[0]]), 4), round(float(x[best[1]]), 4)


def test_eps_of_many_histograms_at_once_is_each_ones_alone_and_finds_the_plain_paths_gaps():
    hists = _random_histograms(240, seed=3)
    together = detect_eps_rows(hists)
    assert together == [detect_eps(h) for h in hists]  # a row's result does not depend on the others
    assert together == detect_eps_rows(hists[::-1])[::-1]
    gaps = 0
    for h, res in zip(hists, together):
        if "no gap" in res.reason:
            assert _reference_gap(h) is None
        elif res.gap is not None or "kneed found no knee" in res.reason or "no power of two" in res.reason:
            want = _reference_gap(h)
            assert want is not None
            assert res.gap is None or res.gap == want
            gaps += 1
    assert gaps > 40 and sum(r.knee_found for r in together) > 40  # both kinds are there
    with pytest.raises(ValueError, match="shape"):
        detect_eps_rows(hists[0])


def test_of_two_widest_gaps_the_lower_one_counts():
    hist = np.zeros(N_FINE, np.int64)
    hist[[600, 666, 732]] = 100  # three equal bumps: two gaps of 35 grid points each
    lower, upper = detect_eps(hist).gap, detect_eps(hist[::-1][::-1]).gap
    assert lower == upper == _reference_gap(hist)
    assert lower[1] < math.log10(bucket_edges()[700])  # the gap below the middle bump


def test_fine_buckets_are_half_open_at_exact_float32_edges():
    edges = bucket_edges()
    assert edges[0] == 0 and np.isinf(edges[2040]) and np.isnan(edges[2041:]).all()
    j = 1000
    e = np.float32(edges[j])
    h = fine_histogram(np.array([0.0, -0.0, e, -e, np.nextafter(e, np.float32(np.inf)), np.inf, np.nan],
                                dtype=np.float32))
    assert h[0] == 2  # both zeros
    assert h[j] == 2  # an edge belongs to the bucket it closes, sign ignored
    assert h[j + 1] == 1
    assert h[2040] == 1 and h[2041:].sum() == 1  # inf, NaN
    assert h.sum() == 7


@pytest.mark.parametrize("eps", [0.0, 2.0**-20, 2.0**-7, 1.0])
def test_rows_above_is_exact_at_powers_of_two(eps):
    rng = np.random.default_rng(3)
    row_max = np.concatenate([
        10.0 ** rng.uniform(-9, 1, (4, 500)),
        np.zeros((4, 20)),
        np.full((4, 3), eps),  # exactly eps: not above it
        np.full((4, 1), np.nan),  # non-finite rows always count
    ], axis=1).astype(np.float32)
    octaves = np.stack([octave_histogram(fine_histogram(r)) for r in row_max])
    assert octaves.shape == (4, N_OCTAVE)
    want = [int(np.sum(r > np.float32(eps)) + np.isnan(r).sum()) for r in row_max]
    assert rows_above(octaves, eps).tolist() == want
    with pytest.raises(ValueError, match="eps"):
        rows_above(octaves, -1.0)


def test_recommend_top_n_quantile_margin_tile_and_cap():
    active = np.array([100] * 99 + [400])
    assert recommend_top_n(active, max_rows=4096, quantile=0.5, margin=0.0, tile=64) == 128
    assert recommend_top_n(active, max_rows=4096, quantile=1.0, margin=0.1, tile=64) == 448  # 440 -> 448
    assert recommend_top_n(active, max_rows=300, quantile=1.0) == 300
    assert recommend_top_n(np.zeros(5), max_rows=4096, tile=16) == 16  # never 0
    with pytest.raises(ValueError):
        recommend_top_n(active, max_rows=4096, tile=0)
    with pytest.raises(ValueError):
        recommend_top_n([], max_rows=10)


def test_padding_waste_by_hand():
    lengths = [np.array([10, 20]), np.array([5, 5, 5])]
    w = padding_waste(lengths, [32, 32])
    assert w["tokens"] == 5 * 32 and w["real_tokens"] == 45
    assert w["pad_fraction"] == pytest.approx(1 - 45 / 160)
    assert w["dynamic_pad_fraction"] == pytest.approx(1 - 45 / (2 * 20 + 3 * 5))
    assert w["dynamic_saving"] == pytest.approx(1 - 55 / 160)
    with pytest.raises(ValueError):
        padding_waste(lengths, [32])
