"""``sebp-probe grad-stats RUN_DIR``: the gradient statistics a ``finetune --probe-every`` run recorded, as a
table, a figure and (``--json``) a tidy file (device, versions, date, command, one row per step and layer
type)."""
from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from .outputs import check_output_file
from .tables import console
from .train.rundir import METRICS, RUN_CONFIG, SUMMARY, read_json

RUNS = ("dense", "sebp", "resprop")  # the run folders --compare puts under its own
RECORD = "grad_stats"  # analysis.through_training.RECORD (imported lazily: the CLI starts without torch)


def run_folder(run_dir: Path, run: str | None) -> Path:
    """The folder whose metrics.jsonl holds the probes: ``run_dir`` itself, or its ``run`` (default: the
    first of --compare's runs that was probed). A one-line error where there is none."""
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir} is not a run folder of sebp-probe finetune")
    options = [run_dir / r for r in ([run] if run else RUNS)] if not (run_dir / METRICS).exists() else [run_dir]
    for folder in options:
        path = folder / METRICS
        if path.exists() and f'"type": "{RECORD}"' in path.read_text():
            return folder
    raise ValueError(f"{run_dir} holds no gradient statistics: run finetune with --probe-every N")


def _records(folder: Path) -> list[dict]:
    out = []
    for line in (folder / METRICS).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a kill
    return out


def tidy(folder: Path, records: list[dict]) -> dict:
    """The probes as a tidy document: where and how they were measured, and one row per step and layer type."""
    from .analysis.through_training import SHARES, share_key

    cfg, summary = read_json(folder / RUN_CONFIG) or {}, read_json(folder / SUMMARY) or {}
    keys = [share_key(q) for q in SHARES] + ["knee"]

    def row(step: int, e: dict, **where) -> dict:
        out = {"step": step, **where, "rows": e["rows"]}
        out.update({f"{k}_share": v for k, v in (e.get("causes") or {}).items()})
        out.update({k: e.get(k) for k in keys})
        if e.get("nonfinite_rows"):
            out["nonfinite_rows"] = e["nonfinite_rows"]
        return out

    rows, layer_rows = [], []
    for r in records:
        if r.get("type") != RECORD:
            continue
        rows += [row(r["step"], e, layer_type=t, layers=e["layers"]) for t, e in r["types"].items()]
        layer_rows += [row(r["step"], e, layer=name, eps=e.get("eps")) for name, e in r["layers"].items()]
    run_cfg = cfg.get("config", {})
    return {"device": summary.get("device") or cfg.get("device"), "versions": cfg.get("versions"),
            "date": cfg.get("created"), "command": cfg.get("tool", "sebp-probe finetune"), "config": run_cfg,
            "final_eval": summary.get("final_eval"), "status": summary.get("status"),
            "note": "rows_NN: share of a layer type's active rows (mean over its layers) that holds NN% of the "
                    "squared norm of dL/dY, a row's magnitude being its largest |dL/dY|; knee: the same share at "
                    "the knee of the cumulative-energy curve; rows: per layer type, layer_rows: per layer",
            "rows": rows, "layer_rows": layer_rows}


def _table(data: dict) -> Table:
    from .analysis.through_training import share_key

    steps = data["steps"]
    first, last = 0, len(steps) - 1
    table = Table(title=f"active rows holding 90% / 99% of the squared norm, step {steps[first]} -> "
                        f"{steps[last]}", box=None)
    for col in ("layer type", "active %", "90% (rows %)", "99% (rows %)", "knee (rows %)"):
        table.add_column(col, justify="left" if col == "layer type" else "right")

    def pair(vals, scale=100.0):
        a, b = vals[first], vals[last]
        f = lambda v: "-" if v is None else f"{scale * v:.1f}"  # noqa: E731
        return f"{f(a)} -> {f(b)}"

    for t, s in data["types"].items():
        table.add_row(t, pair(s["active"]), pair(s[share_key(0.9)]), pair(s[share_key(0.99)]), pair(s["knee"]))
    return table


def grad_stats_cmd(
    run_dir: Path = typer.Argument(..., help="A finetune --probe-every run folder (-o of finetune)."),
    output: str = typer.Option("grad_stats.png", "--output", "-o", help="Figure: .png, .pdf or .svg."),
    as_json: str = typer.Option(None, "--json", help="Also write the statistics as a tidy JSON file."),
    run: str = typer.Option(None, "--run", help="Of a --compare folder: dense, sebp or resprop (default: the "
                            "first probed)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the output files if they exist."),
) -> None:
    """Draw the gradient statistics of a `finetune --probe-every N` run: per layer type, the share of active
    rows that holds 90% and 99% of the squared norm of dL/dY, over the steps.

    Example: `sebp-probe finetune minilm tweets --probe-every 10 -o runs/p && sebp-probe grad-stats runs/p`
    """
    from .analysis.plots import check_image_path
    from .analysis.through_training import plot_series, series

    if run is not None and run not in RUNS:
        raise ValueError(f"--run must be one of {', '.join(RUNS)}, got {run!r}")
    check_output_file(output, overwrite)
    check_image_path(output)
    if as_json:
        check_output_file(as_json, overwrite, "--json")
    folder = run_folder(Path(run_dir), run)
    records = _records(folder)
    data = series(records)
    console.print(_table(data))
    if data.get("nonfinite_steps"):
        console.print(f"non-finite gradients at step(s) {', '.join(map(str, data['nonfinite_steps']))}",
                      highlight=False)
    cfg = (read_json(folder / RUN_CONFIG) or {}).get("config", {})
    what = f"{cfg.get('model', folder.name)} on {cfg.get('data', {}).get('dataset', '?')}" if cfg else folder.name
    path = plot_series(data, output, f"{what}: dL/dY concentration through training")
    console.print(f"figure written to {path}", highlight=False, soft_wrap=True)
    if as_json:
        Path(as_json).write_text(json.dumps(tidy(folder, records), indent=1) + "\n")
        console.print(f"statistics written to {as_json}", highlight=False, soft_wrap=True)
