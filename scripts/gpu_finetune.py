"""One GPU fine-tuning experiment of scripts/gpu_finetune.sh: dense vs SEBP through sebp_probe.finetune.

Models are built from configs with random weights (BERT-base; a Llama-shaped decoder), the data are
synthetic token sequences whose lengths follow a log-normal law (most far below max_length, as in real
fine-tuning sets), so nothing is downloaded and neither `datasets` nor `kneed` is imported.

    python scripts/gpu_finetune.py --exp bert_bf16_max --out $OUT          # one GPU
    accelerate launch --multi_gpu --num_processes 2 scripts/gpu_finetune.py --exp bert_exact_fp32 --out $OUT
    python scripts/gpu_finetune.py --collect --out $OUT                    # $OUT/finetune_gpu.json
    PROFILE_STEPS=40:50 python scripts/gpu_finetune.py --exp ...           # + torch.profiler, steps 41-50
    GC_TRACE=1 python scripts/gpu_finetune.py --exp ...                    # + every garbage collection timed
    SEBP_FIRST=1 python scripts/gpu_finetune.py --exp ...                  # SEBP's run first (--sebp-first)

Each experiment writes $OUT/<exp>.json (the finetune summary, its settings, versions, the command) and
copies its metrics.jsonl and curves; the run directories themselves (checkpoints, saved models) stay in
/tmp, too large to bring back.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

# name: (model, padding, precision, steps, force SEBP on every target layer)
EXPERIMENTS = {
    "bert_exact_fp32": ("bert", "max_length", "fp32", 40, True),
    "bert_bf16_max": ("bert", "max_length", "bf16", 100, False),
    "bert_bf16_longest": ("bert", "longest", "bf16", 100, False),
    "llama_exact_fp32": ("llama", "max_length", "fp32", 30, True),
    "llama_bf16_max": ("llama", "max_length", "bf16", 60, False),
    "llama_bf16_longest": ("llama", "longest", "bf16", 60, False),
    # Llama-3.2-3B-wide (8 of its 28 layers, ~1B parameters) at 1 x 4096 with short samples: big GPU steps
    "llama3b_bf16_max": ("llama3b", "max_length", "bf16", 30, False),
    "llama3b_bf16_longest": ("llama3b", "longest", "bf16", 30, False),
}
NORMS = "_norms"
ACTS = "_norms_acts"  # the SEBP norms and the SEBP activations (--sebp-norms --sebp-acts)
GRAPHS = "_graphs"  # --cuda-graphs
COMPILED = "_compiled"  # --compile reduce-overhead, or $COMPILE_MODE (instead of --cuda-graphs)
SHAPES = {  # batch, max_length, median length, log-normal sigma
    "bert": (32, 128, 40, 0.6),
    "llama": (8, 512, 160, 0.7),
    "llama3b": (1, 4096, 200, 0.6),
}
# environment variables that change what an experiment runs or records: written into its "command"
SETTING_VARS = ("SEBP_FIRST", "COMPILE_MODE", "PROFILE_STEPS", "GC_TRACE", "MEMORY_TRACE")
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def synthetic_data(task: str, n: int, n_eval: int, max_len: int, median: int, sigma: float, vocab: int, seed=0):
    from sebp_probe.train_data import TrainData

    rng = random.Random(seed)

    def item():
        length = int(min(max_len, max(8, round(rng.lognormvariate(math.log(median), sigma)))))
        ids = [rng.randint(5, vocab - 1) for _ in range(length)]
        if task == "classification":
            return {"input_ids": ids, "label": ids[1] % 3}
        return {"input_ids": ids, "labels": list(ids)}

    return TrainData(task, [item() for _ in range(n)], [item() for _ in range(n_eval)], pad_id=0,
                     label_names=["a", "b", "c"] if task == "classification" else [],
                     identity={"synthetic": True, "length": f"lognormal(median={median}, sigma={sigma}) "
                               f"clipped to [8, {max_len}]", "seed": seed})


def model_loader(kind: str, smoke: bool = False):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, BertConfig, LlamaConfig

    from sebp_probe.assets import LoadedModel

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4) if smoke else {}
    if kind == "bert":  # BERT-base: 12 x 768, 110M parameters
        cfg = BertConfig(num_labels=3, **small)
        return (lambda: LoadedModel(AutoModelForSequenceClassification.from_config(cfg), None, "classification",
                                    "bert-base (config, random init)", "config")), cfg.vocab_size
    if kind == "llama3b":
        shape = dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=8, num_attention_heads=24,
                     num_key_value_heads=8, max_position_embeddings=8192)
        name = "llama-3.2-3b-wide, 8 layers (config, random init)"
    else:
        shape = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                     num_key_value_heads=4, max_position_embeddings=1024)
        name = "llama-shaped 12 x 1024 (config, random init)"
    cfg = LlamaConfig(**{**shape, **small, **({"num_key_value_heads": 2} if smoke else {})}, vocab_size=32000, pad_token_id=0, tie_word_embeddings=False)
    return (lambda: LoadedModel(AutoModelForCausalLM.from_config(cfg), None, "causal-lm", name, "config")), \
        cfg.vocab_size


def run(exp: str, out: Path, smoke: bool = False) -> None:
    import torch

    from sebp_probe.config import DataConfig, FinetuneConfig
    from sebp_probe.finetune import finetune, versions

    graphs = exp.endswith(GRAPHS)  # any experiment + "_graphs": --cuda-graphs (after "_norms"/"_norms_acts")
    compiled = exp.endswith(COMPILED)  # or + "_compiled": --compile reduce-overhead
    base = exp.removesuffix(GRAPHS).removesuffix(COMPILED)
    acts = base.endswith(ACTS)
    norms = acts or base.endswith(NORMS)  # any experiment + "_norms": the SEBP norms too (--sebp-norms)
    kind, padding, precision, steps, force = EXPERIMENTS[base.removesuffix(ACTS) if acts else base.removesuffix(NORMS)]
    batch, max_len, median, sigma = SHAPES[kind]
    if smoke:  # a CPU check of the script itself: tiny shapes, a few steps, fp32
        steps, batch, precision = 4, 4, "fp32"
    load_fn, vocab = model_loader(kind, smoke)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data = synthetic_data("classification" if kind == "bert" else "causal-lm", n=steps * batch * world + 64,
                          n_eval=128 * world, max_len=max_len, median=median, sigma=sigma, vocab=vocab)
    run_dir = Path(os.environ.get("RUN_ROOT", "/tmp/sebp-finetune-runs")) / f"{exp}-{world}gpu"
    cfg = FinetuneConfig(
        model=kind, data=DataConfig(max_length=max_len, batch_size=batch, padding=padding),
        output_dir=str(run_dir), compare=True, max_steps=steps, lr=1e-4 if kind == "bert" else 3e-4,
        warmup_ratio=0.1, precision=precision, eval_steps=steps, eval_samples=None,
        targets=LLAMA_TARGETS if kind.startswith("llama") else None,
        dense_fallback=1.0 if force else 0.9, fallback_if_slower=not force, sebp_norms=norms, sebp_acts=acts,
        cuda_graphs=graphs, compile=os.environ.get("COMPILE_MODE", "reduce-overhead") if compiled else None, seed=0,
        sebp_first=os.environ.get("SEBP_FIRST") == "1")
    t0 = time.time()
    traces: dict = {}
    tracers = []  # every one asked for sees every event
    if os.environ.get("MEMORY_TRACE"):
        tracers.append(_memory_tracer(traces))
    if os.environ.get("GC_TRACE"):  # Python's garbage collections: when, which generation, how long
        tracers.append(_gc_tracer(out / f"{exp}-gc.txt"))
    if os.environ.get("PROFILE_STEPS"):  # e.g. "20:30": where a step's wall time goes, steps 21-30 of each run
        tracers.append(_step_profiler(*map(int, os.environ["PROFILE_STEPS"].split(":")), out / f"{exp}-profile.txt"))
    on_event = (lambda kind, payload: [t(kind, payload) for t in tracers]) if tracers else None
    summary = finetune(cfg, overwrite=True, load_fn=load_fn, data=data, on_event=on_event)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if traces and rank0:
        _print_traces(traces)
    if not rank0:
        return
    res = {
        "experiment": exp, "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([*(f"{k}={os.environ[k]}" for k in SETTING_VARS if os.environ.get(k)), *sys.argv]),
        "world_size": world, "wall_s": time.time() - t0,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "versions": versions(), "settings": cfg.to_dict(), "data": data.identity,
        "mean_length": sum(len(x["input_ids"]) for x in data.train) / len(data.train),
        "summary": summary,
    }
    (out / f"{exp}-{world}gpu.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    for m in ("dense", "sebp"):
        if (run_dir / m / "metrics.jsonl").exists():
            shutil.copy(run_dir / m / "metrics.jsonl", out / f"{exp}-{world}gpu-{m}-metrics.jsonl")
    for png in ("loss.png", "eval.png"):
        if (run_dir / png).exists():
            shutil.copy(run_dir / png, out / f"{exp}-{world}gpu-{png}")
    shutil.rmtree(run_dir, ignore_errors=True)
    cmp = summary.get("comparison", {})
    print(f"{exp} ({world} GPU): " + ", ".join(f"{k} {v:.4g}" for k, v in cmp.items() if v is not None))


def _memory_tracer(traces: dict):
    """An on_event callback (MEMORY_TRACE=1) recording the CUDA allocator's history over the first three
    training steps of each run: which blocks are alive at the peak of those steps (``ddp_memory.py``)."""
    import torch

    from ddp_memory import start_recording, stop_recording

    def on_event(kind, payload):
        if kind == "start":
            traces[payload["run"]] = {"start_mib": torch.cuda.memory_allocated() / 2**20}
            start_recording()
        elif kind == "step" and payload["step"] == 3:
            rise, groups, pre_freed, pending = stop_recording(torch.cuda.current_device())
            traces[payload["run"]].update(rise_mib=rise / 2**20, groups=groups, pre_freed=pre_freed,
                                          pending_mib=pending / 2**20,
                                          peak_mib=torch.cuda.max_memory_allocated() / 2**20)
    return on_event


def _step_profiler(first: int, last: int, path: Path):
    """An on_event callback (PROFILE_STEPS=first:last) that runs torch.profiler over training steps first+1 to
    last of each run and appends to ``path``: the wall time per step, the GPU's busy time per step (kernels,
    memcpy and memset, overlaps counted once), and the ops that took the most host time (self CPU: the waits
    for the GPU show as cudaEventSynchronize / cudaStreamSynchronize / cudaDeviceSynchronize)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    state: dict = {}

    def on_event(kind, payload):
        if kind != "step":
            return
        if payload["step"] == first:
            gpu = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []  # (--smoke runs on a CPU)
            state["prof"] = profile(activities=[ProfilerActivity.CPU, *gpu])
            state["prof"].__enter__()
            state["t0"] = time.perf_counter()
        elif payload["step"] == last and "prof" in state:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall = (time.perf_counter() - state.pop("t0")) * 1e3 / (last - first)
            prof = state.pop("prof")
            prof.__exit__(None, None, None)
            spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                           if e.device_type == torch.autograd.DeviceType.CUDA)
            busy, end = 0.0, None  # union of the device intervals, us
            for a, b in spans:
                if end is None or a > end:
                    busy, end = busy + (b - a), b
                elif b > end:
                    busy, end = busy + (b - end), b
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
            with open(path, "a") as fh:
                fh.write(f"=== {payload['run']}: steps {first + 1}-{last}, wall {wall:.2f} ms/step (with the "
                         f"profiler on), GPU busy {busy / 1e3 / (last - first):.2f} ms/step\n{table}\n")
            print(f"{payload['run']}: profiled wall {wall:.2f} ms/step, GPU busy "
                  f"{busy / 1e3 / (last - first):.2f} ms/step ({path.name})")
    return on_event


def _gc_tracer(path: Path):
    """An on_event callback (GC_TRACE=1) that times every garbage collection of the training steps (gc.callbacks)
    and appends to ``path``, per run: collections per generation with total and longest ms, and the steps
    that took over 1.2x the run's median step time with the collection ms they held."""
    import gc
    import statistics

    state = {"step": 0, "t0": None}

    def cb(phase, info):
        if phase == "start":
            state["t0"] = time.perf_counter()
        elif state["t0"] is not None:
            ms = (time.perf_counter() - state["t0"]) * 1e3
            state["cur"].append((state["step"] + 1, info["generation"], ms))
            state["t0"] = None

    def on_event(kind, payload):
        if kind == "start":
            state["cur"], state["steps"], state["step"] = [], {}, payload.get("step", 0)
            gc.callbacks.append(cb)
        elif kind == "step":
            state["step"] = payload["step"]
            state["steps"][payload["step"]] = payload["step_ms"]
        elif kind == "end" and cb in gc.callbacks:
            gc.callbacks.remove(cb)
            cols, steps = state["cur"], state["steps"]
            med = statistics.median(steps.values()) if steps else 0.0
            lines = [f"=== {payload['run']}: {len(steps)} steps, median {med:.2f} ms"]
            for g in (0, 1, 2):
                ms = [c[2] for c in cols if c[1] == g]
                lines.append(f"gen{g}: {len(ms)} collections, {sum(ms):.1f} ms in all, "
                             f"longest {max(ms, default=0):.2f} ms")
            by_step: dict = {}
            for st, g, ms in cols:
                by_step[st] = by_step.get(st, 0.0) + ms
            slow = [(st, t) for st, t in steps.items() if st > 5 and t > 1.2 * med]
            lines.append("slow steps (step, ms, gc ms in it): " + ", ".join(
                f"({st}, {t:.1f}, {by_step.get(st, 0.0):.1f})" for st, t in slow))
            gen2 = sorted({st for st, g, _ in cols if g == 2})
            lines.append(f"steps holding a gen2 collection: {gen2}")
            with open(path, "a") as fh:
                fh.write("\n".join(lines) + "\n")
            print("\n".join(lines))
    return on_event


def _print_traces(traces: dict) -> None:
    for m, r in traces.items():
        print(f"{m:6s} allocated at the first step {r['start_mib']:.0f} MiB, peak of steps 1-3 "
              f"{r.get('peak_mib', 0):.0f} MiB, rise in the trace {r.get('rise_mib', 0):.0f} MiB, free pending "
              f"{r.get('pending_mib', 0):.0f} MiB")
        for k, v in sorted(r.get("pre_freed", {}).items(), key=lambda kv: -kv[1])[:6]:
            print(f"    freed by the peak, allocated before step 1: {v / 2**20:8.1f} MiB  {k}")
    d, s = traces.get("dense", {}).get("groups", {}), traces.get("sebp", {}).get("groups", {})
    print("alive at the peak of steps 1-3, MiB (dense, sebp), largest differences first:")
    for k in sorted(set(d) | set(s), key=lambda k: -abs(s.get(k, 0) - d.get(k, 0)))[:16]:
        print(f"  {d.get(k, 0) / 2**20:8.1f} {s.get(k, 0) / 2**20:8.1f}  {k}")


def collect(out: Path) -> None:
    """One table of every experiment's result in $OUT/finetune_gpu.json, printed too."""
    rows = []
    for p in sorted(out.glob("*-*gpu.json")):  # per-experiment files, not the table itself
        r = json.loads(p.read_text())
        runs = r["summary"].get("runs", {})
        d, s = runs.get("dense", {}), runs.get("sebp", {})
        c = r["summary"].get("comparison", {})
        rows.append({"experiment": r["experiment"], "gpus": r["world_size"], "gpu": r["gpu"],
                     "dense_backward_ms": d.get("mean_backward_ms"), "sebp_backward_ms": s.get("mean_backward_ms"),
                     "dense_step_ms": d.get("mean_step_ms"), "sebp_step_ms": s.get("mean_step_ms"),
                     "speedup_backward": c.get("speedup_backward"), "speedup_step": c.get("speedup_step"),
                     "peak_mem_ratio": c.get("peak_mem_ratio"),
                     "peak_mem_ratio_from_step3": c.get("peak_mem_ratio_from_step3"),
                     "max_abs_loss_gap": c.get("max_abs_loss_gap"),
                     "sebp_layers": len((s.get("calibration") or {}).get("layers", {})),
                     "fallback_reason": (s.get("calibration") or {}).get("fallback_reason")})
    # SEBP at max_length against dense with dynamic padding (longest), same model and data. With padding
    # longest every batch has a new length, and the first arm of a --compare run pays the first-sight cost
    # of each one; when the second arm also ran dense (calibration kept every layer dense), it is the
    # warmed dense@longest and the fair reference.
    by = {(r["experiment"], r["gpus"]): r for r in rows}
    for kind in ("bert", "llama", "llama3b"):
        for g in {r["gpus"] for r in rows}:
            mx, lo = by.get((f"{kind}_bf16_max", g)), by.get((f"{kind}_bf16_longest", g))
            if mx and lo and mx["sebp_step_ms"] and lo["dense_step_ms"]:
                arm = "sebp" if lo["sebp_layers"] == 0 and lo["sebp_step_ms"] else "dense"
                rows.append({"experiment": f"{kind}: SEBP@max_length vs dense@longest", "gpus": g,
                             "dense_longest_arm": "second (warmed, all layers dense)" if arm == "sebp"
                             else "first (not warmed)",
                             "sebp_max_layers": mx["sebp_layers"],
                             "speedup_backward": lo[f"{arm}_backward_ms"] / mx["sebp_backward_ms"],
                             "speedup_step": lo[f"{arm}_step_ms"] / mx["sebp_step_ms"]})
    (out / "finetune_gpu.json").write_text(json.dumps(rows, indent=2) + "\n")
    for r in rows:
        print(json.dumps(r))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [e + s for e in EXPERIMENTS for s in ("", NORMS, ACTS)]
    ap.add_argument("--exp", choices=sorted([*names, *(e + s for e in names for s in (GRAPHS, COMPILED))]))
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/sebp-gpu"))
    ap.add_argument("--collect", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and 4 steps: checks the script on a CPU")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.collect:
        collect(out)
    elif a.exp:
        run(a.exp, out, a.smoke)
    else:
        ap.error("pass --exp NAME or --collect")


if __name__ == "__main__":
    main()
