"""Gather the runs of benchmarks/fsdp_session.sh (their summary.json / metrics.jsonl / run_config.json, as the
session copied them under RAW/<step>/) into one JSON for the docs: per run and method the losses per step,
the median backward and step times, rank 0's peak memory, how many projections ran SEBP, the held-out loss,
and the loss gaps (two GPUs against one; SEBP against dense within a --compare).

Usage: python benchmarks/fsdp_collect.py RAW_DIR OUT_JSON
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

STEPS = {"one": "one GPU", "fsdp": "FSDP2, 2 GPUs", "lora-sebp": "FSDP2 + LoRA, 2 GPUs"}


def _losses(metrics: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if r.get("type") == "train"]


def _method(summary: dict, metrics: Path | None) -> dict:
    calib = summary.get("calibration") or {}
    return {"steps": summary["steps"], "status": summary["status"], "num_processes": summary["num_processes"],
            "median_backward_ms": summary["median_backward_ms"], "median_step_ms": summary["median_step_ms"],
            "peak_mem_mb_rank0": summary["peak_mem_mb"], "eval_loss": summary["final_eval"]["eval_loss"],
            "sebp_layers": len(calib.get("layers") or {}), "dense_layers": len(calib.get("fallback_dense") or []),
            "fallback_reason": calib.get("fallback_reason"), "padding_rows": summary.get("padding_rows"),
            "losses": _losses(metrics) if metrics is not None and metrics.exists() else None}


def collect(raw: Path) -> dict:
    runs = {}
    for step, label in STEPS.items():
        d = raw / step
        if not (d / "summary.json").exists():
            continue
        top = json.loads((d / "summary.json").read_text())
        methods = top.get("runs") or {top.get("method", "dense"): top}
        runs[step] = {"label": label, "comparison": top.get("comparison"),
                      "methods": {m: _method(s, d / m / "metrics.jsonl" if "runs" in top else d / "metrics.jsonl")
                                  for m, s in methods.items()}}
    one, fsdp = runs["one"]["methods"]["dense"]["losses"], runs["fsdp"]["methods"]["dense"]["losses"]
    cfg = json.loads((raw / "one" / "run_config.json").read_text())
    gpus = [x for x in (raw / "env.txt").read_text().splitlines() if x.startswith("GPU ")]
    commands = [x.split(": ", 1)[1] for x in (raw / "commands.txt").read_text().splitlines() if ": " in x]
    return {"experiment": "fsdp", "command": 'STEPS="one fsdp" then STEPS="lora-sebp" bash benchmarks/fsdp_session.sh',
            "commands": commands,
            "environment": {"gpu": cfg["device"], "gpus": len(gpus), **cfg["versions"], "date": cfg["created"]},
            "model": "Llama-3.2-1B shape, random weights, the bundled MiniLM's vocabulary (benchmarks/fsdp_model.py)",
            "runs": runs,
            "two_gpus_vs_one": {"steps": len(one), "max_abs_loss_gap": max(abs(a - b) for a, b in zip(one, fsdp)),
                                "eval_loss_one": runs["one"]["methods"]["dense"]["eval_loss"],
                                "eval_loss_fsdp": runs["fsdp"]["methods"]["dense"]["eval_loss"]}}


def main(argv=None) -> None:
    raw, out = map(Path, (argv or sys.argv[1:])[:2])
    out.write_text(json.dumps(collect(raw), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
