"""Gather the --compare pairs of benchmarks/compare_session.sh (each run's summary.json, metrics.jsonl and
run_config.json, as the session packed them into compare_raw.tgz) into one JSON for the docs: per pair and
order the verdict, the step and backward ratios with each run's median and interquartile range, the steps timed
in both runs and the seconds left out (warm-up, compiles), the largest loss gap and how many layers ran SEBP.

Usage: python benchmarks/compare_collect.py OUT_JSON RAW.tgz [RAW.tgz ...]   (later archives add their pairs)
"""
from __future__ import annotations

import json
import sys
import tarfile
import tempfile
from pathlib import Path

PAIRS = {"eager": "longest, eager (SEBP on 0 layers: the same computation)",
         "compile": "longest, --compile default (SEBP on 0 layers: the same computation)",
         "padded": "max_length, --cuda-graphs",
         "forced": "longest, eager, SEBP forced on every projection"}


def _run(raw: Path, name: str) -> dict | None:
    d = raw / name
    if not (d / "summary.json").exists():
        return None
    top = json.loads((d / "summary.json").read_text())
    cfg = json.loads((d / "run_config.json").read_text())
    cmp = top["comparison"]
    t = cmp["timing"]
    sebp = top["runs"]["sebp"]
    calib = sebp.get("calibration") or {}
    return {"order": top["order"], "verdict": cmp["verdict"], "timed_steps": t["timed_steps"],
            "step": t.get("step"), "backward": t.get("backward"), "max_abs_loss_gap": cmp.get("max_abs_loss_gap"),
            "sebp_layers": len(calib.get("layers") or {}), "dense_layers": len(calib.get("fallback_dense") or []),
            "untimed_s": {m: s.get("untimed_s") for m, s in top["runs"].items()},
            "compile_s": {m: s.get("compile_s") for m, s in top["runs"].items()},
            "device": cfg["device"], "versions": cfg["versions"], "created": cfg["created"]}


def collect(archives: list[Path]) -> dict:
    pairs: dict[str, dict] = {}
    commands: dict[str, str] = {}  # run name -> its command (a later archive's run replaces an earlier one's)
    env: dict = {}
    for arc in archives:
        with tempfile.TemporaryDirectory() as tmp, tarfile.open(arc) as tar:
            tar.extractall(tmp, filter="data")
            raw = Path(tmp)
            for line in (raw / "commands.txt").read_text().splitlines():
                if line.startswith("=== ") and ": " in line:
                    commands[line.split()[1]] = line.split(": ", 1)[1]
            for pair, label in PAIRS.items():
                for order in ("dense-first", "sebp-first"):
                    run = _run(raw, f"{pair}_{order}")
                    if run is not None:
                        pairs.setdefault(pair, {"label": label, "orders": {}})["orders"][order] = run
                        env = {"gpu": run["device"], **run["versions"], "date": run["created"]}
    return {"experiment": "compare",
            "command": 'STEPS="eager compile padded forced" bash benchmarks/compare_session.sh',
            "commands": {n: c for n, c in commands.items() if n.split("_")[0] in pairs}, "environment": env,
            "model": "a ~120M Llama, random weights, the bundled MiniLM's vocabulary (benchmarks/fsdp_model.py small)",
            "data": "the bundled tweets, 40 steps of 32, max length 128, bf16, seed 0", "pairs": pairs}


def main(argv=None) -> None:
    args = argv or sys.argv[1:]
    out, archives = Path(args[0]), [Path(a) for a in args[1:]]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(collect(archives), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
