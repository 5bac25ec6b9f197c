"""The gradient-sparsity analysis: model + batches -> collector -> knee -> report, tables, heatmap data.

No CLI code here; :mod:`sebp_probe.cli` only parses, calls and prints.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

import numpy as np
import torch
from torch import nn

from .causes import cause_totals, grouper, layer_causes, layout_advice, packed_issue, type_causes
from .hooks import GradientStats, GradientStatsCollector, LayerStats
from .knee import (
    EpsResult,
    backward_gemm_flops,
    detect_eps,
    padding_waste,
    recommend_top_n,
    rows_above,
)
from ..notes import collect_notes, note
from .report import SCHEMA, SCHEMA_VERSION
from ..model.resprop import ReuseDropCollector

Progress = Callable[[int, int], None]


class AnalysisError(ValueError):
    """An analysis that cannot give a meaningful answer (no batches, NaN gradients...); one line."""


@dataclass(frozen=True)
class AnalyzeSettings:
    """How the analysis runs and turns statistics into settings.

    max_batches: batches to analyse (None: the whole dataset).
    target_modules / exclude_modules: which linears (patterns as in :func:`sebp_probe.patch_model`).
    quantile, margin, tile: N = quantile of per-batch rows above eps, times (1 + margin), rounded up to a
    multiple of tile (the kernels' row block).
    min_gap_decades: the narrowest noise/signal gap that counts as a knee (see :mod:`sebp_probe.analysis.knee`).
    train_mode: run the model in train mode (dropout on), as fine-tuning does.
    reuse: also measure, per layer, what gradient reuse (``finetune --method resprop``) would drop of dL/dY at
    each reuse level, with P from the previous batch's dL/dY (:class:`sebp_probe.ReuseDropCollector`).
    """

    max_batches: int | None = 16
    target_modules: tuple[str, ...] | None = None
    exclude_modules: tuple[str, ...] | None = None
    quantile: float = 0.99
    margin: float = 0.1
    tile: int = 64
    min_gap_decades: float = 1.0
    train_mode: bool = True
    reuse: bool = False

    def __post_init__(self) -> None:
        if self.max_batches is not None and (not isinstance(self.max_batches, int) or self.max_batches < 1):
            raise ValueError(f"max batches must be an integer >= 1, got {self.max_batches}")
        if not 0 < self.quantile <= 1:
            raise ValueError(f"quantile must be in (0, 1], got {self.quantile}")
        if not math.isfinite(self.margin) or self.margin < 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}")
        if not isinstance(self.tile, int) or self.tile < 1:
            raise ValueError(f"tile must be an integer >= 1, got {self.tile}")
        if not math.isfinite(self.min_gap_decades) or self.min_gap_decades <= 0:
            raise ValueError(f"min gap must be > 0 decades, got {self.min_gap_decades}")


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def collect(
    model: nn.Module,
    batches: Iterable[dict],
    settings: AnalyzeSettings = AnalyzeSettings(),
    total: int | None = None,
    progress: Progress | None = None,
    task: str | None = None,
) -> GradientStats:
    """Run forward + backward over ``batches`` (dicts a Hugging Face model takes, with labels) with the
    collector attached; parameters are not updated. Stops after ``settings.max_batches``. ``task`` says
    which rows are label-less (None: guessed from the labels, see :func:`sebp_probe.analysis.causes.grouper`)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.train(settings.train_mode)
    limit = settings.max_batches
    total = min(t for t in (total, limit) if t is not None) if (total or limit) else 0
    groups = grouper(model, task)
    try:
        with GradientStatsCollector(model, settings.target_modules, settings.exclude_modules) as col:
            for i, batch in enumerate(batches):
                if limit is not None and i >= limit:
                    break
                batch = _to_device(batch, device)
                model.zero_grad(set_to_none=True)
                with col.batch(batch.get("attention_mask"), groups(batch)):
                    loss = model(**batch).loss
                    if loss is None:
                        raise AnalysisError("the model returned no loss: the batches need labels")
                    if not loss.requires_grad:
                        raise AnalysisError("the loss does not depend on any trainable parameter "
                                            "(is the whole model frozen?)")
                    if not torch.isfinite(loss):
                        raise AnalysisError(f"the loss is {loss.item()} at batch {i + 1}: NaN/Inf gradients "
                                            "cannot be analysed (check the data and the model's weights)")
                    loss.backward()
                if progress is not None:
                    progress(i + 1, total)
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    stats = col.stats()
    if stats.batches == 0:
        raise AnalysisError("no batches to analyse (empty dataset?)")
    return stats


# --------------------------------------------------------------------------------------------- summary


def layer_type(name: str) -> str:
    """The part of a module name after its layer index: ``bert.encoder.layer.3.attention.self.query`` ->
    ``attention.self.query``; names without an index are kept whole."""
    parts = name.split(".")
    idx = [i for i, p in enumerate(parts) if p.isdigit()]
    return ".".join(parts[idx[-1] + 1:]) if idx and idx[-1] + 1 < len(parts) else name


def by_layer_type(layers: dict) -> dict[str, list]:
    """The values of ``layers`` (keyed by module name) grouped by :func:`layer_type`, in first-seen order."""
    groups: dict[str, list] = {}
    for name, value in layers.items():
        groups.setdefault(layer_type(name), []).append(value)
    return groups


def _spread(values: np.ndarray) -> dict:
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return {"avg": 0.0, "max": 0.0, "min": 0.0}
    return {"avg": float(v.mean()), "max": float(v.max()), "min": float(v.min())}


def _settings_for(layer: LayerStats, eps: EpsResult, s: AnalyzeSettings) -> dict:
    seen = layer.seen
    rows = np.asarray(layer.rows)[seen]
    active = rows_above(layer.octaves(), eps.eps)
    top_n = recommend_top_n(active, int(rows.max()), s.quantile, s.margin, s.tile)
    kept_topk = np.minimum(top_n, rows)
    fl = {
        "dense": backward_gemm_flops(rows, layer.in_features, layer.out_features),
        "threshold": backward_gemm_flops(active, layer.in_features, layer.out_features),
        "topk": backward_gemm_flops(kept_topk, layer.in_features, layer.out_features),
    }
    total_active = int(active.sum())
    return {
        "mode": "threshold" if eps.knee_found else "exact",
        "eps": eps.eps,
        "top_n": top_n,
        "stats": {
            "shape": [layer.in_features, layer.out_features],
            "batches": int(seen.sum()),
            **eps.to_dict(),
            "zero_row_fraction": _spread(layer.zero_row_fraction()),
            "zero_element_fraction": _spread(layer.zero_element_fraction()),
            "active_row_fraction": _spread(active / rows),
            "active_rows": _spread(active),
            "rows_per_batch": int(rows.max()),
            "topk_dropped_active_fraction": float(np.maximum(active - top_n, 0).sum() / total_active)
            if total_active else 0.0,
            "max_abs": float(max(np.asarray(layer.max_abs)[seen])),
            "backward_flops": fl,
            **layer_causes(layer, eps.eps),
        },
    }


def _totals(layers: dict[str, dict]) -> dict:
    fl = {k: sum(e["stats"]["backward_flops"][k] for e in layers.values()) for k in ("dense", "threshold", "topk")}
    dense = fl["dense"] or 1.0
    return {"backward_flops": fl, "saving_threshold": 1 - fl["threshold"] / dense,
            "saving_topk": 1 - fl["topk"] / dense, **cause_totals(layers)}


def _global_setting(stats: GradientStats, names: list[str], s: AnalyzeSettings) -> dict:
    hist = sum(stats.layers[n].row_hist for n in names)
    eps = detect_eps(hist, min_gap_decades=s.min_gap_decades)
    active, rows, fl_dense, fl_thr, fl_topk = [], [], 0.0, 0.0, 0.0
    for n in names:
        lay = stats.layers[n]
        active.append(rows_above(lay.octaves(), eps.eps))
        rows.append(np.asarray(lay.rows)[lay.seen])
    top_n = recommend_top_n(np.concatenate(active), int(max(r.max() for r in rows)), s.quantile, s.margin, s.tile)
    for n, a, r in zip(names, active, rows):
        lay = stats.layers[n]
        fl_dense += backward_gemm_flops(r, lay.in_features, lay.out_features)
        fl_thr += backward_gemm_flops(a, lay.in_features, lay.out_features)
        fl_topk += backward_gemm_flops(np.minimum(top_n, r), lay.in_features, lay.out_features)
    return {
        "mode": "threshold" if eps.knee_found else "exact",
        "eps": eps.eps,
        "top_n": top_n,
        **eps.to_dict(),
        "saving_threshold": 1 - fl_thr / fl_dense,
        "saving_topk": 1 - fl_topk / fl_dense,
    }


def _tokens(stats: GradientStats) -> dict | None:
    if not stats.lengths:
        return None
    lengths = np.concatenate(stats.lengths)
    return {"per_sample": _spread(lengths), "padded_length": _spread(np.asarray(stats.padded_lengths)),
            **padding_waste(stats.lengths, stats.padded_lengths)}


def summarize(stats: GradientStats, settings: AnalyzeSettings = AnalyzeSettings()) -> dict:
    """Per-layer settings and statistics, the global setting, token and FLOP totals (the report's body)."""
    bad = {n: sum(lay.nonfinite_rows) for n, lay in stats.layers.items() if sum(lay.nonfinite_rows)}
    if bad:
        name = next(iter(bad))
        raise AnalysisError(f"NaN/Inf gradients in {len(bad)} layer(s), first {name} ({bad[name]} rows): "
                            "the run diverges; fix it before choosing SEBP settings")
    live = [n for n, lay in stats.layers.items() if lay.seen.any()]
    if not live:
        raise AnalysisError("no target layer received a gradient (are all parameters frozen?)")
    layers = {}
    for n in live:
        lay = stats.layers[n]
        layers[n] = _settings_for(lay, detect_eps(lay.row_hist, min_gap_decades=settings.min_gap_decades), settings)
    return {
        "analysis": {**{k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(settings).items()},
                     "batches": stats.batches, "eps_statistic": "row max |dL/dY|",
                     "layers_without_gradient": [n for n in stats.layers if n not in layers]},
        "tokens": _tokens(stats),
        "global": _global_setting(stats, live, settings),
        "layers": layers,
        "totals": _totals(layers),
    }


def build_report(summary: dict, model_info: dict, dataset_info: dict, padding: dict, layouts: dict | None) -> dict:
    """Wrap a :func:`summarize` result with identities and the layout advice
    (:func:`sebp_probe.analysis.causes.layout_advice`; None without token lengths) into a schema-versioned report."""
    from .._version import __version__

    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "tool_version": __version__,
        "model": model_info,
        "dataset": dataset_info,
        "padding": padding,
        **summary,
        "layouts": layouts,
    }


def layer_type_rows(report: dict) -> list[dict]:
    """One row per layer type for the tables: zero elements / zero rows (avg, max, min over batches and the
    layers of that type), rows by cause, eps range, the largest N, how many layers have a knee, and the share
    of backward GEMM FLOPs the per-layer settings save."""
    rows = []
    for t, entries in by_layer_type(report["layers"]).items():
        st = [e["stats"] for e in entries]
        eps = sorted(e["eps"] for e in entries)
        rows.append({
            "type": t,
            "layers": len(entries),
            "zero_elements": {k: float(np.mean([s["zero_element_fraction"][k] for s in st])) if k == "avg"
                              else (max if k == "max" else min)(s["zero_element_fraction"][k] for s in st)
                              for k in ("avg", "max", "min")},
            "zero_rows": {k: float(np.mean([s["zero_row_fraction"][k] for s in st])) if k == "avg"
                          else (max if k == "max" else min)(s["zero_row_fraction"][k] for s in st)
                          for k in ("avg", "max", "min")},
            "active_rows": float(np.mean([s["active_row_fraction"]["avg"] for s in st])),
            "rows_by_cause": type_causes(st),
            **{f"saving_{k}": 1 - sum(s["backward_flops"][k] for s in st) / max(sum(s["backward_flops"]["dense"]
                                                                                     for s in st), 1.0)
               for k in ("threshold", "topk")},
            "eps": (eps[0], eps[-1]),
            "knees": sum(s["knee_found"] for s in st),
            "top_n": max(e["top_n"] for e in entries),
        })
    return rows


# ------------------------------------------------------------------------------------------ the pipeline


def resolve_device(device: str | None) -> torch.device:
    """``auto``/None -> cuda when available, else cpu; anything else as torch understands it."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for but no CUDA GPU is available")
    return dev


def _limit_samples(data_cfg, max_batches: int | None):
    """Read no more samples than ``max_batches`` batches take (the batches are the first ones, in order)."""
    from dataclasses import replace

    if max_batches is None:
        return data_cfg
    need = max_batches * data_cfg.batch_size
    return replace(data_cfg, max_samples=min(need, data_cfg.max_samples or need))


def load_assets(model_name: str, data_cfg, max_batches: int | None, task: str | None = None):
    """(loaded model, text data, data config), reading only as many samples as ``max_batches`` need.

    The task decides how the data is read and the data decides the classifier's size, so the task is
    guessed from the model's config first.
    """
    from ..data.assets import load_model, model_task
    from ..data.textdata import load_text_data

    cfg = _limit_samples(data_cfg, max_batches)
    task = model_task(model_name, task, cfg.max_length)
    data = load_text_data(cfg, task)
    loaded = load_model(model_name, task=task, num_labels=data.num_labels if task == "classification" else None)
    return loaded, data, cfg


def padding_info(loaded, cfg) -> dict:
    from ..data.textdata import padding_side

    return {"padding": cfg.padding, "max_length": cfg.max_length,
            "padding_side": padding_side(loaded, cfg),
            "batch_size": cfg.batch_size}


def _report_for(loaded, data, cfg, settings: AnalyzeSettings, progress: Progress | None) -> dict:
    from ..data.assets import model_identity
    from ..data.textdata import make_loader

    loader = make_loader(loaded, data, cfg)
    reuse = ReuseDropCollector(loaded.model, settings.target_modules, settings.exclude_modules) \
        if settings.reuse else None
    with reuse or contextlib.nullcontext():
        stats = collect(loaded.model, loader, settings, total=len(loader), progress=progress, task=loaded.task)
    model_info = {"name": loaded.name, "source": loaded.source, "task": loaded.task,
                  **model_identity(loaded.model)}
    summary = summarize(stats, settings)
    layouts = layout_advice(summary, np.concatenate(stats.lengths), cfg.batch_size, cfg.max_length,
                            packed_issue(loaded.model, loaded.task)) if stats.lengths else None
    report = build_report(summary, model_info, data.identity, padding_info(loaded, cfg), layouts)
    if reuse is not None:
        report["reuse"] = reuse_report(reuse)
    return report


def reuse_report(collector: ReuseDropCollector) -> dict:
    """The report's ``reuse`` section: per layer, the mean over batch pairs of |dY - P| / |dY| (``residual``)
    and, per reuse level, the relative norm of dL/dY that ReSprop drops (``dropped``) against dropping as many
    of dY's own smallest rows (``topk_dropped``)."""
    layers = collector.summary()
    if not any(v["steps"] for v in layers.values()):
        raise AnalysisError("--reuse compares each batch's dL/dY with the previous batch's: analyse at least 2 "
                            "batches")
    return {"levels": list(collector.levels), "p_from": "previous batch", "layers": layers}


def reuse_type_rows(reuse: dict) -> list[dict]:
    """The ``reuse`` section per layer type (means over its layers): ``type``, ``layers``, ``residual``,
    ``dropped`` and ``topk_dropped`` per level (keys as in the report: the level as a string)."""
    measured = {name: e for name, e in reuse["layers"].items() if e["steps"]}
    mean = lambda values: float(np.mean(values))  # noqa: E731
    return [{"type": t, "layers": len(es), "residual": mean([e["residual"] for e in es]),
             **{k: {lv: mean([e[k][lv] for e in es]) for lv in es[0][k]} for k in ("dropped", "topk_dropped")}}
            for t, es in by_layer_type(measured).items()]


def analyze(
    model_name: str,
    data_cfg,
    settings: AnalyzeSettings = AnalyzeSettings(),
    task: str | None = None,
    device: str | None = None,
    progress: Progress | None = None,
    on_note: Callable[[str], None] | None = None,
):
    """Load the model and ``data_cfg``'s dataset, collect, summarize; return (report, loaded model). Every note
    (:mod:`.notes`: the data's, a family's fallbacks) goes to ``on_note`` as it is said and into the report's
    ``notes``."""
    with collect_notes(on_note) as notes:
        loaded, data, cfg = load_assets(model_name, data_cfg, settings.max_batches, task)
        for line in data.identity.get("notes", []):
            note(line)
        loaded.model.to(resolve_device(device))
        report = _report_for(loaded, data, cfg, settings, progress)
    report["notes"] = notes
    return report, loaded


def analyze_for_finetune(loaded, data_cfg, settings: AnalyzeSettings = AnalyzeSettings(),
                         progress: Progress | None = None) -> dict:
    """The report for an already loaded model (on its current device), as ``finetune --auto-eps`` needs."""
    from ..data.textdata import load_text_data

    cfg = _limit_samples(data_cfg, settings.max_batches)
    return _report_for(loaded, load_text_data(cfg, loaded.task), cfg, settings, progress)


# ------------------------------------------------------------------------------------------ cost check


def measure_overhead(model: nn.Module, batches: list[dict], rounds: int = 3,
                     settings: AnalyzeSettings = AnalyzeSettings(), amp_dtype: torch.dtype | None = None) -> dict:
    """Median seconds of a plain forward + backward and of the same with the collector, interleaved per
    batch so drift hits both alike; ``ratio`` = collected / plain (the budget is 1.3). ``amp_dtype`` runs
    under autocast (e.g. torch.bfloat16)."""
    import contextlib

    device = next(model.parameters()).device
    batches = [_to_device(b, device) for b in batches]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model.train(settings.train_mode)

    def step(b):
        model.zero_grad(set_to_none=True)
        amp = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
        with amp:
            loss = model(**b).loss
        loss.backward()

    plain, collected = [], []
    groups = grouper(model, None)  # as collect() does: the row groups are part of the cost
    with GradientStatsCollector(model, settings.target_modules, settings.exclude_modules) as col:
        step(batches[0])  # warm-up
        with col.batch(batches[0].get("attention_mask"), groups(batches[0])):
            step(batches[0])
        for _ in range(rounds):
            for b in batches:
                sync()
                t = time.perf_counter()
                step(b)
                sync()
                plain.append(time.perf_counter() - t)
                t = time.perf_counter()
                with col.batch(b.get("attention_mask"), groups(b)):
                    step(b)
                sync()
                collected.append(time.perf_counter() - t)
    model.zero_grad(set_to_none=True)
    p, c = float(np.median(plain)), float(np.median(collected))
    return {"plain_s": p, "collect_s": c, "ratio": c / p, "batches": len(batches), "rounds": rounds,
            "device": str(device), "amp": str(amp_dtype).replace("torch.", "") if amp_dtype else "fp32"}
