"""Gather benchmarks/fsdp_sft_session.sh's archives into one JSON for the docs.

Per pair (compiled dense-first, compiled SEBP-first, eager dense-first) and run: the median backward and step
milliseconds over the steps after the third that no run of the comparison compiled in (the loop's own
``untimed`` flags leave out every step of a new batch shape, and under ``longest`` padding nearly every SFT
batch has one, so its summary times none), rank 0's peak memory, the held-out loss and the projections on
SEBP. Runs are compared by their place in the process, since the second run of a ``--compare`` under FSDP2
stepped faster than the first whichever method it was. Also: the resume after a SIGTERM against the run
uninterrupted, FSDP1, and a resume by another number of processes.

Usage: python benchmarks/fsdp_sft_collect.py OUT_JSON ARCHIVE...  (later archives win for the same run)
"""
from __future__ import annotations

import io
import json
import statistics
import sys
import tarfile
from pathlib import Path

PAIRS = {"pair_dense-first": "compiled, dense first", "pair_sebp-first": "compiled, SEBP first",
         "eager_dense-first": "eager, dense first"}
SKIP_FIRST = 3


def read_archives(paths: list[Path]) -> dict[str, str]:
    """Every file of the archives by its path inside them ("./" dropped); later archives win."""
    files: dict[str, str] = {}
    for p in paths:
        with tarfile.open(p) as tar:
            for m in tar.getmembers():
                if m.isfile():
                    files[m.name.removeprefix("./")] = tar.extractfile(m).read().decode()
    return files


def _records(text: str) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, io.StringIO(text)) if r.get("type") == "train"}


def _pair(files: dict[str, str], name: str) -> dict:
    top = json.loads(files[f"{name}/summary.json"])
    recs = {m: _records(files[f"{name}/{m}/metrics.jsonl"]) for m in top["runs"]}
    steps = sorted(set.intersection(*(set(r) for r in recs.values())))
    timed = [s for s in steps if s > SKIP_FIRST and all(r[s].get("untimed") != "compile" for r in recs.values())]
    first = "sebp" if "sebp-first" in name else "dense"
    runs = {}
    for m, s in top["runs"].items():
        calib = s.get("calibration") or {}
        runs[m] = {"place": 1 if m == first else 2,
                   "backward_ms": statistics.median(recs[m][t]["backward_ms"] for t in timed),
                   "step_ms": statistics.median(recs[m][t]["step_ms"] for t in timed),
                   "peak_mem_gib_rank0": s["peak_mem_mb"] / 1024, "eval_loss": s["final_eval"]["eval_loss"],
                   "sebp_layers": len(calib.get("layers") or {}),
                   "dense_layers": len(calib.get("fallback_dense") or []),
                   "compile": s.get("compile"), "compile_s": s.get("compile_s")}
    gap = max(abs(recs["dense"][t]["loss"] - recs["sebp"][t]["loss"]) for t in steps)
    return {"label": PAIRS[name], "steps": len(steps), "timed_steps": len(timed), "max_abs_loss_gap": gap,
            "loop_verdict": top["comparison"]["verdict"], "runs": runs}


def _resume(files: dict[str, str]) -> dict:
    ref, res = _records(files["resume_ref/metrics.jsonl"]), _records(files["resume/metrics.jsonl"])
    log = files.get("resume.log", "")
    at = next((int(x.split("step-")[1].split(")")[0].split()[0]) for x in log.splitlines() if "resuming from" in x), None)
    diff = {s: abs(ref[s]["loss"] - res[s]["loss"]) for s in ref if s in res}
    return {"steps": len(ref), "resumed_from_step": at,
            "identical_steps": [s for s, d in diff.items() if d == 0.0],
            "max_abs_loss_gap_before_kill": max((d for s, d in diff.items() if at and s <= at), default=None),
            "max_abs_loss_gap_after_resume": max((d for s, d in diff.items() if at and s > at), default=None),
            "losses_uninterrupted": [ref[s]["loss"] for s in sorted(ref)],
            "losses_killed_and_resumed": [res[s]["loss"] for s in sorted(res)]}


def collect(files: dict[str, str]) -> dict:
    pairs = {n: _pair(files, n) for n in PAIRS if f"{n}/summary.json" in files}
    by_place = {}
    for kind, names in (("compiled", ("pair_dense-first", "pair_sebp-first")),):
        if all(n in pairs for n in names):
            for place in (1, 2):
                d = next(r for n in names for m, r in pairs[n]["runs"].items() if m == "dense" and r["place"] == place)
                s = next(r for n in names for m, r in pairs[n]["runs"].items() if m == "sebp" and r["place"] == place)
                by_place[f"{kind}, run {place} of its process"] = {
                    "step_ratio": d["step_ms"] / s["step_ms"], "backward_ratio": d["backward_ms"] / s["backward_ms"],
                    "peak_mem_ratio": s["peak_mem_gib_rank0"] / d["peak_mem_gib_rank0"]}
    fsdp1 = json.loads(files["fsdp1/summary.json"])
    nproc = [x for x in files.get("nproc.log", "").splitlines() if x.startswith("error:")]
    cfg = json.loads(files["resume_ref/run_config.json"])
    gpus = [x for x in files["env.txt"].splitlines() if x.startswith("GPU ")]
    commands = [x.split(": ", 1)[1] for x in files["commands.txt"].splitlines() if x.startswith("=== ") and ": " in x]
    return {"experiment": "fsdp_sft",
            "command": 'STEPS="prep pair" ORDERS=dense-first PAIR_STEPS=30, then ORDERS=sebp-first, then '
                       'STEPS="prep eager resume fsdp1 nproc" PAIR_STEPS=30 bash benchmarks/fsdp_sft_session.sh; '
                       'python benchmarks/fsdp_sft_collect.py results/fsdp_sft_h100/fsdp_sft.json '
                       'results/fsdp_sft_h100/raw/pairs_compiled.tgz results/fsdp_sft_h100/raw/eager_resume_fsdp1.tgz',
            "commands": commands,
            "environment": {"gpu": cfg["device"], "gpus": len(gpus), **cfg["versions"], "date": cfg["created"]},
            "model": "Llama-3.2-1B shape, random weights, the bundled MiniLM's vocabulary (benchmarks/fsdp_model.py)",
            "data": "benchmarks/sft_long_data.py: the bundled tweets as long instruction pairs (median ~280 tokens, "
                    "up to 2048), `longest` padding, 8 sequences a GPU a step, bf16, seed 0",
            "pairs": pairs, "by_place": by_place, "resume": _resume(files),
            "fsdp1": {"status": fsdp1["status"], "steps": fsdp1["steps"],
                      "sebp_layers": len((fsdp1.get("calibration") or {}).get("layers") or {}),
                      "eval_loss": fsdp1["final_eval"]["eval_loss"]},
            "resume_other_process_count": nproc[0] if nproc else None}


def main(argv: list[str] | None = None) -> None:
    args = argv if argv is not None else sys.argv[1:]
    out, archives = Path(args[0]), [Path(a) for a in args[1:]]
    out.write_text(json.dumps(collect(read_archives(archives)), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
