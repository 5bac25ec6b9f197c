"""The JSON report: the one contract between ``analyze`` and ``finetune``.

A report (schema version 2) is a JSON object::

    {
      "schema": "sebp-probe/report", "schema_version": 2, "created": ISO time, "tool_version": "0.1.0",
      "model":   {"name", "source", "task", "model_type", "architecture", "linear_fingerprint", ...},
      "dataset": {"name", "source", "split", "num_samples", "columns", ...},
      "padding": {"padding", "max_length", "padding_side", "batch_size"},
      "analysis": {how it was run: batches, quantile, margin, tile, ...},
      "tokens":  {per-sample lengths and padding waste},
      "global":  {"eps", "top_n", "knee_found", "reason", ...},     # one setting for every layer
      "layers":  {"<full module name>": {"mode", "eps", "top_n", "stats": {...}}, ...},
      "totals":  {backward GEMM FLOPs, dense vs the recommended settings, and by cause},
      "layouts": {per padding layout: padding left and what SEBP skips on top; "recommendation"} or null
    }

Per layer, ``mode``/``eps``/``top_n`` are exactly what :class:`sebp_kernels.SEBPConfig` takes; ``stats``
holds the measurements behind them, including ``shape`` = [in_features, out_features] and the rows of
dL/dY by cause (``rows_by_cause``: padding, label_less, other_zero, near_zero, active; see
:mod:`sebp_probe.analysis.causes`).

Version 2 added ``layouts`` (required), the per-layer ``rows_by_cause``, ``label_less_positions``,
``padding_not_zero`` and ``backward_flops_by_cause``, and the totals' ``backward_flops_by_cause`` and
``share_by_cause``. Version 1 reports still load: what ``finetune`` takes from a report is in both.

Consumers need four functions: :func:`load_report`, :func:`check_report_for_model`,
:func:`layer_configs_from_report` (-> ``patch_model(model, layer_configs=...)``) and :func:`save_report`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from torch import nn

from sebp_kernels import SEBPConfig

from ..model.linears import features, is_linear

SCHEMA = "sebp-probe/report"
SCHEMA_VERSION = 2
REQUIRED = {1: ("model", "dataset", "padding", "global", "layers"),
            2: ("model", "dataset", "padding", "global", "layers", "layouts")}  # by schema version: all it reads
MODES = ("recommended", "exact", "threshold", "topk")


class ReportError(ValueError):
    """A report that cannot be read or does not fit the model; the message is one line."""


def save_report(report: dict, path: str | os.PathLike) -> Path:
    """Write ``report`` as JSON (strict: no NaN), atomically, with the permissions of any other new file (the
umask's); return the path."""
    path = Path(path)
    text = json.dumps(report, indent=2, allow_nan=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def validate_report(report: object, where: str = "report") -> dict:
    """Check the schema and every per-layer setting; return the report."""
    if not isinstance(report, dict) or report.get("schema") != SCHEMA:
        raise ReportError(f"{where} is not a sebp-probe report (no \"schema\": \"{SCHEMA}\")")
    version = report.get("schema_version")
    if version not in REQUIRED or isinstance(version, bool):
        raise ReportError(f"{where} has schema version {version!r}; this sebp-probe reads versions "
                          f"{', '.join(map(str, REQUIRED))}: run `sebp-probe analyze` again")
    missing = [k for k in REQUIRED[version] if k not in report]
    if missing:
        raise ReportError(f"{where} lacks {', '.join(repr(k) for k in missing)}")
    layers = report["layers"]
    if not isinstance(layers, dict) or not layers:
        raise ReportError(f"{where} has no per-layer settings")
    for name, entry in layers.items():
        if not isinstance(entry, dict):
            raise ReportError(f"{where}: layer {name!r} is not an object")
        try:
            SEBPConfig.from_dict({k: entry.get(k) for k in ("mode", "eps", "top_n")})
            if entry.get("top_n") is None:
                raise ValueError("top_n is missing")
        except (TypeError, ValueError) as e:
            raise ReportError(f"{where}: layer {name!r}: {e}") from None
    glob = report.get("global")
    if not isinstance(glob, dict) or any(k not in glob for k in ("mode", "eps", "top_n")):
        raise ReportError(f"{where}: the global setting needs mode, eps and top_n")
    try:
        SEBPConfig.from_dict({k: glob[k] for k in ("mode", "eps", "top_n")})
    except (TypeError, ValueError) as e:
        raise ReportError(f"{where}: global setting: {e}") from None
    return report


def load_report(path: str | os.PathLike) -> dict:
    """Read and validate a report; a missing, corrupt or wrong-version file raises one clear line."""
    path = Path(path)
    if not path.exists():
        raise ReportError(f"report {path} does not exist (make one with `sebp-probe analyze --output {path}`)")
    if path.is_dir():
        raise ReportError(f"report {path} is a directory, not a JSON file")
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ReportError(f"report {path} is not a text file") from None
    except json.JSONDecodeError as e:
        raise ReportError(f"report {path} is not valid JSON (line {e.lineno}: {e.msg})") from None
    return validate_report(report, f"report {path}")


def linear_name(modules: dict[str, nn.Module], name: str) -> str | None:
    """The name of the linear (nn.Linear, Conv1D) that a report's layer name (of the plain model) stands for in a
    model: the name itself, or inside a peft wrapper (``base_model.model.`` prefix, ``.base_layer`` suffix)."""
    for prefix in ("", "base_model.model."):
        for suffix in (".base_layer", ""):
            m = modules.get(f"{prefix}{name}{suffix}")
            if m is not None and is_linear(m):
                return f"{prefix}{name}{suffix}"
    return None


def check_report_for_model(report: dict, model: nn.Module) -> None:
    """Raise ReportError (one line) unless every layer of the report is a linear of ``model`` with the
    report's shape and the model types agree. A fine-tuned copy or a LoRA-wrapped copy of the analyzed
    model passes; another architecture or size does not."""
    made_for = report.get("model", {})
    label = made_for.get("name") or made_for.get("model_type") or "another model"
    want_type = made_for.get("model_type")
    have_type = getattr(getattr(model, "config", None), "model_type", None)
    if want_type and have_type and want_type != have_type:
        raise ReportError(f"the report was made for {label} ({want_type}), not for this {have_type} model")
    config = getattr(model, "config", None)
    for key in ("num_hidden_layers", "hidden_size"):  # same type and shapes, but a deeper or wider model
        want, have = made_for.get(key), getattr(config, key, None)
        if want is not None and have is not None and want != have:
            raise ReportError(f"the report was made for {label} with {key} {want}; this model has {have}")
    modules = dict(model.named_modules())
    for name, entry in report["layers"].items():
        real = linear_name(modules, name)
        m = modules[real] if real is not None else None
        if m is None:
            raise ReportError(f"the report was made for {label}: this model has no linear layer {name!r}")
        shape = entry.get("stats", {}).get("shape")
        have = list(features(m))
        if shape is not None and list(shape) != have:
            raise ReportError(f"the report was made for {label}: layer {name!r} is {have[0]}x{have[1]} here, "
                              f"{shape[0]}x{shape[1]} in the report")


def layer_configs_from_report(
    report: dict,
    mode: str | None = None,
    use_global: bool = False,
    backend: str = "auto",
) -> dict[str, SEBPConfig]:
    """Module name -> SEBPConfig for ``patch_model(model, layer_configs=...)``.

    mode: ``None``/``recommended`` (each layer's recommended mode: ``threshold`` where a knee was found,
    else ``exact``), or ``exact``, ``threshold``, ``topk`` for every layer. ``use_global`` takes eps and N
    from the report's global setting instead of each layer's own.
    """
    mode = mode or "recommended"
    if mode not in MODES:
        raise ReportError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    glob = report["global"]
    configs = {}
    for name, entry in report["layers"].items():
        eps = glob["eps"] if use_global else entry["eps"]
        top_n = glob["top_n"] if use_global else entry["top_n"]
        m = entry["mode"] if mode == "recommended" else mode
        if use_global and mode == "recommended":
            m = "threshold" if glob.get("knee_found") else "exact"
        configs[name] = SEBPConfig(mode=m, eps=float(eps), top_n=int(top_n), backend=backend)
    return configs
