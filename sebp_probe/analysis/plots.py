"""Pictures: |dL/dY| heatmaps with the histogram/CDF and its knee (analysis side), fine-tuning curves, and the
whole-model benchmark's step times per layout.

matplotlib is imported inside the functions and used through ``matplotlib.figure.Figure`` (no pyplot), so
importing sebp_probe never touches a display or switches anyone's backend. The file format follows the
extension: .png, .pdf or .svg.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..config import TIMINGS

FORMATS = (".png", ".pdf", ".svg")
ZERO_COLOR = "#d0d0d0"


def check_image_path(path: str | Path) -> Path:
    """The path, if its extension is a supported format; else a one-line ValueError."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"unsupported image format {path.suffix or '(none)'!r} for {path}: use "
                         f"{', '.join(FORMATS)}")
    return path


def save_figure(fig, path: str | Path) -> Path:
    """Write a matplotlib Figure to ``path`` (format from the extension), creating its folder."""
    path = check_image_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130, bbox_inches="tight")
    return path


def _done(fig, path: Path | None):
    """What the plot functions return: the path written, or the Figure when no path was given."""
    return fig if path is None else save_figure(fig, path)


def _short(name: str, keep: int = 4) -> str:
    parts = name.split(".")
    return ".".join(parts[-keep:]) if len(parts) > keep else name


def _heatmap(fig, ax, grad: np.ndarray, length: int, side: str, title: str, norm):
    from matplotlib import colormaps

    cmap = colormaps["magma"].with_extremes(bad=ZERO_COLOR)
    im = ax.imshow(np.ma.masked_less_equal(grad, 0), aspect="auto", interpolation="nearest", cmap=cmap,
                   norm=norm)
    n_tok = grad.shape[0]
    if length < n_tok:  # the border between real tokens and padding
        y = length - 0.5 if side == "right" else n_tok - length - 0.5
        ax.axhline(y, color="#1f77b4", lw=1.2, ls="--")
        ax.text(grad.shape[1] * 0.98, y, "  padding " + ("below" if side == "right" else "above"), color="#1f77b4",
                ha="right", va="top" if side == "right" else "bottom", fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("feature (output column)")
    ax.set_ylabel("token position")
    return im


def _cdf_panel(ax, pic) -> None:
    from .knee import bucket_edges, log_cdf

    edges = bucket_edges()
    for hist, label, color in ((pic.element_hist, "|dL/dY| elements", "#7f7f7f"),
                               (pic.row_hist, "row max |dL/dY|", "#d62728")):
        curve = log_cdf(hist, edges)
        if curve is not None:
            x, cdf, _ = curve
            ax.plot(10.0 ** x, cdf, color=color, lw=1.6, label=f"CDF of {label}")
    curve = log_cdf(pic.row_hist, edges)
    if curve is not None:
        x, _, density = curve
        twin = ax.twinx()
        twin.fill_between(10.0 ** x, density / max(density.max(), 1e-300), step="mid", color="#d62728", alpha=0.15)
        twin.set_ylim(0, 1.05)
        twin.set_yticks([])
    res = pic.eps
    if res.gap is not None:
        ax.axvspan(10.0 ** res.gap[0], 10.0 ** res.gap[1], color="#2ca02c", alpha=0.12, label="noise/signal gap")
    if res.knee_found:
        ax.axvline(10.0 ** res.knee, color="#9467bd", lw=1, ls=":", label=f"knee 1e{res.knee:.2f}")
        ax.axvline(res.eps, color="#2ca02c", lw=1.6, label=f"eps = {res.eps:.3g}")
    else:
        why = res.reason.split(": eps=0")[0]
        ax.text(0.02, 0.5, "no knee, eps = 0 (exact mode):\n" + _wrap(why), transform=ax.transAxes,
                fontsize=8, va="center")
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("magnitude (log)")
    ax.set_ylabel("fraction of non-zero values")
    ax.set_title(f"exact zeros: {pic.zero_elements:.1%} of elements, {pic.zero_rows:.1%} of rows", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3, which="both", lw=0.4)


def _wrap(text: str, width: int = 48) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))


def plot_heatmaps(pictures: list, path: str | Path | None = None, title: str | None = None):
    """One row per layer: |dL/dY| of a short and of a long sample (rows = tokens, columns = features, log
    colour scale, exact zeros grey) and the CDF of |dL/dY| with the knee, gap and eps marked.

    ``pictures``: :class:`sebp_probe.analysis.heatmap.LayerPicture` objects. Returns the path written, or without
    ``path`` the Figure itself (a notebook shows it inline).
    """
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure

    path = check_image_path(path) if path is not None else None
    fig = Figure(figsize=(16, 4.2 * len(pictures)), layout="constrained")
    axes = fig.subplots(len(pictures), 3, squeeze=False, width_ratios=[1, 1, 1.1])
    for row, pic in zip(axes, pictures):
        values = np.concatenate([s[s > 0] for s in pic.samples])
        vmax = float(values.max()) if values.size else 1.0
        vmin = max(float(values.min()) if values.size else vmax * 1e-6, vmax * 1e-12)
        norm = LogNorm(vmin=vmin, vmax=vmax if vmax > vmin else vmin * 10)
        im = None
        for ax, grad, n, label in zip(row[:2], pic.samples, pic.lengths, pic.labels or ["short", "long"]):
            im = _heatmap(fig, ax, grad, n, pic.padding_side,
                          f"{_short(pic.name)}: {label} sample ({n} of {grad.shape[0]} tokens real)", norm)
        fig.colorbar(im, ax=row[:2], label="|dL/dY| (grey: exactly 0)", shrink=0.9, pad=0.01)
        _cdf_panel(row[2], pic)
    if title:
        fig.suptitle(title, fontsize=11)
    return _done(fig, path)


def plot_training_curves(runs: dict, out_dir) -> list:
    """Fine-tuning curves, every run on one plot: ``loss.png`` (train loss per step, raw and a moving mean)
    and ``eval.png`` (held-out accuracy or perplexity, and loss). ``runs``: label -> metrics.jsonl records."""
    import statistics

    from matplotlib.figure import Figure

    out_dir = Path(out_dir)
    paths = []
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    styles = ("-", "--", ":", "-.")  # dashed over solid: identical curves (exact SEBP) stay visible
    for i, (label, recs) in enumerate(runs.items()):
        train = [r for r in recs if r.get("type") == "train"]
        if not train:
            continue
        steps, loss = [r["step"] for r in train], [r["loss"] for r in train]
        w = max(1, len(loss) // 25)
        smooth = [statistics.fmean(loss[max(0, j - w + 1): j + 1]) for j in range(len(loss))]
        line, = ax.plot(steps, smooth, styles[i % 4], label=f"{label} (moving mean of {w})")
        ax.plot(steps, loss, color=line.get_color(), alpha=0.25, linewidth=0.8)
    ax.set(xlabel="optimizer step", ylabel="train loss")
    ax.legend()
    ax.grid(alpha=0.3)
    paths.append(save_figure(fig, out_dir / "loss.png"))

    evals = {k: [r for r in v if r.get("type") == "eval"] for k, v in runs.items()}
    if any(evals.values()):
        metric = "eval_accuracy" if any("eval_accuracy" in r for v in evals.values() for r in v) \
            else "eval_perplexity"
        fig = Figure(figsize=(10, 4))
        axes = fig.subplots(1, 2)
        for i, (label, recs) in enumerate(evals.items()):
            if recs:
                steps = [r["step"] for r in recs]
                kw = dict(linestyle=styles[i % 4], marker="ox+s"[i % 4], label=label)
                axes[0].plot(steps, [r[metric] for r in recs], **kw)
                axes[1].plot(steps, [r["eval_loss"] for r in recs], **kw)
        axes[0].set_ylabel(metric.replace("eval_", "held-out "))
        axes[1].set_ylabel("held-out loss")
        for a in axes:
            a.set_xlabel("optimizer step")
            a.legend()
            a.grid(alpha=0.3)
        paths.append(save_figure(fig, out_dir / "eval.png"))
    return paths


# (method, head) of the benchmark's bars, in drawing order, with colour and hatch
_BENCH_SERIES = ((("dense", "full"), "dense", "#7f7f7f", ""),
                 (("dense", "labelled"), "dense, labelled head", "#bdbdbd", "//"),
                 (("liger", "full"), "Liger-Kernel", "#ff7f0e", ""),
                 (("cce", "labelled"), "Cut-Cross-Entropy", "#2ca02c", "//"),
                 (("sebp", "full"), "SEBP", "#1f77b4", ""),
                 (("sebp", "labelled"), "SEBP, labelled head", "#9ecae1", "//"))


def plot_bench_models(models: list[dict], path: str | Path | None = None):
    """Step milliseconds per layout of each whole-model result (:func:`sebp_probe.bench.bench_model.bench_model`), one
    row of panels per model, one panel per timing (eager, CUDA graphs, compiled): grouped bars of dense,
    Liger-Kernel, Cut-Cross-Entropy and SEBP (full and labelled-rows head), a black tick at each layout's limit
    over its SEBP bar, and the fastest non-SEBP entry of the timing starred with a dashed line across. Returns
    the path written, or without ``path`` the Figure."""
    from matplotlib.figure import Figure

    path = check_image_path(path) if path is not None else None
    timings = [t for t in TIMINGS
               if any(r["timing"] == t for m in models for r in m["rows"])]
    fig = Figure(figsize=(6.5 * max(len(timings), 1), 3.8 * len(models)), layout="constrained")
    axes = fig.subplots(len(models), max(len(timings), 1), squeeze=False)
    for row, m in zip(axes, models):
        layouts = list(m["layouts"])
        for ax, timing in zip(row, timings):
            rows = {(r["layout"], r["method"], r["head"]): r for r in m["rows"] if r["timing"] == timing}
            if not rows:
                ax.set_axis_off()
                ax.text(0.5, 0.5, f"{m['case']['name']}: no {timing} entries", ha="center", transform=ax.transAxes)
                continue
            series = [s for s in _BENCH_SERIES if any((lay, *s[0]) in rows for lay in layouts)]
            width = 0.8 / max(len(series), 1)
            best = m["summary"].get(timing, {}).get("fastest_baseline")
            for i, ((method, head), label, color, hatch) in enumerate(series):
                xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(layouts))]
                ms = [rows[(lay, method, head)]["ms"] if (lay, method, head) in rows else np.nan for lay in layouts]
                ax.bar(xs, ms, width, label=label, color=color, hatch=hatch, edgecolor="white" if not hatch else "#555")
                for x, lay in zip(xs, layouts):
                    lim = next((li["limit_ms"] for li in m["limits"] if (li["layout"], li["head"], li["timing"]) ==
                                (lay, head, timing)), None)
                    if method == "sebp" and lim is not None:
                        ax.hlines(lim, x - width / 2, x + width / 2, color="black", lw=2,
                                  label="limit" if lay == layouts[0] and head == "full" else None)
                    if best and (lay, method, head) == (best["layout"], best["method"], best["head"]):
                        ax.plot(x, best["ms"], marker="*", ms=14, color="#d62728", zorder=5,
                                label=f"fastest non-SEBP ({best['ms']:.1f} ms)")
                        ax.axhline(best["ms"], color="#d62728", lw=1, ls="--")
            ax.set_xticks(range(len(layouts)), layouts)
            ax.set_ylabel("step ms (forward + backward)")
            ax.set_title(f"{m['case']['name']}: {timing}, batch {m['case']['batch']} x {m['case']['max_length']}",
                         fontsize=10)
            ax.legend(fontsize=7, ncols=3, loc="upper center", bbox_to_anchor=(0.5, -0.1))
            ax.grid(alpha=0.3, axis="y")
    return _done(fig, path)
