"""Gather benchmarks/fsdp_sft_session.sh's ``resume_det`` and ``scopes`` archives into one JSON for the docs.

``--deterministic`` under FSDP2 on two GPUs: the same command twice (are the losses bit-equal?), and a run killed
by SIGTERM then resumed against the uninterrupted one, once before the checkpoint kept the padding-row verdict
(``--before``) and once after; and the compile of one process's ``--compile default --compile-scope layers`` run.

Usage: python benchmarks/fsdp_det_collect.py OUT_JSON --twice ARCHIVE --resume ARCHIVE [--before ARCHIVE]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_sft_collect import _commands, _records, read_archives  # noqa: E402


def _losses(files: dict[str, str], run: str) -> dict[int, float]:
    return {s: r["loss"] for s, r in _records(files[f"{run}/metrics.jsonl"]).items()}


def _evals(files: dict[str, str], run: str) -> list[dict]:
    return [r for r in map(json.loads, files[f"{run}/metrics.jsonl"].splitlines()) if r.get("type") == "eval"]


def compare(files: dict[str, str], a: str, b: str) -> dict:
    """Run ``b`` against run ``a`` of ``files``: the steps both logged, those with bit-equal losses, the first
    that differs, the largest gap, and whether their held-out evaluations are equal."""
    la, lb = _losses(files, a), _losses(files, b)
    steps = sorted(set(la) & set(lb))
    differ = [s for s in steps if la[s] != lb[s]]
    return {"steps": len(steps), "bit_equal_steps": len(steps) - len(differ),
            "first_differing_step": differ[0] if differ else None,
            "max_abs_loss_gap": max((abs(la[s] - lb[s]) for s in steps), default=None),
            "evals_equal": _evals(files, a) == _evals(files, b),
            f"losses_{a}": [la[s] for s in steps], f"losses_{b}": [lb[s] for s in steps]}


def _resumed_from(files: dict[str, str], name: str) -> int | None:
    line = next((x for x in files.get(f"{name}.log", "").splitlines() if "resuming from" in x), None)
    return int(line.split("(step ")[1].split(")")[0]) if line else None


def _scope(files: dict[str, str], name: str) -> dict:
    s = json.loads(files[f"{name}/summary.json"])
    recs = _records(files[f"{name}/metrics.jsonl"])
    return {"compile": s.get("compile"), "compile_s": s.get("compile_s"), "compile_steps": s.get("compile_steps"),
            "steps": s["steps"], "first_step_s": recs[1]["step_ms"] / 1e3,
            "compiled_at_steps": {st: round(r["step_ms"] / 1e3, 1) for st, r in recs.items()
                                  if r.get("untimed") == "compile"},
            "other_step_ms": [round(r["step_ms"], 1) for r in recs.values() if r.get("untimed") != "compile"],
            "padding_rows": s.get("padding_rows")}


def collect(twice: dict[str, str], resume: dict[str, str], before: dict[str, str] | None, command: str) -> dict:
    cfg = json.loads(resume["resume_det_ref/run_config.json"])
    out = {"experiment": "fsdp_det", "command": command,
           "commands": _commands(twice) + ([] if before is twice or before is None else _commands(before))
           + _commands(resume),
           "environment": {"gpu": cfg["device"], "gpus": len([x for x in resume["env.txt"].splitlines()
                                                              if x.startswith("GPU ")]),
                           **cfg["versions"], "date": cfg["created"]},
           "model": "Llama-3.2-1B shape, random weights, the bundled MiniLM's vocabulary (benchmarks/fsdp_model.py)",
           "data": "benchmarks/sft_long_data.py: the bundled tweets as long instruction pairs, `longest` padding, "
                   "8 sequences a GPU a step, bf16, seed 0",
           "run": f"exact SEBP, eager, {len(_losses(resume, 'resume_det_ref'))} steps, evaluation at steps "
                  f"{' and '.join(str(e['step']) for e in _evals(resume, 'resume_det_ref'))}, --deterministic; "
                  "FSDP2 through `accelerate launch --use_fsdp --fsdp_version 2` on 2 GPUs, full shard, each "
                  "decoder layer a unit",
           "twice": compare(twice, "resume_det_ref", "resume_det_ref2"),
           "resume": {"resumed_from_step": _resumed_from(resume, "resume_det"),
                      **compare(resume, "resume_det_ref", "resume_det")}}
    if before is not None:
        out["resume_before"] = {"what": "before checkpoints kept each process's padding-row verdict: the resumed "
                                        "run checked the padding rows again, its linears selecting their own rows "
                                        "in the first backward",
                                "resumed_from_step": _resumed_from(before, "resume_det"),
                                **compare(before, "resume_det_ref", "resume_det")}
    if "scope_layers/summary.json" in resume:
        scope = _scope(resume, "scope_layers")
        out["compile_layers_one_gpu"] = {"run": "one process on one GPU: --padding longest --compile default "
                                                f"--compile-scope layers --method sebp, {scope['steps']} steps",
                                         **scope}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--twice", type=Path, required=True, help="archive with resume_det_ref and resume_det_ref2")
    p.add_argument("--resume", type=Path, required=True, help="archive with resume_det_ref and resume_det "
                   "(and scope_layers)")
    p.add_argument("--before", type=Path, help="archive of a resume from before the verdict was kept")
    args = p.parse_args(argv)
    command = " ".join(["python benchmarks/fsdp_det_collect.py", *(argv if argv is not None else sys.argv[1:])])
    twice = read_archives([args.twice])
    before = (twice if args.before == args.twice else read_archives([args.before])) if args.before else None
    doc = collect(twice, read_archives([args.resume]), before, command)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
