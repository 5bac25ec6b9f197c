"""The GPU runs behind the documented tables, as named steps (one CUDA machine; two GPUs for the ``fsdp`` steps).

    python benchmarks/gpu_suite.py --list                    # the steps, what each measures, the table it feeds
    python benchmarks/gpu_suite.py tests                     # every GPU-marked test
    python benchmarks/gpu_suite.py layers model --out OUT    # the per-layer and the eager whole-model bench
    python benchmarks/gpu_suite.py compiled --add            # ...and each result into its results/ family file
    python benchmarks/gpu_suite.py model --dry-run           # print the commands only

Each step runs commands of the package's CLI (``python -m sebp_probe ...``) and of the benchmark scripts beside
this file; every JSON they write records its device, versions, date and command. ``--add`` puts each result into
its family file under results/ (``tools/docs/make_docs.py --add``); then ``python tools/docs/make_docs.py``
regenerates the tables. The ``fsdp*`` and ``compare`` steps run `finetune` and read their runs' folders under
OUT (``summary.json``, ``metrics.jsonl``) into their family rows with ``benchmarks/finetune_runs.py``.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


@dataclass
class Job:
    """One command; ``add``: (family file, run name) for the JSON at ``out``."""
    argv: list[str]
    out: Path | None = None
    add: tuple[str, str] | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Step:
    what: str
    feeds: str
    jobs: Callable[[Path, str], list[Job]]  # (OUT, the GPU's short name such as h100) -> the jobs


def bench(out: Path, name: str, case: str, *args: str, add: tuple[str, str] | None = None) -> Job:
    path = out / f"{name}.json"
    return Job([PY, "-m", "sebp_probe", "bench", case, *args, "-o", str(path)], path, add)


def script(out: Path, name: str, file: str, *args: str, flag: str = "--out",
           add: tuple[str, str] | None = None) -> Job:
    path = out / f"{name}.json"
    where = [flag, str(path)] if flag else [str(path)]
    return Job([PY, str(ROOT / "benchmarks" / file), *args, *where], path, add)


def _tests(out: Path, gpu: str) -> list[Job]:
    pytest = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short", "-m", "gpu"]
    return [Job([*pytest, "tests/kernels"]), Job([*pytest, "tests/cli", "tests/convergence", "tests/probe"])]


def _layers(out: Path, gpu: str) -> list[Job]:
    return [bench(out, f"layers_{m}", m, add=("layers.json", f"{gpu}_{m}"))
            for m in ("bert-base", "llama-3.2-3b", "qwen2.5-0.5b")]


def _model(out: Path, gpu: str) -> list[Job]:
    jobs = [bench(out, "model_bert-base_linears", "bert-base", "--scope", "model", "--graphs",
                  add=("model_eager.json", "bert-base_linears")),
            bench(out, "model_llama-3.2-1b-sft_linears", "llama-3.2-1b-sft", "--scope", "model", "--graphs",
                  add=("model_eager.json", "llama-3.2-1b-sft_linears"))]
    for case in ("bert-base", "llama-3.2-1b-sft", "qwen2.5-0.5b-sft", "mistral-1b-sft"):
        jobs.append(bench(out, f"model_{case}_fused", case, "--scope", "model", "--graphs", "--norms", "--acts",
                          add=("model_eager.json", f"{case}_fused")))
    return jobs


def _compiled(out: Path, gpu: str) -> list[Job]:
    return [bench(out, f"model_{case}_cce", case, "--scope", "model", "--compile", "default", "--layouts",
                  "packed,longest", "--methods", "dense:labelled,cce:labelled,sebp:labelled", "--model-batches", "6",
                  add=("model_compiled.json", f"{case}_cce")) for case in ("llama-3.2-1b-sft", "qwen2.5-0.5b-sft")]


def _sampled(out: Path, gpu: str) -> list[Job]:
    """Sampled mode (on the GPU its Triton path) beside dense, SEBP, CCE and Liger (decoder), packed and
    `longest`, eager and compiled, keeping half of each layer's non-zero rows for dW: the share the quality
    runs' ``auto`` budget skipped (the bench's models are built from configs, whose gradients ``auto`` would
    judge otherwise); the 1B decoder also with dX sampled; and one layer at a time at 0.5 and 0.3, as graphs
    and eagerly."""
    jobs = [bench(out, f"model_{case}_sampled", case, "--scope", "model", "--compile", "default", "--layouts",
                  layouts, "--methods", methods, "--budget", "0.5", "--model-batches", batches,
                  add=("model_compiled.json", f"{case}_sampled"))
            for case, layouts, batches, methods in (
                ("llama-3.2-1b-sft", "packed,longest", "2",
                 "dense:labelled,cce:labelled,liger:full,sebp:labelled,sampled:labelled"),
                ("bert-base", "packed,longest", "4", "dense:full,sebp:full,sampled:full"))]
    jobs.append(bench(out, "model_llama-3.2-1b-sft_sampled_dx", "llama-3.2-1b-sft", "--scope", "model", "--compile",
                      "default", "--layouts", "packed", "--methods", "dense:labelled,cce:labelled,sampled:labelled",
                      "--budget", "0.5", "--sample-dx", "--model-batches", "2",
                      add=("model_compiled.json", "llama-3.2-1b-sft_sampled_dx")))
    for budget in ("0.5", "0.3"):
        jobs += [bench(out, f"layers_{m}_sampled_{budget}", m, *rows, "--mode", "sampled", "--budget", budget,
                       "--densities", "1.0,0.5", add=("layers.json", f"{gpu}_{m}_sampled_{budget}"))
                 for m, rows in (("llama-3.2-1b", ("--rows", "16384")), ("bert-base", ()))]
    return jobs


def _compiled_longest(out: Path, gpu: str) -> list[Job]:
    """`longest`, each entry in a process of its own, dense / SEBP / SEBP / dense, merged by orders_collect.py."""
    jobs = []
    for case, head, extra in (("llama-3.2-1b-sft", "labelled", ()), ("qwen2.5-0.5b-sft", "labelled", ()),
                              ("bert-base", "full", ("--graphs",))):
        folder = out / f"orders_{case}"
        lines = []
        for n, method in enumerate(("dense", "sebp", "sebp", "dense"), 1):
            entry = f"{method}:{head}"
            job = bench(folder, f"{case}_longest_{n}", case, "--scope", "model", "--compile", "default", "--layouts",
                        "longest", "--methods", entry, "--model-batches", "8", *extra)
            lines.append(f"{entry}: env  {shlex.join(job.argv[1:])}")
            jobs.append(job)
        jobs.append(Job([PY, "-c", WRITE_LINES, str(folder / "commands.txt"), *lines]))  # orders_collect's index
        merged = out / f"model_{case}_longest.json"
        jobs.append(Job([PY, str(ROOT / "benchmarks" / "orders_collect.py"), str(folder), "-o", str(merged)],
                        merged, ("model_compiled.json", f"{case}_longest")))
    return jobs


WRITE_LINES = ("import pathlib, sys; p = pathlib.Path(sys.argv[1]); p.parent.mkdir(parents=True, exist_ok=True); "
               "p.write_text(''.join(line + '\\n' for line in sys.argv[2:]))")


def _probe(out: Path, gpu: str) -> list[Job]:
    """finetune --probe-every's probed step against the unprobed one (finetune's default head), `longest`, eager
    and compiled. BERT-base's host-bound steps spread 5-9% on an H100 (the noise column of grad_stats.json), so
    it times 15 steps of each kind a batch, not the bench's 5 (the 1B decoder's spread 0.3-3%)."""
    return [bench(out, f"probe_{case}", case, "--scope", "model", "--probe", "--compile", "default", "--layouts",
                  "longest", "--methods", "dense:labelled,sebp:labelled", "--model-batches", "6",
                  *(["--model-repeats", "15"] if case == "bert-base" else []),
                  add=("grad_stats.json", f"probe_{gpu}_{case}")) for case in ("bert-base", "llama-3.2-1b-sft")]


def _head(out: Path, gpu: str) -> list[Job]:
    return [script(out, "head", "head_bench.py", "--sebp", "--extra-chunks", "832", "1408",
                   add=("head.json", "labelled"))]


def _trainer(out: Path, gpu: str) -> list[Job]:
    eager = script(out, "trainer_eager", "trainer_bench.py", "--variants",
                   "plain,plain-nocudnn,sebp,liger,liger-nocudnn,liger+sebp", "--steps", "30",
                   add=("trainer.json", "eager"))
    pf = script(out, "trainer_pf", "trainer_bench.py", "--padding-free", "--variants",
                "plain,sebp,plain-nocudnn,liger-nocudnn", add=("trainer.json", "padding_free"))
    parts = [script(out, f"trainer_compiled_{v.replace('+', '_')}", "trainer_bench.py", "--variants", v, "--steps",
                    "10", "--warmup", "4", "--in-process")
             for v in ("sebp", "liger-nocudnn", "liger+compile-nocudnn", "sebp+compile")]
    merged = out / "trainer_compiled.json"
    merge = Job([PY, str(ROOT / "benchmarks" / "trainer_bench.py"), "--out", str(merged), "--merge",
                 *(str(p.out) for p in parts)], merged, ("trainer.json", f"compiled_{gpu}"))
    return [eager, pf, *parts, merge]


def _resprop(out: Path, gpu: str) -> list[Job]:
    return [script(out, "resprop", "resprop_bench.py", flag="--output", add=("resprop.json", "gpu"))]


def _kernels(out: Path, gpu: str) -> list[Job]:
    return [script(out, "norm_bench", "norm_bench.py", flag="", add=("kernels.json", "norms"))]


MODEL, DATA, SMALL = ".cache/gpu/llama_1b", ".cache/gpu/sft_long.jsonl", ".cache/gpu/llama_small"
FSDP = ["accelerate", "launch", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "bf16",
        "--use_fsdp", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap",
        "LlamaDecoderLayer", "--fsdp_state_dict_type", "SHARDED_STATE_DICT", "--fsdp_reshard_after_forward", "true",
        "--fsdp_version", "2", "-m", "sebp_probe", "finetune"]
SFT = [MODEL, DATA, "--bf16", "--max-length", "2048", "--batch-size", "8", "--eval-samples", "32", "--seed", "0",
       "--json", "--padding", "longest"]


def _prep() -> list[Job]:
    """The random-weight Llama shapes and the long SFT pairs, with the bundled MiniLM's tokenizer (no hub)."""
    tok = "$(" + shlex.quote(PY) + " -c 'from sebp_probe.data.assets import minilm_dir; print(minilm_dir())')"
    b = shlex.quote(str(ROOT / "benchmarks"))
    return [Job(["sh", "-c", f"[ -f {MODEL}/config.json ] || {shlex.quote(PY)} {b}/fsdp_model.py {tok} {MODEL} 1b; "
                 f"[ -f {SMALL}/config.json ] || {shlex.quote(PY)} {b}/fsdp_model.py {tok} {SMALL} small; "
                 f"[ -f {DATA} ] || {shlex.quote(PY)} {b}/sft_long_data.py {tok} {DATA} 2000"])]


def collect(out: Path, step: str, family: str, run: str) -> Job:
    """Read the runs of ``step`` under OUT/<folder>/ into OUT/<step>.json, added to results/ as ``family#run``."""
    path = out / f"{step}.json"
    return Job([PY, str(ROOT / "benchmarks" / "finetune_runs.py"), "collect", step,
                str(out / step.replace("-", "_")), "-o", str(path)], path, (family, run))


def interrupted(run: Path, argv: list[str], steps: int = 6) -> list[Job]:
    """``argv`` stopped by SIGTERM after ``steps`` logged steps, then resumed (``--resume``)."""
    return [Job([PY, str(ROOT / "benchmarks" / "finetune_runs.py"), "interrupt", str(run), str(steps), "--", *argv,
                 "-o", str(run), "--overwrite"]), Job([*argv, "-o", str(run), "--resume"])]


def _fsdp(out: Path, gpu: str) -> list[Job]:
    common = [MODEL, "tweets-sft", "--bf16", "--padding", "longest", "--max-length", "256", "--max-samples", "4000",
              "--batch-size", "8", "--eval-steps", "12", "--eval-samples", "64", "--seed", "0", "--json"]
    runs = out / "fsdp"
    return [*_prep(),
            Job([PY, "-m", "sebp_probe", "finetune", *common, "--max-steps", "24", "--method", "dense",
                 "--grad-accum", "2", "-o", str(runs / "one"), "--overwrite"]),
            Job([*FSDP, *common, "--max-steps", "24", "--compare", "-o", str(runs / "fsdp"), "--overwrite"]),
            Job([*FSDP, *common, "--max-steps", "8", "--compare", "--lora", "--always-sebp",
                 "--dense-fallback", "1", "-o", str(runs / "lora-sebp"), "--overwrite"]),
            collect(out, "fsdp", "fsdp.json", "one_vs_two")]


def _fsdp_sft(out: Path, gpu: str) -> list[Job]:
    runs = out / "fsdp_sft"
    eager = [*FSDP, *SFT, "--max-steps", "16", "--method", "sebp", "--eval-steps", "8"]
    pairs = [Job([*FSDP, *SFT, "--compile", "default", "--max-steps", "40", "--compare",
                  *(["--sebp-first"] if order == "sebp-first" else []),
                  "-o", str(runs / f"pair_{order}"), "--overwrite"], env={"TORCH_LOGS": "recompiles"})
             for order in ("dense-first", "sebp-first")]
    fsdp1 = list(FSDP)
    fsdp1[fsdp1.index("--fsdp_version") + 1] = "1"
    return [*_prep(), *pairs, Job([*eager, "-o", str(runs / "resume_ref"), "--overwrite"]),
            *interrupted(runs / "resume", eager),
            Job([*fsdp1, *SFT, "--max-steps", "8", "--method", "sebp", "-o", str(runs / "fsdp1"), "--overwrite"]),
            collect(out, "fsdp-sft", "fsdp.json", "sft_compiled")]


def _fsdp_det(out: Path, gpu: str) -> list[Job]:
    runs = out / "fsdp_det"
    det = [*FSDP, *SFT, "--max-steps", "16", "--method", "sebp", "--eval-steps", "8", "--deterministic"]
    scope = [PY, "-m", "sebp_probe", "finetune", *SFT, "--compile", "default", "--compile-scope", "layers",
             "--max-steps", "10", "--method", "sebp", "-o", str(runs / "scope_layers"), "--overwrite"]
    return [*_prep(), *(Job([*det, "-o", str(runs / name), "--overwrite"]) for name in ("ref", "ref2")),
            *interrupted(runs / "resume", det), Job(scope, env={"CUDA_VISIBLE_DEVICES": "0"}),
            collect(out, "fsdp-det", "fsdp.json", "deterministic")]


def _compare(out: Path, gpu: str) -> list[Job]:
    common = [SMALL, "tweets", "--max-steps", "40", "--batch-size", "32", "--max-length", "128", "--bf16",
              "--eval-samples", "256", "--seed", "0", "--compare"]
    pairs = {"eager": ["--padding", "longest"], "compile": ["--padding", "longest", "--compile", "default"],
             "padded": ["--padding", "max_length", "--cuda-graphs"],
             "forced": ["--padding", "longest", "--always-sebp", "--dense-fallback", "1"]}
    return [*_prep(), *(Job([PY, "-m", "sebp_probe", "finetune", *common, *extra,
                             *(["--sebp-first"] if order == "sebp-first" else []),
                             "-o", str(out / "compare" / f"{name}_{order}"), "--overwrite"])
                        for name, extra in pairs.items() for order in ("dense-first", "sebp-first")),
            collect(out, "compare", "finetune.json", "compare")]


STEPS: dict[str, Step] = {
    "tests": Step("every GPU-marked test (tests/kernels, then the rest)", "-", _tests),
    "layers": Step("one linear layer's backward against cuBLAS and the ideal", "kernels.md, benchmarks.md", _layers),
    "model": Step("one training step per model and layout, eager and CUDA graphs", "benchmarks.md", _model),
    "compiled": Step("packed and `longest` compiled, dense, dense + CCE and SEBP", "README, benchmarks.md",
                     _compiled),
    "compiled-longest": Step("`longest` compiled, each entry in its own process", "benchmarks.md",
                             _compiled_longest),
    "probe": Step("a finetune --probe-every step against an unprobed one, eager and compiled", "method.md",
                  _probe),
    "sampled": Step("sampled mode (budget 0.5) beside dense, SEBP, CCE and Liger, eager and compiled", "method.md",
                    _sampled),
    "head": Step("the labelled-rows head against the full head, CCE and Liger", "benchmarks.md", _head),
    "trainer": Step("SFTTrainer with and without apply_sebp, eager, padding-free and compiled", "trainer.md",
                    _trainer),
    "resprop": Step("gradient reuse's backward on a GPU", "benchmarks.md", _resprop),
    "kernels": Step("the norm kernels alone", "kernels.md", _kernels),
    "fsdp": Step("one GPU against FSDP2 on two, dense, SEBP, LoRA (two GPUs)", "finetune.md", _fsdp),
    "fsdp-sft": Step("FSDP2 on SFT-length batches, compiled, both orders; SIGTERM + --resume; FSDP1 (two GPUs)",
                     "benchmarks.md", _fsdp_sft),
    "fsdp-det": Step("--deterministic under FSDP2: twice, SIGTERM + --resume; a compile by layers (two GPUs)",
                     "finetune.md", _fsdp_det),
    "compare": Step("finetune --compare pairs in both orders, a small Llama", "finetune.md", _compare),
}


def gpu_name() -> str:
    """``h100``, ``h200``...: the model number of GPU 0, for the run names of the per-GPU families."""
    try:
        import torch

        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        name = "cpu"
    return next((w.lower() for w in name.split() if w[:1].isalpha() and any(c.isdigit() for c in w)), "gpu")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("steps", nargs="*", help=f"of: {', '.join(STEPS)}")
    p.add_argument("--out", type=Path, default=Path("/tmp/gpu_suite"), help="where the runs write")
    p.add_argument("--add", action="store_true", help="put each result into its family file under results/")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--list", action="store_true", help="list the steps")
    a = p.parse_args(argv)
    if a.list or not a.steps:
        for name, s in STEPS.items():
            print(f"{name:17} {s.what} (feeds: {s.feeds})")
        return 0
    unknown = [s for s in a.steps if s not in STEPS]
    if unknown:
        p.error(f"unknown step(s) {', '.join(unknown)}; known: {', '.join(STEPS)}")
    gpu = gpu_name()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    failed = []
    for name in a.steps:
        print(f"=== {name}: {STEPS[name].what}", flush=True)
        for job in STEPS[name].jobs(a.out, gpu):
            print("$ " + shlex.join(job.argv), flush=True)
            if a.dry_run:
                continue
            if job.out is not None:
                job.out.parent.mkdir(parents=True, exist_ok=True)
            rc = subprocess.run(job.argv, cwd=ROOT, env={**env, **job.env}).returncode
            if rc:
                failed.append(f"{name}: {shlex.join(job.argv[:6])} ... (exit {rc})")
                continue
            if a.add and job.add:
                subprocess.run([PY, str(ROOT / "tools" / "docs" / "make_docs.py"), "--add", *job.add, str(job.out)],
                               cwd=ROOT, check=True)
    for line in failed:
        print(f"failed: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
