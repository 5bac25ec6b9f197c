"""Fine-tuning step time on the CPU for every padding layout, dense and with SEBP, against --padding auto.

    python benchmarks/finetune_cpu.py --out results/finetune_cpu/finetune_cpu.json

The bundled all-MiniLM-L6-v2 on the bundled tweets (batch 32, max length 128, exact SEBP, the default
labelled head), ``--steps`` optimizer steps per run, one run per (layout, method) and one ``auto`` run, all
from the same seed and data, one after another in this process. A run's step time is its median over the
steps after the warm-up ones (what ``summary.json`` reports); the auto run's table of what it timed before
training is kept too (the first run's). With ``--repeats R`` each configuration runs R times, the order
reversed every other round, and the table gives the mean. The JSON names the CPU, the versions, the date and
this command.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: the repository's packages

from sebp_probe.config import AUTO, DataConfig, FinetuneConfig  # noqa: E402
from sebp_probe.train.finetune import finetune  # noqa: E402
from sebp_probe.layouts import LAYOUTS  # noqa: E402
from sebp_probe.train.rundir import device_name, versions  # noqa: E402


def run(args, padding: str, method: str, out: Path) -> dict:
    data = DataConfig(dataset="tweets", max_length=args.max_length, batch_size=args.batch_size, padding=padding,
                      max_samples=args.train_samples)
    cfg = FinetuneConfig(model="minilm", data=data, method=method, output_dir=str(out / f"{padding}-{method}"),
                         max_steps=args.steps, eval_steps=args.steps, eval_samples=args.eval_samples, seed=0)
    s = finetune(cfg)
    row = {"padding": padding, "method": s["method"], "asked": method, "steps": s["steps"],
           "median_step_ms": round(s["median_step_ms"], 2), "median_backward_ms": round(s["median_backward_ms"], 2),
           "final_train_loss": round(s["final_train_loss"], 4), "run_padding": s["padding"],
           "sebp_layers": len((s.get("calibration") or {}).get("layers", {})), "head": s["head"]}
    if "padding_choice" in s:
        row["padding_choice"] = s["padding_choice"]
    print(json.dumps({k: v for k, v in row.items() if k != "padding_choice"}), flush=True)
    return row


def combine(rs: list[dict]) -> dict:
    """One row per configuration: the first run's fields, ``median_step_ms`` and ``median_backward_ms`` the mean
    over the runs (each a median over its steps), every run's step time in ``runs_step_ms`` and, for auto, every
    run's choice in ``choices``."""
    row = dict(rs[0])
    for key in ("median_step_ms", "median_backward_ms"):
        row[key] = round(sum(r[key] for r in rs) / len(rs), 2)
    row["runs_step_ms"] = [r["median_step_ms"] for r in rs]
    if "padding_choice" in row:
        row["choices"] = [f"{r['run_padding']}, {r['method']}" for r in rs]
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--train-samples", type=int, default=4000)
    p.add_argument("--eval-samples", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=1, help="runs per configuration, in the listed order, then "
                   "reversed, and so on: a steady drift of the machine's speed cancels in the mean")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    configs = [(padding, method) for padding in LAYOUTS for method in ("dense", "sebp")] + [(AUTO, "sebp")]
    runs: dict[tuple[str, str], list[dict]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for padding, method in (configs if r % 2 == 0 else configs[::-1]):
                runs[(padding, method)].append(run(args, padding, method, Path(tmp) / str(r)))
    rows = [combine(rs) for rs in runs.values()]
    env = {"device": device_name(torch.device("cpu")),
           **versions(), "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "command": " ".join(["python", *sys.argv])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"environment": env, "settings": vars(args), "runs": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
