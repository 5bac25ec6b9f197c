"""TRL SFTTrainer steps per second, plain and with sebp_probe.integrations.hf.apply_sebp, eager and with
``torch_compile=True``, beside SFTTrainer with ``use_liger_kernel=True``.

    python benchmarks/trainer_bench.py --out trainer.json                 # a GPU: llama-3.2-1b-sft lengths
    python benchmarks/trainer_bench.py --out trainer.json --padding-free  # the same with TRL's padding-free batches
    python benchmarks/trainer_bench.py --out tiny.json --tiny --steps 2 --variants plain,sebp   # a CPU check

The model is the case's (``--case``, from sebp_probe.bench.bench_cases: random weights, fp32 parameters; on a GPU the
trainer's bf16 autocast), the data the case's sequences (``--max-length``, ``--batch``: its length distribution
and prompt share, labels -100 on the prompt), the same batches for every variant. Variants:

  plain            SFTTrainer as it comes (TRL's fused LM head)
  sebp             the same after apply_sebp(trainer): calibrated SEBP layers, the labelled-rows loss
  plain+compile    torch_compile=True
  sebp+compile     torch_compile=True after apply_sebp: each layer of the model compiled in place (the
                   default compile_scope="layers"; SEBP layers as sebp:: operators), the rest of the
                   labelled-rows loss eager
  sebp+compile-whole  the same with apply_sebp(compile_scope="loss"): the labelled-rows loss compiled whole
  liger            use_liger_kernel=True (Liger's layer kernels; TRL keeps its own fused head), if importable
  liger+compile    the same with torch_compile=True
  liger+sebp       use_liger_kernel=True and apply_sebp
  liger+sebp+compile  the same with torch_compile=True
  sebp-head        diagnostic: apply_sebp with every layer left dense (the labelled-rows loss alone)
  sebp-layers      diagnostic: apply_sebp(head="full") (the SEBP layers under the trainer's own loss)
  sebp-cudnn       diagnostic: apply_sebp(keep_cudnn_attention=True) (sdpa's own choice of kernel)
  sebp-cce         apply_sebp(head="cce"): the SEBP layers, then Cut-Cross-Entropy on the labelled rows
  sebp-cce+compile the same with torch_compile=True (each layer compiled in place)
  <any>-nocudnn    the same inside sebp_probe.model.sdpa.without_cudnn_attention(): sdpa without cuDNN's
                   attention, which builds a host-side plan for each new batch shape

Each variant runs in its own process (``torch_compile`` and Liger change process-wide state), ``--warmup``
optimizer steps, then ``--steps`` timed ones: the median time between the ends of consecutive steps (data
loading included, as a user's run sees it). ``--rounds N`` runs the list N times, reversing the order each
round (a machine that drifts favours no variant), and takes each variant's median over all its rounds'
steps. A variant that fails or cannot run is recorded with its reason.
The JSON holds the device, the versions, the date, the command and, per variant, steps/s and the losses.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: the repository's packages

from sebp_probe.bench.bench_cases import MODEL_CASES, make_items, sample_lengths, tiny  # noqa: E402
from sebp_probe.bench.bench_model import build_model  # noqa: E402
from sebp_probe.train.rundir import device_name, versions  # noqa: E402

VARIANTS = ("plain", "sebp", "plain+compile", "sebp+compile", "sebp+compile-whole", "liger", "liger+compile",
            "liger+sebp", "liger+sebp+compile", "sebp-head", "sebp-layers", "sebp-cudnn", "sebp-cce",
            "sebp-cce+compile")
# the pairs the docs compare: (variant, baseline)
PAIRS = (("sebp", "plain"), ("sebp", "plain+compile"), ("sebp", "liger+compile"),
         ("sebp+compile", "plain+compile"), ("sebp-head", "plain"), ("sebp-layers", "plain"),
         ("plain-nocudnn", "plain"), ("sebp", "plain-nocudnn"), ("sebp-cudnn", "plain"),
         ("liger+sebp", "plain"), ("liger+sebp", "liger"), ("liger+sebp", "liger-nocudnn"),
         ("sebp+compile", "liger+compile"), ("sebp+compile", "liger+compile-nocudnn"),
         ("liger+sebp+compile", "liger+compile"), ("liger+sebp+compile", "liger+compile-nocudnn"),
         ("sebp", "liger+compile-nocudnn"), ("liger+sebp", "liger+compile-nocudnn"),
         ("sebp+compile", "liger-nocudnn"), ("sebp+compile", "sebp"), ("liger+compile-nocudnn", "liger-nocudnn"),
         ("sebp+compile", "sebp+compile-whole"), ("sebp+compile-whole", "liger+compile-nocudnn"),
         ("sebp+compile", "plain+compile-nocudnn"), ("sebp+compile-whole", "plain+compile-nocudnn"),
         ("plain+compile-nocudnn", "liger+compile-nocudnn"), ("sebp", "liger-nocudnn"),
         ("sebp-cce", "sebp"), ("sebp-cce+compile", "sebp+compile"), ("sebp-cce+compile", "plain+compile-nocudnn"))
_APPLY = {"sebp": {}, "sebp+compile": {}, "sebp+compile-whole": {"compile_scope": "loss"}, "liger+sebp": {},
          "liger+sebp+compile": {},
          "sebp-head": {"dense_fallback": 0.0},
          "sebp-layers": {"head": "full"}, "sebp-cudnn": {"keep_cudnn_attention": True},
          "sebp-cce": {"head": "cce"}, "sebp-cce+compile": {"head": "cce"}}


def _tokenizer(vocab_size: int):
    """A word-level tokenizer over the case's ids (SFTTrainer wants one for its pad token; the data is
    already tokenized). Id 0 is the pad, as the cases' PAD_ID."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, min(vocab_size, 1000))}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                   pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _step_timer():
    from transformers import TrainerCallback

    from torch._dynamo.utils import counters

    class StepTimer(TrainerCallback):
        """Each optimizer step's end, and how many graphs Dynamo had compiled in this process by then."""

        def __init__(self):
            self.ends, self.graphs = [], []

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.ends.append(time.perf_counter())
            self.graphs.append(counters["stats"]["unique_graphs"])

    return StepTimer()


def _step_profiler(first: int, steps: int, path: str):
    """A callback that runs torch.profiler over optimizer steps ``first`` .. ``first + steps - 1`` (1-based) and
    writes the operators' table (by device time, then by host time) to ``path``."""
    from transformers import TrainerCallback

    class StepProfiler(TrainerCallback):
        prof = None

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step + 1 == first:
                acts = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                self.prof = torch.profiler.profile(activities=acts)
                self.prof.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if self.prof is not None and state.global_step == first + steps - 1:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.prof.__exit__(None, None, None)
                table = self.prof.key_averages()
                dev = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                Path(path).write_text(f"{steps} steps from step {first}\n\nby device time\n"
                                      + table.table(sort_by=dev, row_limit=45, max_name_column_width=70)
                                      + "\n\nby host time\n"
                                      + table.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70))
                self.prof = None

    return StepProfiler()


def run_variant(variant: str, opts: argparse.Namespace, out_dir: str) -> dict:
    """Train ``variant`` for ``opts.warmup + opts.steps`` optimizer steps; its timing and losses."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from sebp_probe.integrations.hf import apply_sebp
    from sebp_probe.model.sdpa import without_cudnn_attention

    case = _case(opts)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    total = opts.warmup + opts.steps
    lengths = sample_lengths(case.lengths, case.batch * total, case.max_length, seed=0)
    rows = make_items(case, lengths, case.config["vocab_size"], seed=0)
    base, nocudnn = variant.removesuffix("-nocudnn"), variant.endswith("-nocudnn")
    compiled, liger = "+compile" in base, base.startswith("liger")
    args = SFTConfig(output_dir=out_dir, max_steps=total, per_device_train_batch_size=case.batch,
                     learning_rate=1e-5, bf16=cuda, use_cpu=not cuda, padding_free=opts.padding_free,
                     max_length=None, gradient_checkpointing=opts.checkpointing, torch_compile=compiled,
                     use_liger_kernel=liger, report_to=[], logging_steps=1, save_strategy="no",
                     disable_tqdm=True, log_level="error", seed=0, dataloader_drop_last=True)
    timer = _step_timer()
    callbacks = [timer]
    if opts.profile:  # the last warm-up steps, ahead of the timer: the profiler's work is timed in no step
        callbacks.insert(0, _step_profiler(opts.warmup - opts.profile + 1, opts.profile,
                                           f"{opts.profile_to or opts.out}.{variant}.prof.txt"))
    trainer = SFTTrainer(model=build_model(case, torch.float32, device), args=args,
                         train_dataset=Dataset.from_list(rows), processing_class=_tokenizer(case.config["vocab_size"]),
                         callbacks=callbacks)
    result = {"variant": variant}
    # the variant's calibration and training; the process gets sdpa's flags back (--in-process runs others after)
    with without_cudnn_attention() if nocudnn else contextlib.nullcontext():
        handle = apply_sebp(trainer, **_APPLY[base]) if base in _APPLY else None
        trainer.train()
    if handle is not None:  # the head, the calibration (layers kept, densities), and, read after the training,
        result["sebp"] = handle.to_dict()  # whether a compiled layer or loss failed to compile and ran eagerly
    first = max(opts.warmup - 1, 0)  # from the end of the last warm-up step
    ends, graphs = timer.ends[first:], timer.graphs[first:]
    times = [b - a for a, b in zip(ends, ends[1:])]
    median = statistics.median(times)
    result.update(steps_per_s=1.0 / median, step_ms_median=median * 1e3, step_ms_mean=statistics.mean(times) * 1e3,
                  step_ms=[t * 1e3 for t in times],
                  step_graphs=[b - a for a, b in zip(graphs, graphs[1:])],  # Dynamo graphs compiled in each
                  loss=[h["loss"] for h in trainer.state.log_history if "loss" in h])
    if cuda:
        result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    return result


def _case(opts: argparse.Namespace):
    case = MODEL_CASES[opts.case]
    case = tiny(case) if opts.tiny else case
    return replace(case, max_length=opts.max_length or case.max_length, batch=opts.batch or case.batch)


def _isolated(variant: str, opts: argparse.Namespace) -> dict:
    """``variant`` in a fresh process: its result, or why it did not run."""
    flags = [f for f, on in (("--tiny", opts.tiny), ("--padding-free", opts.padding_free),
                             ("--checkpointing", opts.checkpointing)) if on]
    sizes = [a for k, v in (("--max-length", opts.max_length), ("--batch", opts.batch), ("--profile", opts.profile))
             if v for a in (k, str(v))]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--case", opts.case, *flags, *sizes, "--steps", str(opts.steps),
               "--warmup", str(opts.warmup), "--variants", variant, "--in-process", "--out", str(out)]
        if opts.profile:  # the profile goes beside the caller's JSON
            cmd += ["--profile-to", opts.out]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            return {"variant": variant, "error": f"exit code {proc.returncode}: {tail[0]}"}
        return json.loads(out.read_text())["results"][0]


def _pooled(rounds: list[dict]) -> dict:
    """One variant's result over its rounds: the first round's record, its step times and losses those of every
    round in turn, steps/s from the median of all the steps, and each round's own steps/s; a round that failed
    makes the variant's error."""
    failed = next((r for r in rounds if "steps_per_s" not in r), None)
    if failed is not None or len(rounds) == 1:
        return failed or rounds[0]
    times = [t for r in rounds for t in r["step_ms"]]
    median = statistics.median(times)
    return {**rounds[0], "steps_per_s": 1e3 / median, "step_ms_median": median,
            "step_ms_mean": statistics.mean(times), "step_ms": times, "loss": [x for r in rounds for x in r["loss"]],
            **({"step_graphs": [g for r in rounds for g in r["step_graphs"]]} if "step_graphs" in rounds[0] else {}),
            "round_steps_per_s": [r["steps_per_s"] for r in rounds],
            **({"peak_gib": max(r["peak_gib"] for r in rounds)} if "peak_gib" in rounds[0] else {})}


def _ratios(results: list[dict]) -> dict[str, float]:
    """The steps/s ratios of the pairs the docs compare, where both variants ran."""
    speed = {r["variant"]: r.get("steps_per_s") for r in results}
    return {f"{v}/{b}": speed[v] / speed[b] for v, b in PAIRS if speed.get(v) and speed.get(b)}


def _paired(results: list[dict]) -> dict[str, dict]:
    """The same pairs compared step by step (every variant trains on the same batches in the same order): the
    median over the timed steps of the baseline's step time over the variant's, leaving out the steps in which
    either compiled a graph (a compile or recompile: its seconds are the compile's, not the step's), and how
    many steps that left out."""
    by = {r["variant"]: r for r in results if "step_ms" in r}
    out = {}
    for v, b in PAIRS:
        if v not in by or b not in by or len(by[v]["step_ms"]) != len(by[b]["step_ms"]):
            continue
        n = len(by[v]["step_ms"])
        graphs = [by[x].get("step_graphs", [0] * n) for x in (v, b)]
        kept = [i for i in range(n) if graphs[0][i] == 0 and graphs[1][i] == 0]
        if kept:
            out[f"{v}/{b}"] = {"ratio": statistics.median([by[b]["step_ms"][i] / by[v]["step_ms"][i] for i in kept]),
                               "steps": len(kept), "left_out": n - len(kept)}
    return out


def _unavailable(variant: str) -> str | None:
    import importlib.util

    variant = variant.removesuffix("-nocudnn")
    if variant.startswith("liger") and importlib.util.find_spec("liger_kernel") is None:
        return "liger_kernel is not installed"
    if "+compile" in variant and not torch.cuda.is_available():
        return "torch_compile runs Inductor, which on a CPU needs a C++ toolchain; benchmarked on GPUs only"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the JSON to write")
    p.add_argument("--case", default="llama-3.2-1b-sft", choices=[n for n, c in MODEL_CASES.items()
                                                                   if c.task == "causal-lm"])
    p.add_argument("--tiny", action="store_true", help="the case shrunk to a tiny model (a CPU check)")
    p.add_argument("--max-length", type=int, help="the longest sequence (default: the case's)")
    p.add_argument("--batch", type=int, help="sequences per batch (default: the case's)")
    p.add_argument("--padding-free", action="store_true", help="TRL's padding-free batches for every variant")
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (SFTConfig's default) "
                   "for every variant; off by default here")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps (at least 2)")
    p.add_argument("--warmup", type=int, default=5, help="optimizer steps before timing")
    p.add_argument("--profile", type=int, default=0, metavar="K", help="profile the last K warm-up steps (K < "
                   "--warmup) and write each variant's operator table beside --out")
    p.add_argument("--profile-to", help=argparse.SUPPRESS)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--rounds", type=int, default=1, help="run the variants this many times, the order reversed "
                   "each round (each variant's steps/s then comes from the median of all its rounds' steps)")
    p.add_argument("--in-process", action="store_true", help="run the variants in this process, one after the "
                   "other (compile and Liger change process-wide state: for one variant, or eager ones)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="instead of running: merge these outputs of "
                   "earlier runs (the same case, steps and device; each variant once) into --out")
    opts = p.parse_args(argv)
    if opts.merge:
        return merge(opts.merge, opts.out)
    variants = [v for v in opts.variants.split(",") if v]
    unknown = [v for v in variants if v.removesuffix("-nocudnn") not in VARIANTS]
    if unknown or opts.steps < 2:
        p.error(f"unknown variants {unknown}" if unknown else "--steps must be at least 2")
    if opts.rounds < 1:
        p.error("--rounds must be at least 1")
    if not 0 <= opts.profile < opts.warmup:
        p.error("--profile K needs 0 <= K < --warmup")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(opts.rounds):  # the variants in their order, then reversed, and so on
        for v in (variants if r % 2 == 0 else variants[::-1]):
            why = _unavailable(v)
            if why is not None:
                runs[v].append({"variant": v, "error": why})
            elif opts.in_process:
                with tempfile.TemporaryDirectory() as tmp:
                    runs[v].append(run_variant(v, opts, tmp))
            else:
                runs[v].append(_isolated(v, opts))
    results = [_pooled(runs[v]) for v in variants]
    ratios = _ratios(results)
    import trl

    vers = {**versions(), "trl": trl.__version__}
    try:
        import liger_kernel  # noqa: F401
        from importlib.metadata import version

        vers["liger_kernel"] = version("liger-kernel")
    except ImportError:
        pass
    case = _case(opts)
    doc = {"tool": "benchmarks/trainer_bench.py",
           "command": " ".join(["python", "benchmarks/trainer_bench.py", *argv]),
           "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "device": device_name(torch.device("cuda" if torch.cuda.is_available() else "cpu")), "versions": vers,
           "case": {"name": case.name, "batch": case.batch, "max_length": case.max_length, "lengths": case.lengths,
                    "prompt": case.prompt, "padding_free": opts.padding_free,
                    "gradient_checkpointing": opts.checkpointing},
           "steps": opts.steps, "warmup": opts.warmup, "rounds": opts.rounds, "results": results,
           "ratios": ratios, "paired": _paired(results)}
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(doc, indent=2) + "\n")
    for r in results:
        print(f"{r['variant']:>15}: " + (f"{r['steps_per_s']:.3f} steps/s" if "steps_per_s" in r else r["error"]))
    for k, v in ratios.items():
        print(f"{k:>30}: {v:.3f}x")
    return 0


def merge(paths: list[str], out: str) -> int:
    """One JSON of the variants of several runs (each its own call where one would not fit a time limit): their
    results side by side, the ratios between them, each run's command and date."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    same = ("case", "steps", "warmup", "rounds", "device")
    for d, path in zip(docs[1:], paths[1:]):
        differ = [k for k in same if d.get(k) != docs[0].get(k)]
        if differ:
            raise SystemExit(f"error: --merge: {path} differs from {paths[0]} in {', '.join(differ)}")
    results = [r for d in docs for r in d["results"]]
    twice = sorted({r["variant"] for r in results if sum(q["variant"] == r["variant"] for q in results) > 1})
    if twice:
        raise SystemExit(f"error: --merge: variants {twice} are in more than one of the files")
    doc = {**docs[0], "command": "; ".join(d["command"] for d in docs),
           "date": max(d["date"] for d in docs), "merged": [{"command": d["command"], "date": d["date"]} for d in docs],
           "results": results, "ratios": _ratios(results), "paired": _paired(results)}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
