"""Gradient statistics through training: what one step's backward holds, step after step.

The collector of ``analyze`` (:mod:`sebp_probe.analysis.hooks`) runs on a training step's own backward; this
module turns what it gathered into one record per probed step, per layer and per layer type:

* rows by cause (:mod:`sebp_probe.analysis.causes`: padding, label-less, other zero, near zero, active), eps
  from the step's own histogram (:func:`~sebp_probe.analysis.knee.detect_eps`);
* how concentrated the active rows are: the share of them that holds 50 / 90 / 99% of the squared norm, and
  the knee of that cumulative-energy curve (kneed, concave: the share of rows past which rows add little
  energy, the per-layer top-N a sampled backward would keep).

A row's magnitude is what the collector buckets, its largest |dL/dY| (the quantity eps and top-N compare), so
its energy here is that maximum squared: the histograms (8 buckets per octave) are weighted by the mean square
of each bucket (magnitudes log-uniform inside it), the rows sorted largest first. Where padding rows are not
all zero, the real rows come from the octave histograms (coarser: one bucket per octave).

Counts of several processes add up before any of this (:meth:`StepCounts.pack`): a reduced record is the
record of all processes' rows together.

A record is made on the host after its step, once per probed step, so all layers' numbers are found together
in array operations (:func:`~sebp_probe.analysis.knee.detect_eps_rows`, :func:`concentrations`,
:func:`concave_knees`): each layer's are those it gets alone, kneed's knee included.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .analyze import by_layer_type
from .causes import CAUSES, LABEL_LESS, PADDING
from .grad_records import _GROUPS_AT, _N_SCALARS, _NONFINITE_ROWS, N_GROUPS, GradientStats, Totals
from .knee import (N_FINE, N_OCTAVE, OCTAVE_SHIFT, FINE_SHIFT, bucket_edges, detect_eps_rows, lower_edges,
                   octave_histogram)

RECORD = "grad_stats"  # the ``type`` of a probed step's line in metrics.jsonl
SHARES = (0.5, 0.9, 0.99)  # energy shares whose row shares a record holds
KNEE_POINTS = 201  # the cumulative-energy curve is sampled at this many row shares for kneed


def share_key(q: float) -> str:
    """``rows_90`` for 0.9: the record key of the share of active rows holding ``q`` of the energy."""
    return f"rows_{round(q * 100):d}"


@dataclass
class StepCounts:
    """One probed step's raw counts, per layer (all micro-batches together): rows, non-finite rows, the fine
    histogram of the rows' max |g| and each row group's octave histogram."""

    names: list[str]
    rows: np.ndarray  # (L,)
    nonfinite: np.ndarray  # (L,)
    fine: np.ndarray  # (L, N_FINE)
    groups: np.ndarray  # (L, N_GROUPS, N_OCTAVE)

    _WIDTH = 2 + N_FINE + N_GROUPS * N_OCTAVE

    def pack(self) -> np.ndarray:
        """(L, width) int64: what an all-reduce (a sum) over processes takes, in one tensor."""
        n = len(self.names)
        return np.concatenate([self.rows[:, None], self.nonfinite[:, None], self.fine,
                               self.groups.reshape(n, -1)], axis=1).astype(np.int64)

    @classmethod
    def unpack(cls, names: list[str], packed: np.ndarray) -> "StepCounts":
        p = np.asarray(packed, dtype=np.int64)
        return cls(list(names), p[:, 0], p[:, 1], p[:, 2:2 + N_FINE],
                   p[:, 2 + N_FINE:].reshape(len(names), N_GROUPS, N_OCTAVE))


def step_counts(stats: GradientStats) -> StepCounts:
    """The collector's batches (a step's micro-batches) summed per layer."""
    names = list(stats.layers)
    rows, nonfinite, groups = [], [], []
    for layer in stats.layers.values():
        rows.append(int(np.sum(layer.rows)))
        nonfinite.append(int(np.sum(layer.nonfinite_rows)))
        g = layer.group_octaves_seen()
        groups.append(g.sum(axis=0) if len(g) else np.zeros((N_GROUPS, N_OCTAVE), dtype=np.int64))
    fine = np.stack([np.asarray(layer.row_hist, dtype=np.int64) for layer in stats.layers.values()])
    return StepCounts(names, np.asarray(rows, dtype=np.int64), np.asarray(nonfinite, dtype=np.int64), fine,
                      np.stack(groups).astype(np.int64))


def totals_counts(names: list[str], t: Totals) -> StepCounts:
    """The counts of a window the collector accumulated on the device (a step's micro-batches together): what
    :func:`step_counts` gives for the same micro-batches recorded one by one."""
    s = t.stats
    return StepCounts(list(names), np.asarray(t.rows, dtype=np.int64), s[:, _NONFINITE_ROWS].astype(np.int64),
                      s[:, _N_SCALARS:_GROUPS_AT].astype(np.int64),
                      s[:, _GROUPS_AT:].reshape(len(names), N_GROUPS, N_OCTAVE).astype(np.int64))


def _bucket_energy(shift: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(finite, mean square, upper edge) per bucket: whether the bucket holds finite non-zero values, the mean of
    m**2 for m log-uniform between its edges, and its upper edge (:func:`~sebp_probe.analysis.knee.bucket_edges`)."""
    hi = bucket_edges(shift)
    lo = lower_edges(hi)
    finite = np.isfinite(hi) & (lo > 0) & np.isfinite(lo)
    finite[0] = False
    energy = np.zeros_like(hi)
    h, lw = hi[finite], lo[finite]
    energy[finite] = (h * h - lw * lw) / (2.0 * np.log(h / lw))
    return finite, energy, hi


_ENERGY = {s: _bucket_energy(s) for s in (FINE_SHIFT, OCTAVE_SHIFT)}


def concave_knees(x: np.ndarray, ys: np.ndarray, sensitivity: float = 1.0) -> list[float | None]:
    """x of the knee of each row of ``ys`` (increasing concave curves over the same increasing ``x``; None without
    one): what kneed's ``KneeLocator(x, y, S=sensitivity, curve="concave", direction="increasing").knee`` gives,
    in a few array operations for all rows: its offline Kneedle, step for step.

    The difference curve of the normalized curve, its local maxima and minima (neighbours compared with >= and
    <=, an end against its one neighbour), and the first point after a maximum, with no minimum since, whose
    next point falls below that maximum's threshold (its height less ``sensitivity`` times the mean x step):
    the knee is that maximum's x.
    """
    x = np.asarray(x, dtype=float)
    ys = np.asarray(ys, dtype=float)
    if len(x) < 3 or np.ptp(x) <= 0:
        return [None] * len(ys)
    xn = (x - x.min()) / (x.max() - x.min())
    lo, hi = ys.min(axis=1, keepdims=True), ys.max(axis=1, keepdims=True)
    flat = (hi <= lo)[:, 0]
    with np.errstate(invalid="ignore", divide="ignore"):
        diff = (ys - lo) / (hi - lo) - xn
    prev = np.concatenate([diff[:, :1], diff[:, :-1]], axis=1)
    nxt = np.concatenate([diff[:, 1:], diff[:, -1:]], axis=1)
    is_max = (diff >= prev) & (diff >= nxt)
    is_min = (diff <= prev) & (diff <= nxt)
    idx = np.arange(len(x))
    last_max = np.maximum.accumulate(np.where(is_max, idx, -1), axis=1)
    last_min = np.maximum.accumulate(np.where(is_min, idx, -1), axis=1)
    active = (last_max >= 0) & (last_max > last_min)  # a point both a maximum and a minimum counts as a minimum
    threshold = np.take_along_axis(diff, np.maximum(last_max, 0), axis=1) - sensitivity * np.abs(np.diff(xn).mean())
    hit = active[:, :-1] & (diff[:, 1:] < threshold[:, :-1])  # the last point ends the walk
    found = hit.any(axis=1) & ~flat
    at = np.take_along_axis(last_max[:, :-1], np.argmax(hit, axis=1)[:, None], axis=1)[:, 0]
    return [float(x[a]) if f else None for a, f in zip(at.tolist(), found.tolist())]


def concentrations(counts: np.ndarray, shift: int, eps) -> list[dict | None]:
    """Per row of ``counts`` (magnitude histograms x buckets), of its rows above ``eps[i]``: the share holding
    each of :data:`SHARES` of the squared norm, and the knee of the cumulative-energy curve (``knee``: share of
    rows; ``knee_rows``); None without such rows. In a few array operations for all rows. A row's curve: its
    cumulative rows and energy over its finite non-zero buckets above its eps, the largest magnitudes first,
    from 0; it runs over the buckets any row keeps, a bucket another row keeps adding nothing to it (so a row's
    numbers are those it has alone)."""
    finite, energy, edges = _ENERGY[shift]
    counts = np.asarray(counts)
    keep = finite & (edges > np.asarray(eps, dtype=np.float64)[:, None]) & (counts > 0)
    cols = np.flatnonzero(keep.any(axis=0))[::-1]  # the largest magnitudes first
    out: list = [None] * len(counts)
    live = np.flatnonzero(keep[:, cols].any(axis=1))
    if not len(live):
        return out
    c = np.where(keep[live][:, cols], counts[live][:, cols], 0).astype(np.float64)
    zero = np.zeros((len(live), 1))
    rows = np.concatenate((zero, np.cumsum(c, axis=1)), axis=1)
    cum = np.concatenate((zero, np.cumsum(c * energy[cols], axis=1)), axis=1)
    total, full = rows[:, -1], cum[:, -1]
    # rows (interpolated inside a bucket, whose rows count as equal) holding each share of the energy
    target = np.asarray(SHARES)[None, :] * full[:, None]
    k = np.clip((cum[:, None, :] < target[:, :, None]).sum(axis=2), 1, cum.shape[1] - 1)
    e0, e1 = np.take_along_axis(cum, k - 1, axis=1), np.take_along_axis(cum, k, axis=1)
    r0, r1 = np.take_along_axis(rows, k - 1, axis=1), np.take_along_axis(rows, k, axis=1)
    step = e1 - e0
    frac = np.divide(target - e0, step, out=np.ones_like(step), where=step > 0)
    shares = (r0 + frac * (r1 - r0)) / total[:, None]
    x = np.linspace(0.0, 1.0, KNEE_POINTS)
    ys = np.stack([np.interp(x * t, r, e) / f for t, r, e, f in zip(total, rows, cum, full)])
    for i, t, share, knee in zip(live.tolist(), total.tolist(), shares.tolist(), concave_knees(x, ys)):
        out[i] = {**dict(zip(map(share_key, SHARES), share)), "knee": knee,
                  "knee_rows": None if knee is None else int(math.ceil(knee * t))}
    return out


def step_record(c: StepCounts, step: int, min_gap_decades: float = 1.0) -> dict:
    """The metrics.jsonl line of a probed step (``type`` :data:`RECORD`): per layer (rows, rows by cause as
    shares, eps and the concentration) and per layer type. Every layer's eps and concentration are found
    together (:func:`~sebp_probe.analysis.knee.detect_eps_rows`, :func:`concentrations`)."""
    layers: list[dict] = [{"rows": int(r)} for r in c.rows]
    for i in np.flatnonzero((c.rows > 0) & (c.nonfinite > 0)):  # no energy to speak of: the counts say how many
        layers[i]["nonfinite_rows"] = int(c.nonfinite[i])  # rows, the run decides what to do
    live = np.flatnonzero((c.rows > 0) & (c.nonfinite == 0))
    if len(live):
        eps = np.array([r.eps for r in detect_eps_rows(c.fine[live], min_gap_decades=min_gap_decades)])
        octaves = octave_histogram(c.fine[live])
        pad, label_less = c.groups[live, PADDING - 1], c.groups[live, LABEL_LESS - 1]
        real = octaves - pad
        active = np.where(_ENERGY[OCTAVE_SHIFT][2][1:] > eps[:, None], real[:, 1:], 0).sum(axis=1)
        by = {"padding": pad.sum(axis=1), "label_less": label_less[:, 0],
              "other_zero": octaves[:, 0] - pad[:, 0] - label_less[:, 0],
              "near_zero": real[:, 1:].sum(axis=1) - active, "active": active}
        shares = {k: (v / c.rows[live]).tolist() for k, v in by.items()}
        # every padding row zero: the fine histogram's non-zero rows are all real; else the octave histograms'
        fine = pad[:, 1:].sum(axis=1) == 0
        for j, (i, e, f) in enumerate(zip(live.tolist(), eps.tolist(), fine.tolist())):
            layers[i].update(eps=e, causes={k: v[j] for k, v in shares.items()}, resolution="fine" if f else "octave")
        for shift, pick, hists in ((FINE_SHIFT, fine, c.fine[live]), (OCTAVE_SHIFT, ~fine, real)):
            if pick.any():
                for i, conc in zip(live[pick].tolist(), concentrations(hists[pick], shift, eps[pick])):
                    if conc is not None:
                        layers[i].update(conc)
    named = dict(zip(c.names, layers))
    rec = {"type": RECORD, "step": step, "layers": named,
           "types": {t: _type_entry(es) for t, es in by_layer_type(named).items()}}
    bad = int(c.nonfinite.sum())
    if bad:
        rec["nonfinite_rows"] = bad
    return rec


def _type_entry(entries: list[dict]) -> dict:
    """A layer type: the mean of its layers' shares (layers without active rows left out of the
    concentration), the sum of their rows and non-finite rows."""
    live = [e for e in entries if e.get("causes")]
    out: dict = {"layers": len(entries), "rows": sum(e["rows"] for e in entries)}
    bad = sum(e.get("nonfinite_rows", 0) for e in entries)
    if bad:
        out["nonfinite_rows"] = bad
    if live:
        out["causes"] = {k: float(np.mean([e["causes"][k] for e in live])) for k in CAUSES}
    for key in [share_key(q) for q in SHARES] + ["knee"]:
        vals = [e[key] for e in live if e.get(key) is not None]
        if vals:
            out[key] = float(np.mean(vals))
    return out


def series(records: list[dict]) -> dict:
    """The probed steps of a run's records as series per layer type: ``{"steps": [...], "types": {type: {key:
    [...]}}}``, a value None where a step had none (a layer type without active rows, non-finite rows)."""
    probes = [r for r in records if r.get("type") == RECORD]
    steps = [r["step"] for r in probes]
    keys = [share_key(q) for q in SHARES] + ["knee"]
    types: dict[str, dict] = {}
    for r in probes:
        for t in r["types"]:
            types.setdefault(t, {})
    for t, out in types.items():
        for k in keys:
            out[k] = [r["types"].get(t, {}).get(k) for r in probes]
        for cause in CAUSES:
            out[cause] = [r["types"].get(t, {}).get("causes", {}).get(cause) for r in probes]
    out = {"steps": steps, "types": types}
    bad = [r["step"] for r in probes if r.get("nonfinite_rows")]
    if bad:
        out["nonfinite_steps"] = bad
    return out


def plot_series(data: dict, path, title: str | None = None):
    """The figure of a run's probes: per layer type, the share of active rows holding 90% (solid) and 99%
    (dashed) of the squared norm of dL/dY, over the steps."""
    from .plots import save_figure

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.5, 4.2))
    steps = data["steps"]
    for i, (t, s) in enumerate(data["types"].items()):
        colour = f"C{i % 10}"
        for key, style in ((share_key(0.9), "-"), (share_key(0.99), "--")):
            ys = [np.nan if v is None else 100 * v for v in s[key]]
            ax.plot(steps, ys, style, color=colour, marker=".", label=t if style == "-" else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("active rows holding 90% / 99%\nof the squared norm (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="solid 90%, dashed 99%",
              title_fontsize=7)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)
