"""Gather benchmarks/fsdp_sft_session.sh's archives into one JSON for the docs.

Per pair (compiled dense-first, compiled SEBP-first, eager dense-first) and run: the median backward and step
milliseconds over the steps after the third that no run of the comparison compiled in. The loop's own ``untimed``
flags leave out every step of a new batch shape, and under ``longest`` padding nearly every SFT batch has one, so
its summary times none. "Compiled in" is on any process for the pairs by layers, which ran after the loop began to
agree its flags across processes; in the earlier pairs a step in which only the other process recompiled, and held
this one up for its whole compile, was flagged a new shape and counts here. Also per run: rank 0's peak memory, the
held-out loss and the projections on SEBP; per pair, the median over those steps of dense's time over SEBP's on the
same step (the same batch). Runs are also compared by their place in the process (the same batches at the same
place, one pair's dense against the other's SEBP): while sdpa used cuDNN's attention (``--before``), the second run
of a ``--compare`` under FSDP2 stepped faster than the first whichever method it was. Also: the resume after a
SIGTERM against the run uninterrupted, FSDP1, and a resume by another number of processes.

Usage: python benchmarks/fsdp_sft_collect.py OUT_JSON --pairs ARCHIVE... --rest ARCHIVE... [--before ARCHIVE...]
(within each list, later archives win for the same run)
"""
from __future__ import annotations

import argparse
import io
import json
import random
import statistics
import sys
import tarfile
from pathlib import Path

PAIRS = {"pair_dense-first": "compiled, dense first", "pair_sebp-first": "compiled, SEBP first",
         "eager_dense-first": "eager, dense first",
         "pair_layers_dense-first": "compiled by layers, dense first",
         "pair_layers_sebp-first": "compiled by layers, SEBP first",
         # two H200s, 30 steps: the SEBP linears' forward over the real-token rows, Inductor's mix-order
         # reduction off for dynamic shapes (sebp_probe.train.compiling.dynamic_options)
         "pair_layers_fwd_dense-first": "by layers, forward over real rows (H200), dense first",
         "pair_layers_fwd_sebp-first": "by layers, forward over real rows (H200), SEBP first",
         # two H200s, 20 steps, the code of 0cd0caf; its SEBP-first pair was cut by the device's time
         "pair_layers_s36_dense-first": "by layers, code of 0cd0caf (H200, 20 steps), dense first",
         # two H200s of one machine, 20 steps, both orders one after the other, the code of 24b158f (the
         # labelled-rows head's label checks held on the device)
         "pair_layers_s37_dense-first": "by layers, code of 24b158f (H200, 20 steps), dense first",
         "pair_layers_s37_sebp-first": "by layers, code of 24b158f (H200, 20 steps), SEBP first",
         # the same at 7e23660: the labelled-rows head through the model's own forward (logits_to_keep), where it
         # fell back to the model's own head before; each order on its own machine
         "pair_layers_s38_dense-first": "by layers, labelled head through the forward (H200, 20 steps), dense first",
         "pair_layers_s38_sebp-first": "by layers, labelled head through the forward (H200, 20 steps), SEBP first"}
ORDERS = {"compiled": ("pair_dense-first", "pair_sebp-first"),  # the pairs of each compile scope, both orders
          "compiled by layers": ("pair_layers_dense-first", "pair_layers_sebp-first"),
          "by layers, forward over real rows (H200)": ("pair_layers_fwd_dense-first", "pair_layers_fwd_sebp-first"),
          "by layers, code of 24b158f (H200)": ("pair_layers_s37_dense-first", "pair_layers_s37_sebp-first"),
          "by layers, labelled head through the forward (H200)": ("pair_layers_s38_dense-first",
                                                                  "pair_layers_s38_sebp-first")}
SKIP_FIRST = 3
BEFORE = ("`finetune` still left sdpa its own choice of kernel, on these GPUs cuDNN's attention, which builds a "
          "host-side plan for each new batch shape and keeps it for the process")


def read_archives(paths: list[Path]) -> dict[str, str]:
    """Every file of the archives by its path inside them ("./" dropped); later archives win, except the
    commands.txt of each, which add up."""
    files: dict[str, str] = {}
    for p in paths:
        with tarfile.open(p) as tar:
            for m in tar.getmembers():
                if m.isfile():
                    name, text = m.name.removeprefix("./"), tar.extractfile(m).read().decode()
                    files[name] = files.get(name, "") + text if name == "commands.txt" else text
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
    ratios = {k: [recs["dense"][t][k] / recs["sebp"][t][k] for t in timed] for k in ("step_ms", "backward_ms")}
    for m in runs:  # each timed step's times, for comparisons across pairs (the same batches: seed 0)
        runs[m]["timed"] = {str(t): [recs[m][t]["step_ms"], recs[m][t]["backward_ms"]] for t in timed}
    cfg = json.loads(files[f"{name}/run_config.json"])
    return {"label": PAIRS[name], "date": cfg["created"], "device": cfg.get("device"), "steps": len(steps), "timed_steps": len(timed), "max_abs_loss_gap": gap,
            "step_ratio_per_step": statistics.median(ratios["step_ms"]),
            "backward_ratio_per_step": statistics.median(ratios["backward_ms"]),
            "step_ratios": ratios["step_ms"], "backward_ratios": ratios["backward_ms"],
            "loop_verdict": top["comparison"]["verdict"], "loop_line_now": _loop_line_now(files, name, top, recs),
            "runs": runs}


def _loop_line_now(files: dict[str, str], name: str, top: dict, recs: dict[str, dict[int, dict]]) -> str:
    """What ``finetune --compare`` prints for this pair with the code of today (sebp_probe.train.metrics), from
    the runs' own summaries and metrics: the rules that decide its verdict changed after some pairs ran."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from sebp_probe.tables import comparison_line
    from sebp_probe.train.metrics import compare_runs, summarize_records

    rows = {m: [recs[m][t] for t in sorted(recs[m])] for m in ("dense", "sebp")}
    sums = {m: {**json.loads(files[f"{name}/{m}/summary.json"]), **summarize_records(rows[m])} for m in rows}
    cmp = compare_runs(sums["dense"], sums["sebp"], rows["dense"], rows["sebp"])
    return comparison_line(cmp, {"dense": {}, "sebp": {}})


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


def _by_place(pairs: dict) -> dict:
    """The compiled pairs' dense / SEBP ratios between runs at the same place in their processes (per compile
    scope measured in both orders)."""
    out = {}
    for what, names in ORDERS.items():
        if not all(n in pairs for n in names):
            continue
        for place in (1, 2):
            d = next(r for n in names for m, r in pairs[n]["runs"].items() if m == "dense" and r["place"] == place)
            s = next(r for n in names for m, r in pairs[n]["runs"].items() if m == "sebp" and r["place"] == place)
            steps = [t for t in d["timed"] if t in s["timed"]]  # the same batches, timed in both pairs
            out[f"{what}, run {place} of its process"] = {
                "steps": len(steps),
                "step_ratio": statistics.median(d["timed"][t][0] / s["timed"][t][0] for t in steps),
                "backward_ratio": statistics.median(d["timed"][t][1] / s["timed"][t][1] for t in steps),
                "peak_mem_ratio": s["peak_mem_gib_rank0"] / d["peak_mem_gib_rank0"]}
    return out


def _median_ci(xs: list[float], n: int = 2000, seed: int = 0) -> list[float]:
    """A 95% bootstrap interval of the median of ``xs`` (``n`` resamples, a fixed seed: the same every time). Over
    steps only: it cannot see what varies from run to run, which the two orders' own medians show."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return [meds[int(0.025 * n)], meds[int(0.975 * n) - 1]]


def _both_orders(pairs: dict) -> dict:
    """Per compile scope measured in both orders: the median of dense / SEBP on the same step over the timed
    steps of both pairs together (its 95% bootstrap interval over steps, and each order's own median), and the
    largest gap of SEBP's peak memory (rank 0) from dense's."""
    out = {}
    for what, names in ORDERS.items():
        if all(n in pairs for n in names):
            runs = [pairs[n]["runs"] for n in names]
            steps = [x for n in names for x in pairs[n]["step_ratios"]]
            out[what] = {"steps": sum(pairs[n]["timed_steps"] for n in names),
                         "step_ratio": statistics.median(steps), "step_ratio_ci95_over_steps": _median_ci(steps),
                         "step_ratio_by_order": [pairs[n]["step_ratio_per_step"] for n in names],
                         "backward_ratio": statistics.median(x for n in names for x in pairs[n]["backward_ratios"]),
                         "peak_mem_ratio_max": max(r["sebp"]["peak_mem_gib_rank0"] / r["dense"]["peak_mem_gib_rank0"]
                                                   for r in runs)}
    return out


def _commands(files: dict[str, str]) -> list[str]:
    return [x.split(": ", 1)[1] for x in files["commands.txt"].splitlines() if x.startswith("=== ") and ": " in x]


def collect(pair_files: dict[str, str], rest_files: dict[str, str], before_files: dict[str, str] | None = None,
            command: str = "") -> dict:
    """The pairs of ``pair_files``, the resume, FSDP1 and process-count runs of ``rest_files`` and, where given,
    the pairs of ``before_files`` (measured while sdpa chose cuDNN's attention)."""
    pairs = {n: _pair(pair_files, n) for n in PAIRS if f"{n}/summary.json" in pair_files}
    first = next(iter(pairs))
    cfg = json.loads(pair_files[f"{first}/run_config.json"])
    rest_cfg = json.loads(rest_files["resume_ref/run_config.json"])
    fsdp1 = json.loads(rest_files["fsdp1/summary.json"])
    nproc = [x for x in rest_files.get("nproc.log", "").splitlines() if x.startswith("error:")]
    gpus = [x for x in pair_files["env.txt"].splitlines() if x.startswith("GPU ")]
    out = {"experiment": "fsdp_sft", "command": command,
           "commands": _commands(pair_files) + _commands(rest_files),
           "environment": {"gpu": cfg["device"], "gpus": len(gpus), **cfg["versions"], "date": cfg["created"],
                           "date_resume_fsdp1": rest_cfg["created"]},
           "attention": "sdpa without cuDNN's attention (finetune leaves it out unless --padding max_length)",
           "model": "Llama-3.2-1B shape, random weights, the bundled MiniLM's vocabulary (benchmarks/fsdp_model.py)",
           "data": "benchmarks/sft_long_data.py: the bundled tweets as long instruction pairs (median ~280 tokens, "
                   "up to 2048), `longest` padding, 8 sequences a GPU a step, bf16, seed 0",
           "pairs": pairs, "by_place": _by_place(pairs), "both_orders": _both_orders(pairs),
           "resume": _resume(rest_files),
           "fsdp1": {"status": fsdp1["status"], "steps": fsdp1["steps"],
                     "sebp_layers": len((fsdp1.get("calibration") or {}).get("layers") or {}),
                     "eval_loss": fsdp1["final_eval"]["eval_loss"]},
           "resume_other_process_count": nproc[0] if nproc else None}
    if before_files:
        before = {n: _pair(before_files, n) for n in PAIRS if f"{n}/summary.json" in before_files}
        bcfg = json.loads(before_files[f"{next(iter(before))}/run_config.json"])
        out["before"] = {"attention": BEFORE, "date": bcfg["created"], "pairs": before, "by_place": _by_place(before)}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--pairs", nargs="+", type=Path, required=True, help="archives of the pair steps")
    p.add_argument("--rest", nargs="+", type=Path, required=True, help="archives of the resume, fsdp1, nproc steps")
    p.add_argument("--before", nargs="*", type=Path, default=[], help="archives of pairs measured with cuDNN's "
                   "attention")
    args = p.parse_args(argv)
    command = " ".join(["python benchmarks/fsdp_sft_collect.py", *(argv if argv is not None else sys.argv[1:])])
    doc = collect(read_archives(args.pairs), read_archives(args.rest),
                  read_archives(args.before) if args.before else None, command)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
