"""The `finetune` runs behind the two-GPU and ``--compare`` tables: read a step's run folders into the rows of its
results/ family run, and stop a run by SIGTERM after some steps (for the resume rows).

    python benchmarks/finetune_runs.py collect fsdp|fsdp-sft|fsdp-det|compare FOLDER -o OUT.json
    python benchmarks/finetune_runs.py interrupt RUN_DIR STEPS -- COMMAND...

``benchmarks/gpu_suite.py`` runs both: its ``fsdp``, ``fsdp-sft``, ``fsdp-det`` and ``compare`` steps write their
runs under ``OUT/<step>/`` (each one a `finetune` output folder: ``run_config.json``, ``summary.json``,
``metrics.jsonl``; ``dense/`` and ``sebp/`` under a ``--compare``), then collect them into ``OUT/<step>.json``,
which ``--add`` puts into ``results/fsdp.json`` or ``results/finetune.json``. Standard library only.
"""
from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODEL = "Llama-3.2-1B shape, random weights, the bundled MiniLM's vocabulary (benchmarks/fsdp_model.py)"
SMALL = "a ~120M Llama, random weights, the bundled MiniLM's vocabulary (benchmarks/fsdp_model.py small)"
SFT_DATA = ("benchmarks/sft_long_data.py: the bundled tweets as long instruction pairs (median ~280 tokens, up to "
            "2048), `longest` padding, 8 sequences a GPU a step, bf16, seed 0")
FSDP2 = "FSDP2 through `accelerate launch --use_fsdp --fsdp_version 2` on 2 GPUs, full shard, each decoder layer a unit"
SKIP_FIRST = 3  # steps left out of the two-GPU medians: warm-up
COMPARE_PAIRS = {"eager": "longest, eager", "compile": "longest, --compile default",
                 "padded": "max_length, --cuda-graphs", "forced": "longest, eager, SEBP forced on every projection"}
ORDERS = ("dense-first", "sebp-first")


# ------------------------------------------------------------------------------------------ one run folder

def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def train_records(run: Path) -> dict[int, dict]:
    """The ``train`` records of a run's metrics.jsonl by step."""
    return {r["step"]: r for r in _lines(run / "metrics.jsonl") if r.get("type") == "train"}


def eval_records(run: Path) -> list[dict]:
    return [r for r in _lines(run / "metrics.jsonl") if r.get("type") == "eval"]


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def methods(run: Path) -> dict[str, tuple[dict, Path]]:
    """Each method's summary and folder: ``dense`` and ``sebp`` of a ``--compare``, else the run's one method."""
    top = summary(run)
    if "runs" in top:
        return {m: (s, run / m) for m, s in top["runs"].items()}
    return {top.get("method", "dense"): (top, run)}


def environment(run: Path) -> dict:
    cfg = json.loads((run / "run_config.json").read_text())
    return {"gpu": cfg["device"], "gpus": cfg.get("num_processes", 1), **cfg["versions"], "date": cfg["created"]}


def layers(s: dict) -> dict:
    calib = s.get("calibration") or {}
    return {"sebp_layers": len(calib.get("layers") or {}), "dense_layers": len(calib.get("fallback_dense") or [])}


def short_gpu(device: str) -> str:
    found = re.search(r"\b([A-Z]+\d{2,4}[A-Za-z]?)\b", device)
    return found.group(1) if found else device


def resumed_from(run: Path) -> int | None:
    """The step a resumed run restarted from: the last checkpoint its interrupted run wrote, as
    :func:`interrupt` recorded it beside the run folder."""
    mark = run.parent / f"{run.name}.interrupted.json"
    return json.loads(mark.read_text())["checkpoint_step"] if mark.exists() else None


def last_checkpoint(run: Path) -> int | None:
    names = (c.name for c in (run / "checkpoints").glob("step-*"))
    steps = [int(m.group(1)) for n in names if (m := re.fullmatch(r"step-(\d+)", n))]
    return max(steps, default=None)


def against(ref: Path, other: Path) -> dict:
    """Run ``other`` against run ``ref``: steps both logged, those with bit-equal losses, the first that differs,
    the largest gap, whether the held-out evaluations are equal."""
    a, b = train_records(ref), train_records(other)
    steps = sorted(set(a) & set(b))
    differ = [s for s in steps if a[s]["loss"] != b[s]["loss"]]
    return {"steps": len(steps), "bit_equal_steps": len(steps) - len(differ),
            "first_differing_step": differ[0] if differ else None,
            "max_abs_loss_gap": max((abs(a[s]["loss"] - b[s]["loss"]) for s in steps), default=None),
            "evals_equal": eval_records(ref) == eval_records(other)}


# ------------------------------------------------------------------------------------------- the steps

def collect_fsdp(folder: Path) -> dict:
    """``fsdp``: one GPU (dense, 2 accumulated) against FSDP2 on two (``--compare``), and FSDP2 + LoRA."""
    labels = {"one": "one GPU", "fsdp": "FSDP2, 2 GPUs", "lora-sebp": "FSDP2 + LoRA, 2 GPUs"}
    runs = {}
    for name, label in labels.items():
        top = summary(folder / name)
        runs[name] = {"label": label, "comparison": top.get("comparison"), "methods": {
            m: {"steps": s["steps"], "status": s["status"], "num_processes": s.get("num_processes"),
                "median_backward_ms": s["median_backward_ms"], "median_step_ms": s["median_step_ms"],
                "peak_mem_mb_rank0": s["peak_mem_mb"], "eval_loss": s["final_eval"]["eval_loss"], **layers(s),
                "losses": [r["loss"] for _, r in sorted(train_records(d).items())]}
            for m, (s, d) in methods(folder / name).items()}}
    one, two = runs["one"]["methods"]["dense"], runs["fsdp"]["methods"]["dense"]
    return {"model": MODEL, "environment": environment(folder / "fsdp"), "runs": runs,
            "two_gpus_vs_one": {"steps": len(one["losses"]),
                                "max_abs_loss_gap": max(abs(a - b) for a, b in zip(one["losses"], two["losses"])),
                                "eval_loss_one": one["eval_loss"], "eval_loss_fsdp": two["eval_loss"]}}


def sft_pair(run: Path, order: str) -> dict:
    """One compiled ``--compare`` pair: medians over the steps after the first three that no run compiled in."""
    ms = methods(run)
    recs = {m: train_records(d) for m, (_, d) in ms.items()}
    steps = sorted(set.intersection(*(set(r) for r in recs.values())))
    timed = [t for t in steps if t > SKIP_FIRST and all(r[t].get("untimed") != "compile" for r in recs.values())]
    first = "sebp" if order == "sebp-first" else "dense"
    out = {m: {"place": 1 if m == first else 2,
               "step_ms": statistics.median(recs[m][t]["step_ms"] for t in timed),
               "backward_ms": statistics.median(recs[m][t]["backward_ms"] for t in timed),
               "peak_mem_gib_rank0": s["peak_mem_mb"] / 1024, "eval_loss": s["final_eval"]["eval_loss"],
               **layers(s), "compile": s.get("compile"), "compile_s": s.get("compile_s")}
           for m, (s, _) in ms.items()}
    ratio = {k: [recs["dense"][t][k] / recs["sebp"][t][k] for t in timed] for k in ("step_ms", "backward_ms")}
    env = environment(run)
    return {"label": "SEBP first" if order == "sebp-first" else "dense first", "device": env["gpu"],
            "date": env["date"], "steps": len(steps), "timed_steps": len(timed),
            "max_abs_loss_gap": max(abs(recs["dense"][t]["loss"] - recs["sebp"][t]["loss"]) for t in steps),
            "step_ratios": ratio["step_ms"], "backward_ratios": ratio["backward_ms"],
            "step_ratio_per_step": statistics.median(ratio["step_ms"]), "runs": out}


def collect_fsdp_sft(folder: Path) -> dict:
    """``fsdp-sft``: the compiled pair in both orders; the eager resume after a SIGTERM; FSDP1."""
    env = environment(folder / "pair_dense-first")
    gpu = short_gpu(env["gpu"])
    pairs = {f"{gpu.lower()}_{o}": sft_pair(folder / f"pair_{o}", o) for o in ORDERS}
    both = list(pairs.values())
    sebp_mem = [p["runs"]["sebp"]["peak_mem_gib_rank0"] / p["runs"]["dense"]["peak_mem_gib_rank0"] for p in both]
    out = {"model": MODEL, "data": SFT_DATA, "environment": env,
           "attention": "sdpa without cuDNN's attention (finetune leaves it out unless --padding max_length)",
           "pairs": pairs,
           "both_orders": {f"two {gpu}s": {
               "steps": sum(p["timed_steps"] for p in both),
               "step_ratio": statistics.median(x for p in both for x in p["step_ratios"]),
               "step_ratio_by_order": [p["step_ratio_per_step"] for p in both],
               "backward_ratio": statistics.median(x for p in both for x in p["backward_ratios"]),
               "peak_mem_ratio_max": max(sebp_mem)}}}
    if (folder / "resume" / "summary.json").exists():
        ref, res = train_records(folder / "resume_ref"), train_records(folder / "resume")
        at = resumed_from(folder / "resume")
        gap = {s: abs(ref[s]["loss"] - res[s]["loss"]) for s in ref if s in res}
        before = [g for s, g in gap.items() if at and s <= at]
        after = [g for s, g in gap.items() if at and s > at]
        out["resume"] = {"steps": len(ref), "resumed_from_step": at,
                         "max_abs_loss_gap_before_kill": max(before, default=None),
                         "max_abs_loss_gap_after_resume": max(after, default=None)}
    if (folder / "fsdp1" / "summary.json").exists():
        s = summary(folder / "fsdp1")
        out["fsdp1"] = {"status": s["status"], "steps": s["steps"], "eval_loss": s["final_eval"]["eval_loss"],
                        "sebp_layers": layers(s)["sebp_layers"]}
    return out


def collect_fsdp_det(folder: Path) -> dict:
    """``fsdp-det``: ``--deterministic`` under FSDP2, the same command twice and a SIGTERM + ``--resume``; the
    compile of one process's ``--compile-scope layers`` run."""
    ref = folder / "ref"
    evals = " and ".join(str(e["step"]) for e in eval_records(ref))
    out = {"model": MODEL, "data": SFT_DATA, "environment": environment(ref),
           "run": f"exact SEBP, eager, {len(train_records(ref))} steps, evaluation at steps {evals}, "
                  f"--deterministic; {FSDP2}",
           "twice": against(ref, folder / "ref2"),
           "resume": {"resumed_from_step": resumed_from(folder / "resume"),
                      **against(ref, folder / "resume")}}
    scope = folder / "scope_layers"
    if (scope / "summary.json").exists():
        s, recs = summary(scope), train_records(scope)
        out["compile_layers_one_gpu"] = {
            "run": f"one process on one GPU: --padding longest --compile default --compile-scope layers "
                   f"--method sebp, {s['steps']} steps",
            "compile": s.get("compile"), "compile_s": s.get("compile_s"), "steps": s["steps"],
            "compiled_at_steps": {str(t): round(r["step_ms"] / 1e3, 1) for t, r in recs.items()
                                  if r.get("untimed") == "compile"},
            "other_step_ms": [round(r["step_ms"], 1) for r in recs.values() if r.get("untimed") != "compile"]}
    return out


def collect_compare(folder: Path) -> dict:
    """``compare``: each ``--compare`` pair in both orders: its verdict, timing, loss gap and SEBP's layers."""
    pairs, env = {}, None
    for pair, label in COMPARE_PAIRS.items():
        for order in ORDERS:
            run = folder / f"{pair}_{order}"
            if not (run / "summary.json").exists():
                continue
            top = summary(run)
            cmp, env = top["comparison"], env or environment(run)
            pairs.setdefault(pair, {"label": label, "orders": {}})["orders"][order] = {
                "order": top["order"], "verdict": cmp["verdict"], "timed_steps": cmp["timing"]["timed_steps"],
                "step": cmp["timing"].get("step"), "backward": cmp["timing"].get("backward"),
                "max_abs_loss_gap": cmp.get("max_abs_loss_gap"), **layers(top["runs"]["sebp"])}
    if env is None:
        raise SystemExit(f"{folder}: no --compare run to collect")
    return {"model": SMALL, "data": "the bundled tweets, 40 steps of 32, max length 128, bf16, seed 0",
            "environment": env, "pairs": pairs}


COLLECT = {"fsdp": collect_fsdp, "fsdp-sft": collect_fsdp_sft, "fsdp-det": collect_fsdp_det,
           "compare": collect_compare}


# ------------------------------------------------------------------------------------------- interrupt

def interrupt(run: Path, steps: int, argv: list[str], poll_s: float = 0.5) -> int:
    """Run ``argv`` (a `finetune` writing to ``run``), send it SIGTERM once ``run``'s metrics.jsonl holds
    ``steps`` train records, and wait: 0 when it was stopped so (the checkpoint it wrote on the way out is
    recorded in ``RUN.interrupted.json`` beside the run), 1 when it ended before."""
    proc = subprocess.Popen(argv)
    logged = 0
    while proc.poll() is None:
        try:
            logged = len(train_records(run))
        except (OSError, ValueError):  # not written yet, or a line being written
            pass
        if logged >= steps:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
            mark = {"steps_logged": len(train_records(run)), "checkpoint_step": last_checkpoint(run)}
            (run.parent / f"{run.name}.interrupted.json").write_text(json.dumps(mark) + "\n")
            return 0
        time.sleep(poll_s)
    print(f"interrupt: the run ended (exit {proc.returncode}) after {logged} of {steps} steps", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("collect", help="a step's run folders as the rows of its results/ run")
    c.add_argument("step", choices=COLLECT)
    c.add_argument("folder", type=Path)
    c.add_argument("-o", "--out", type=Path, required=True)
    i = sub.add_parser("interrupt", help="SIGTERM a finetune after STEPS logged steps")
    i.add_argument("run", type=Path)
    i.add_argument("steps", type=int)
    i.add_argument("command", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.what == "interrupt":
        return interrupt(a.run, a.steps, a.command[1:] if a.command[:1] == ["--"] else a.command)
    doc = {"command": f"python benchmarks/gpu_suite.py {a.step}", **COLLECT[a.step](a.folder)}
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
