"""Sampled backward (``SEBPConfig("sampled", budget=...)``): an unbiased, approximate linear backward that skips
most of the rows of dL/dY that carry little gradient.

Each non-zero row i of dY has the weight w_i = ||dY_i||_2 and is kept with probability p_i = min(1, w_i / tau),
where tau is the layer's cutoff, a device scalar known before the step (:class:`SampleState`). A kept row with
p_i < 1 is rescaled by 1/p_i, so E[sampled dW] = dW for any tau > 0: rows at or above the cutoff are kept as they
are, the tail is sampled in proportion to its norm (importance sampling as in VCAS and WTA-CRS). dW and db always
use the sample; dX uses it only with ``sample_dx`` (by default dX stays exact over the non-zero rows, WTA-CRS's
choice: a sampled dX would feed its noise into every layer below). Rows that are exactly zero stay out as in
exact mode; rows holding NaN or Inf are always kept (p = 1), so a diverging run is never hidden.

After every backward the layer solves, on the device, the cutoff for its next one from this backward's row
norms: the tau whose expected kept share of the non-zero rows is the budget (one histogram of the norms and a
closed form, :mod:`.sample_buckets`; no sort, no host sync). Budget 1 keeps tau = 0: every non-zero row,
unscaled, exactly the exact-mode gradient.

Randomness is counter-based: each row's draw is an integer hash (splitmix64's mixer, in int64 torch ops, so
that a Triton kernel can compute the same bits) of (run seed, layer key, the layer's backward count, row
index). A run therefore reproduces its draws, and a resumed run continues them, from :meth:`SampleState.state_dict`.
The keep test is on a 24-bit grid: the draw k is an integer in [0, 2^24) and a row is kept when
k < ceil(p * 2^24), whose probability is exactly q = ceil(p * 2^24) / 2^24; the kept row is scaled by 1/q.
"""
from __future__ import annotations

import zlib

import torch

from .density import OBSERVE_EVERY, RowDensity
from .readback import PeriodicShare
from .reference import backward_over_rows
from .registry import register
from .sample_buckets import bucket_sums, solve_share
from .sample_variance import guard_numbers, sampling_variance, sgd_variance, solve_cutoff_for_variance

_M64 = (1 << 64) - 1
GRID_BITS = 24
GRID = float(1 << GRID_BITS)
# The Triton path's gathered rows (SampleState.capacity): the recent kept share of the rows times CAP_MARGIN,
# plus CAP_ROUND, rounded up to a multiple of CAP_ROUND. A backward that keeps more takes a random window of
# the kept rows (unbiased, see window); one that keeps fewer fills the other slots with zeros.
CAP_MARGIN = 1.1
CAP_ROUND = 64


def _signed(v: int) -> int:
    """``v`` mod 2^64 as a signed int64 (the bits torch's int64 tensors hold)."""
    v &= _M64
    return v - (1 << 64) if v >> 63 else v


GOLDEN = _signed(0x9E3779B97F4A7C15)
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)


def mix64_int(x: int) -> int:
    """splitmix64's mixer on a Python int (unsigned 64-bit result): the host half of the hash, and the
    oracle of :func:`mix64`."""
    z = x & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` on int64 is arithmetic: it copies the sign bit)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's mixer elementwise on int64 bits (multiplication wraps mod 2^64, as in the Python oracle)."""
    z = (x ^ _shr(x, 30)) * _MUL1
    z = (z ^ _shr(z, 27)) * _MUL2
    return z ^ _shr(z, 31)


def stream_key(seed: int, layer_key: int) -> int:
    """One layer's stream key in a run (unsigned 64-bit): what :func:`stream_base` mixes with each backward's
    count, and what the Triton path keeps on the device (:meth:`SampleState.device_hash`)."""
    return mix64_int(seed * 0x9E3779B97F4A7C15 + layer_key)


def stream_base(seed: int, layer_key: int, step: int) -> int:
    """The hash state of one backward of one layer (host ints, no device work), as a signed int64."""
    return _signed(mix64_int(stream_key(seed, layer_key) + step * 0x9E3779B97F4A7C15))


def row_draws(seed: int, layer_key: int, step: int, m: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 (m,): each row's draw, an integer uniform on [0, 2^24), from (seed, layer_key, step, row)."""
    rows = torch.arange(1, m + 1, dtype=torch.int64, device=device)
    return _shr(mix64(rows * GOLDEN + stream_base(seed, layer_key, step)), 64 - GRID_BITS)


WINDOW = 0xD1B54A32D192ED03  # mixed into a backward's stream state for its window offset (no row's draw)


def window_offset(seed: int, layer_key: int, step: int, kept: int) -> int:
    """Where a backward's window of kept rows starts when more rows were kept than its capacity
    (:mod:`sebp_kernels._triton.sample_gather`): an integer in [0, kept), (h >> 32) * kept >> 32 for a 64-bit
    hash h of the backward's stream state (each offset's probability is within kept / 2^32 of 1 / kept)."""
    h = mix64_int((stream_base(seed, layer_key, step) + WINDOW) & _M64)
    return ((h >> 32) * kept) >> 32


def window(kept_rows: torch.Tensor, cap: int, seed: int, layer_key: int, step: int):
    """(rows, factor): ``cap`` of the ``kept_rows`` (in row order) and their extra scale, for a capacity of
    ``cap`` slots. All of them, factor 1, when they fit; else ``cap`` consecutive ones, cyclically from
    :func:`window_offset`, and factor kept / cap (fp32): each kept row is in the window with probability
    cap / kept, so the sampled gradient stays unbiased."""
    k = kept_rows.numel()
    if k <= cap:
        return kept_rows, None
    off = window_offset(seed, layer_key, step, k)
    idx = (off + torch.arange(cap, device=kept_rows.device)) % k
    return kept_rows[idx], torch.tensor(k, dtype=torch.float32) / cap


def layer_key(name: str) -> int:
    """A layer's key in the hash, from its module name: the same in every run of a model (CRC-32)."""
    return zlib.crc32(name.encode())


def keep_probabilities(w: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """fp32 (M,): p = min(1, w / tau) on the 24-bit grid (ceil(p * 2^24) / 2^24), 1 where tau is 0 or w is not a
    positive finite number (NaN/Inf rows, and non-zero rows whose fp32 norm underflowed)."""
    p = torch.where(tau > 0, (w / tau).clamp(max=1.0), torch.ones_like(w))
    p = torch.where(torch.isfinite(w) & (w > 0), p.nan_to_num(1.0), torch.ones_like(w))
    return torch.ceil(p * GRID) / GRID


def solve_tau(w: torch.Tensor, budget: float) -> torch.Tensor:
    """fp32 scalar tau whose expected kept share, sum(min(1, w_i / tau)) / n over the n rows with w_i > 0 (finite
    weights only), is at least the ``budget`` and within a bucket's rows of it (:mod:`.sample_buckets`); 0 at
    budget 1 (keep all), and 0 where no row has a positive weight. On the device, no host sync."""
    if budget >= 1.0 or w.numel() == 0:
        return w.new_zeros((), dtype=torch.float32)
    return solve_share(*bucket_sums(w, None), budget)


class SampleState:
    """One layer's sampling state: the cutoff ``tau`` (a device scalar; None before the first backward, which then
    solves it from its own rows), its backward count ``calls`` (the hash's step counter; warm-up counts in it),
    and counters of the rows sampled after warm-up: all of dY's rows, the non-zero ones and those kept for dW (a
    device int64 triple). The Triton path keeps the stream key and the count on the device too
    (:meth:`device_hash`), advanced by its kernels, so that CUDA-graph replays draw anew; ``calls`` on the host
    then lags, and :meth:`state_dict` reads the device's. Nothing here syncs with the host except
    :meth:`counts` and :meth:`state_dict`."""

    __slots__ = ("layer_key", "tau", "calls", "_stats", "_hash", "_hash_at", "key", "share", "var_tau",
                 "armed", "guard", "density", "kept", "__weakref__")

    def __init__(self, layer_key: int = 0) -> None:
        self.layer_key = int(layer_key)
        self.key = register(self)  # names it inside compiled graphs (see .registry)
        self.reset()

    def reset(self) -> None:
        """Back to a fresh layer: no cutoff, no backward counted (e.g. after calibration's timing passes)."""
        self.tau: torch.Tensor | None = None
        self.calls = 0
        self._stats: torch.Tensor | None = None
        self._hash: torch.Tensor | None = None
        self._hash_at = None  # the (seed, device, calls) that _hash holds
        self.share: float | None = None  # a fixed budget's share for this layer, once the guard raised it
        self.var_tau: float | None = None  # the variance budget for this layer, once the guard lowered it
        self.armed = False  # the guard's step: the next backward also computes the exact dW
        self.guard: torch.Tensor | None = None  # that backward's numbers (.sample_variance.GUARD_FIELDS)
        self.density = RowDensity()  # the share of non-zero rows, read back without a sync (Triton path)
        self.kept = PeriodicShare(OBSERVE_EVERY)  # the share of the rows kept, read back likewise (Triton path)

    def __reduce__(self):  # copies start afresh, with the same layer key
        return (SampleState, (self.layer_key,))

    def stats(self, device: torch.device) -> torch.Tensor:
        """int64 (3,) on ``device``: the rows, non-zero rows and kept rows counted so far (added to in place)."""
        if self._stats is None or self._stats.device != device:
            prev = (0, 0, 0) if self._stats is None else self._stats.tolist()
            self._stats = torch.tensor(prev, dtype=torch.int64, device=device)
        return self._stats

    def count(self, rows: int, nonzero: torch.Tensor, kept: torch.Tensor) -> None:
        """Add a sampled backward's ``rows`` and its ``nonzero`` and ``kept`` counts (device scalars)."""
        self.stats(nonzero.device).add_(torch.stack((nonzero.new_tensor(rows), nonzero, kept)).to(torch.int64))

    def device_hash(self, seed: int, device: torch.device) -> torch.Tensor:
        """int64 (2,) on ``device``: the stream key mix64(seed * golden + layer key) and the backward count, which
        the Triton path's kernels read and advance (and :meth:`advance_on_host` after a torch backward). Built
        anew (a host-to-device copy) only when the count on the host moved without it (a state was loaded) or the
        seed or device changed."""
        at = (seed, device, self.calls)
        if self._hash is None or self._hash_at != at:
            key = _signed(stream_key(seed, self.layer_key))
            self._hash = torch.tensor([key, self.calls], dtype=torch.int64, device=device)
        self._hash_at = (seed, device, self.calls + 1)  # what it holds once the kernels advanced it
        return self._hash

    def advance_on_host(self) -> None:
        """Count a backward that ran on the torch path: the host count, and the device's where the Triton path
        keeps one (no copy to the device on the next Triton backward)."""
        if self._hash is not None and self._hash_at[2] == self.calls:
            self._hash[1:].add_(1)
            self._hash_at = (*self._hash_at[:2], self.calls + 1)
        self.calls += 1

    def dense_dx(self, capturing: bool = False) -> bool:
        """Whether this backward's exact dX takes the dense GEMM (cuBLAS, ``dY @ W``: the same dX, its zero rows
        give zero rows): exact mode's rule on the layer's non-zero rows (:class:`~.density.RowDensity`, read a step
        or more stale, never a sync; its periodic probes take the dense dX too, the count being there anyway).
        Pass each backward's non-zero count to ``self.density.observe``."""
        return self.density.choose(capturing) != "sebp"

    def capacity(self, m: int, config, capturing: bool = False) -> int | None:
        """The Triton path's slots for the kept rows of a backward over ``m`` rows (see ``CAP_MARGIN``): from
        the kept share last read back (pass each backward's kept count to ``self.kept.observe``; a step or more
        stale, never a sync), or before one, a fixed budget's share; None under ``auto`` before the first read
        (the fused kernel runs then)."""
        share = self.kept.share if capturing else self.kept.poll()
        if share is None:
            if config.budget == "auto":
                return None
            share = layer_share(config, self)
        cap = -(-(int(m * share * CAP_MARGIN) + CAP_ROUND) // CAP_ROUND) * CAP_ROUND
        return min(m, cap)

    def counts(self) -> dict:
        """Rows of dY, non-zero rows and rows kept for dW over the sampled backwards so far (reads the device)."""
        rows, nonzero, kept = self._stats.tolist() if self._stats is not None else (0, 0, 0)
        return {"rows": rows, "nonzero": nonzero, "kept": kept}

    def state_dict(self) -> dict:
        """JSON-able state (tau as a float: fp32 converts exactly), from which :meth:`load_state_dict` resumes."""
        calls = self.calls if self._hash is None else max(self.calls, int(self._hash[1]))  # replays ran on
        return {"tau": None if self.tau is None else float(self.tau), "calls": calls, **self.counts(),
                **({"share": self.share} if self.share is not None else {}),
                **({"var_tau": self.var_tau} if self.var_tau is not None else {})}

    def load_state_dict(self, d: dict, device: torch.device | str = "cpu") -> None:
        self.tau = None if d.get("tau") is None else torch.tensor(d["tau"], dtype=torch.float32, device=device)
        self.calls = int(d.get("calls", 0))
        self.share, self.var_tau = d.get("share"), d.get("var_tau")
        self._stats = self._hash = self._hash_at = None
        if d.get("rows"):
            self._stats = torch.tensor([int(d["rows"]), int(d["nonzero"]), int(d["kept"])], dtype=torch.int64,
                                       device=device)


def sampled_backward_torch(dy: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, config,
                           state: SampleState | None, need_dx: bool = True, need_dw: bool = True,
                           need_db: bool = True, cap: int | None = None):
    """(dX, dW, db) of ``Y = X Wᵀ + b`` for 2-D ``dy`` (M, out) in ``sampled`` mode, in torch: the CPU path, the
    fallback on GPUs and the oracle of a kernel. Draws this backward's rows with ``state``'s cutoff, then updates
    the cutoff and the counters (see the module docstring). ``cap``: the capacity of the Triton path's gathered
    rows (:func:`window`; None: no limit). During the first ``config.warmup`` backwards of the
    layer every non-zero row is kept unscaled (the exact gradient) while the cutoff is still solved. With
    ``budget="auto"`` the cutoff keeps dW's added variance under the layer's variance budget
    (:mod:`.sample_variance`; the first backward keeps every row). A backward of an ``armed`` state also
    computes the exact dW and leaves the guard's numbers in ``state.guard``."""
    if state is None:
        raise ValueError("sampled mode needs its layer's SampleState (sebp_linear(..., state=SampleState()))")
    m, auto = dy.shape[0], config.budget == "auto"
    active = dy.any(dim=1)  # as exact mode: NaN and Inf are truthy
    w = torch.linalg.vector_norm(dy.float(), dim=1)
    # ||X_i||²: for the variance rule and the guard only (a fixed share without the guard reads dY alone)
    xn2 = (x.float() ** 2).sum(1) if x is not None and need_dw and (auto or state.armed) else torch.ones_like(w)
    solved = state.tau is None
    if solved:  # the first backward: the cutoff from its own rows (it depends on dY and X alone: still unbiased)
        state.tau = w.new_zeros(()) if auto else solve_tau(w, layer_share(config, state))
    q = None
    if state.calls >= config.warmup:
        q = keep_probabilities(w, state.tau.to(w.device))
        draws = row_draws(config.seed, state.layer_key, state.calls, m, dy.device)
        kept = active & (draws < (q * GRID).to(torch.int64))
        state.count(m, active.sum(), kept.sum())
    else:
        kept = active
    step = state.calls
    state.advance_on_host()
    inv = None if q is None else 1.0 / q  # exactly 1 where q = 1
    kept_rows = kept.nonzero().squeeze(1)
    if inv is not None and cap is not None:
        kept_rows, factor = window(kept_rows, cap, config.seed, state.layer_key, step)
        inv = inv if factor is None else inv * factor
    scale = None if inv is None else inv.to(dy.dtype)
    if config.sample_dx or not need_dx or scale is None:
        dx, dw, db = backward_over_rows(dy, x, weight, kept_rows, need_dx, need_dw, need_db, scale=scale)
    else:
        dx, _, _ = backward_over_rows(dy, x, weight, active.nonzero().squeeze(1), True, False, False)
        _, dw, db = backward_over_rows(dy, x, weight, kept_rows, False, need_dw, need_db, scale=scale)
    qa = torch.ones_like(w) if q is None else torch.where(active, q, torch.ones_like(q))
    if state.armed and need_dw:
        exact = dw if q is None else backward_over_rows(dy, x, weight, active.nonzero().squeeze(1), False, True,
                                                        False)[1]
        state.guard = guard_numbers(dw, exact, w, xn2, qa, active, kept, variance_budget(config, state))
    state.armed = False
    if not solved:
        update_cutoff(state, config, w, xn2, qa, dw if need_dw else None)
    return dx, dw, db


def update_cutoff(state: SampleState, config, w: torch.Tensor, xn2: torch.Tensor | None, q: torch.Tensor,
                  dw: torch.Tensor | None) -> None:
    """The layer's cutoff for its next backward, on the device, from this backward's row norms ``w``, keep
    probabilities ``q`` (1 on rows not sampled) and, for ``budget="auto"``, ``xn2`` = ||X_i||² and the sampled
    ``dw`` (None where dW was not asked for: ||G||² is then taken as 0). No host sync. The cutoff is written
    into the layer's tensor in place, so that a CUDA graph's replays read and update the same one."""
    if config.budget == "auto":  # ||G||² from the sample: E||dW||² = ||G||² + V_s
        g_sq = (dw.float() ** 2).sum() - sampling_variance(w, xn2, q) if dw is not None else w.new_zeros(())
        tau = solve_cutoff_for_variance(w, xn2, variance_budget(config, state) * sgd_variance(w, xn2, g_sq))
    else:
        tau = solve_tau(w, layer_share(config, state))
    if state.tau is not None and state.tau.device == tau.device and state.tau.shape == tau.shape:
        state.tau.copy_(tau)
    else:
        state.tau = tau


def variance_budget(config, state: SampleState) -> float:
    """The layer's variance budget (``auto``): the config's ``variance_tau``, or the smaller one the guard gave it."""
    return config.variance_tau if state.var_tau is None else state.var_tau


def layer_share(config, state: SampleState) -> float:
    """A fixed budget's share for the layer: the config's, or the larger one the guard gave it."""
    return float(config.budget) if state.share is None else state.share
