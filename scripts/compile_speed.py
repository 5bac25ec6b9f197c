"""Is ``torch.compile`` faster than eager with SEBP layers? (CUDA GPU, bf16, the bench's BERT-base case)

BERT-base from its config (random weights), batch 32 x 512 with SST-2-like lengths (``sebp-probe bench
bert-base --scope model``'s first batch), forward + backward timed with CUDA events (median of ``--repeats``
after the compile warm-up), four runs on the same weights and batch:

- dense: eager, ``torch.compile(model)``, and ``mode="reduce-overhead"`` (Inductor's CUDA graphs);
- SEBP, the same three: every attention/MLP projection, LayerNorm and GELU swapped (exact mode).

Timed in train mode (dropout on, as in fine-tuning). It also records each compiled run's warm-up (compile)
time, Dynamo's graph-break count, and how far the compiled run's gradients are from its eager run's (per
parameter, the largest difference relative to the largest gradient; median over the parameters and the
worst one; one backward in eval mode, where no dropout mask differs; bf16, so Inductor's fused rounding
shows). The peak memory of a ``reduce-overhead`` run is left out: its CUDA-graph pool is not in torch's
allocator statistics.

    python scripts/compile_speed.py out.json [--repeats 20]
"""
import argparse
import datetime
import json
import statistics
import time

import torch
import torch._dynamo as dynamo
import transformers
import triton

from sebp_kernels import SEBPConfig
from sebp_probe.bench import MODEL_CASES, _batch, _build_model, _time_step, sample_lengths
from sebp_probe.patch import patch_activations, patch_model, patch_norms, unpatch_model


PROFILE = False


def grads(model, owner, batch):
    """Gradients of one backward in eval mode (dropout off: compiled code draws other dropout masks)."""
    owner.eval()
    owner.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    owner.train()
    out = {n: p.grad.detach().float().cpu() for n, p in owner.named_parameters() if p.grad is not None}
    owner.zero_grad(set_to_none=True)
    return out


def rel_diffs(a, b):
    """Per parameter: max |a - b| / (max |b| + 1e-6); the median over the parameters and the largest (name)."""
    d = {n: ((a[n] - b[n]).abs().max() / (b[n].abs().max() + 1e-6)).item() for n in b}
    worst = max(d, key=d.get)
    return {"median": round(statistics.median(d.values()), 5), "max": round(d[worst], 5), "max_param": worst}


def run(model, batch, repeats, compiled):
    entry = {}
    if compiled:
        dynamo.reset()
        dynamo.utils.counters.clear()
        fn = torch.compile(model, mode=compiled)
        t0 = time.perf_counter()
        for _ in range(3):
            fn.zero_grad(set_to_none=True)
            fn(**batch).loss.backward()
        torch.cuda.synchronize()
        entry["warmup_s"] = round(time.perf_counter() - t0, 1)
        entry["graph_breaks"] = sum(dynamo.utils.counters["graph_break"].values())
    else:
        fn = model
    entry.update(_time_step(fn, batch, repeats))
    if compiled == "reduce-overhead":  # its CUDA-graph pool is not in torch's allocator statistics
        entry["peak_gib"] = None
    if PROFILE:
        from torch.profiler import ProfilerActivity, profile

        fn.zero_grad(set_to_none=True)
        loss = fn(**batch).loss
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            loss.backward()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18, max_name_column_width=60),
              flush=True)
    entry["grads"] = grads(fn, model, batch)
    return entry


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="print a profile of one backward of each run")
    ap.add_argument("--runs", default="", help="comma-separated run names (default: all six)")
    args = ap.parse_args()
    global PROFILE
    PROFILE = args.profile
    case = MODEL_CASES["bert-base"]
    model = _build_model(case, torch.bfloat16)
    lengths = sample_lengths(case.lengths, case.batch, case.seq, seed=0)
    batch = _batch(case, lengths, case.seq, model.config.vocab_size, seed=0)
    runs = {}
    for name, sebp, compiled in (("dense_eager", False, None), ("dense_compiled", False, "default"),
                                 ("dense_compiled_ro", False, "reduce-overhead"),
                                 ("sebp_eager", True, None), ("sebp_compiled", True, "default"),
                                 ("sebp_compiled_ro", True, "reduce-overhead")):
        if args.runs and name not in args.runs.split(","):
            continue
        if sebp:
            patch_model(model, SEBPConfig("exact"))
            patch_norms(model)
            patch_activations(model)
        try:
            runs[name] = run(model, batch, args.repeats, compiled)
        except Exception as err:  # noqa: BLE001 (what a user would see is the result)
            runs[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
        if sebp:
            unpatch_model(model)
        print(name, {k: v for k, v in runs[name].items() if k != "grads"}, flush=True)
    for name in ("dense", "sebp"):
        for suffix in ("", "_ro"):
            if "grads" not in runs.get(f"{name}_compiled{suffix}", {}) or f"{name}_eager" not in runs:
                continue
            runs[f"{name}_compiled{suffix}"]["grad_rel_diff_vs_eager"] = rel_diffs(
                runs[f"{name}_compiled{suffix}"]["grads"], runs[f"{name}_eager"]["grads"])
    for r in runs.values():
        r.pop("grads", None)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "transformers": transformers.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": "python scripts/compile_speed.py " + " ".join(f"{a}" for a in [args.out, "--repeats",
                                                                                   args.repeats]),
           "case": "bert-base, bf16, batch 32 x 512, SST-2-like lengths (seed 0)",
           "token_density": round(sum(lengths) / (case.batch * case.seq), 4), "runs": runs}
    for k in ("backward_ms", "step_ms"):
        if "dense_eager" in runs:
            out[f"{k}_speedup"] = {r: round(runs["dense_eager"][k] / runs[r][k], 3) for r in runs if k in runs[r]}
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=1))
    json.dump(out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
