"""Collect `finetune` runs of dense against `--mode sampled` into one tidy results file.

Each run directory is a `finetune ... -o DIR` (a `--compare` directory holds `dense/` and `sebp/`, each of which
may also be given alone); per run the file keeps the arm, seed, held-out accuracy and loss, the step and
backward medians, and the sampled layers' measured rows (skipped share of the non-zero rows of dL/dY in dW/db,
after the warm-up), then the mean and sd of each arm. An arm trained again from one seed (the dense arm of two
`--compare` runs) counts once, as first given. The runs themselves were started by the command recorded in
``--command``.

    python benchmarks/sampled_quality.py --out results/sampled.json \
        --command "..." RUN_DIR [RUN_DIR ...]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
from pathlib import Path

from sebp_probe.config import FinetuneConfig


def _runs(path: Path) -> list[Path]:
    return [p for p in (path / "dense", path / "sebp") if (p / "summary.json").exists()] or [path]


def _run_config(run: Path) -> dict:
    """A run's run_config.json: its own, or its `--compare` folder's (an arm given by itself too)."""
    own = run / "run_config.json"
    return json.loads((own if own.exists() else run.parent / "run_config.json").read_text())


def _row(run: Path) -> dict:
    s = json.loads((run / "summary.json").read_text())
    cfg = _run_config(run)["config"]
    smp = s.get("sampled")
    if s["method"] == "dense" or not smp:
        arm = s["method"]
    elif smp["budget"] != "auto":
        arm = f"sampled {format(smp['budget'], 'g')}"
    else:  # auto's variance budget, when it is not the run's default
        tau = smp.get("variance_tau", FinetuneConfig.variance_tau)
        arm = "sampled auto" + ("" if tau == FinetuneConfig.variance_tau else f" (tau {format(tau, 'g')})")
    if smp and smp.get("sample_dx"):
        arm += ", dX sampled"
    return {"arm": arm, "seed": cfg["seed"], "status": s["status"], "steps": s["steps"],
            "eval_accuracy": s["final_eval"].get("eval_accuracy"), "eval_loss": s["final_eval"].get("eval_loss"),
            "final_train_loss": s.get("final_train_loss"), "median_step_ms": s.get("median_step_ms"),
            "median_backward_ms": s.get("median_backward_ms"), "device": s.get("device"),
            "skipped_of_nonzero": smp["skipped_of_nonzero"] if smp else 0.0,
            "skipped_of_rows": smp["skipped_of_rows"] if smp else None,
            "sampled_rows": {k: smp[k] for k in ("rows", "nonzero", "kept")} if smp else None,
            "guard": {k: smp["guard"][k] for k in ("checks", "min_cosine", "median_rel_error", "over_budget",
                                                  "layer_checks")} | {"layers_raised": len(smp["guard"]["raised"])}
            if smp and smp.get("guard") else None,
            "run_dir": str(run)}


def _arms(rows: list[dict]) -> list[dict]:
    out = []
    for arm in dict.fromkeys(r["arm"] for r in rows):
        rs = [r for r in rows if r["arm"] == arm]
        acc = [r["eval_accuracy"] for r in rs if r["eval_accuracy"] is not None]
        loss = [r["eval_loss"] for r in rs]
        sd = lambda xs: statistics.stdev(xs) if len(xs) > 1 else None  # noqa: E731
        out.append({"arm": arm, "seeds": sorted(r["seed"] for r in rs),
                    "eval_accuracy_mean": statistics.mean(acc) if acc else None, "eval_accuracy_sd": sd(acc),
                    "eval_loss_mean": statistics.mean(loss), "eval_loss_sd": sd(loss),
                    "skipped_of_nonzero_mean": statistics.mean(r["skipped_of_nonzero"] for r in rs),
                    "median_step_ms_mean": statistics.mean(r["median_step_ms"] for r in rs)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--command", required=True, help="the command that trained the runs")
    args = ap.parse_args(argv)
    from sebp_probe.train.rundir import versions

    first: dict[tuple, dict] = {}  # one row an arm and seed: the first given
    for row in (_row(r) for d in args.dirs for r in _runs(d)):
        first.setdefault((row["arm"], row["seed"]), row)
    rows = list(first.values())
    created = min(_run_config(r).get("created", "") for d in args.dirs for r in _runs(d))
    doc = {"environment": {"device": rows[0]["device"], **versions(), "date": created,
                           "collected": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                           "command": args.command},
           "arms": _arms(rows), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    for a in doc["arms"]:
        sd = "-" if a["eval_accuracy_sd"] is None else f"{a['eval_accuracy_sd']:.3f}"
        acc = "-" if a["eval_accuracy_mean"] is None else f"{a['eval_accuracy_mean']:.3f}"
        print(f"{a['arm']:>13}: acc {acc} +- {sd}, loss {a['eval_loss_mean']:.4f} over seeds {a['seeds']}, "
              f"skipped {100 * a['skipped_of_nonzero_mean']:.1f}% of non-zero rows, step {a['median_step_ms_mean']:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
