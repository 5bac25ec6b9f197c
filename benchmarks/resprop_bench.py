"""GPU timing of ReSprop: backward and training-step time of a Llama-3.2-1B-shaped model, dense vs exact SEBP vs
ReSprop at several reuse levels.

The model is built from its config (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192, vocab
128256) with random weights, in bf16 (AdamW on bf16 parameters). Batches of ``--batch`` samples with log-normal
lengths (median ``--median-length``, at most ``--max-length``) are padded to their longest sample (right
padding, no loss on padding), the same batches for every variant. Each variant runs ``--warmup`` steps first
(Triton compilation, and P exists for ReSprop), then ``--repeats`` timed steps cycling over the batches; the
medians are reported. All variants share one model: patched, timed, unpatched in turn.

Usage: python benchmarks/resprop_bench.py [--levels 0,0.5,0.7,0.9,0.95,0.99] [--output runs/resprop_bench.json]
       python benchmarks/resprop_bench.py --tiny     # a small model on the CPU, to check the script
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages, not an installed copy

import torch  # noqa: E402

from sebp_kernels import SEBPConfig  # noqa: E402
from sebp_probe import __version__, patch_model, patch_resprop, unpatch_model, unpatch_resprop  # noqa: E402

LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, vocab_size=128256, max_position_embeddings=4096, tie_word_embeddings=True)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=160, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=True)


def environment(device: torch.device) -> dict:
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "sebp_probe": __version__,
           "python": platform.python_version(), "cuda": torch.version.cuda,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    env["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})"
    return env


def lognormal_lengths(n: int, median: int, sigma: float, longest: int, gen: torch.Generator) -> list[int]:
    """``n`` lengths, log-normal around ``median`` (log-space spread ``sigma``), clipped to [2, longest]."""
    z = torch.randn(n, generator=gen, dtype=torch.float64)
    return [int(min(longest, max(2, round(math.exp(math.log(median) + sigma * v))))) for v in z.tolist()]


def make_batch(lengths: list[int], vocab: int, gen: torch.Generator, device) -> dict:
    """Causal-LM batch padded to its longest sample on the right; padding carries no loss."""
    t = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), t), generator=gen)
    mask = (torch.arange(t)[None] < torch.tensor(lengths)[:, None]).long()
    ids = ids * mask
    labels = ids.masked_fill(mask == 0, -100)
    return {k: v.to(device) for k, v in {"input_ids": ids, "attention_mask": mask, "labels": labels}.items()}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_variant(model, opt, batches: list[dict], warmup: int, repeats: int, device) -> dict:
    """Median backward and whole-step (forward, backward, optimizer step) times in ms."""
    backward, step = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(warmup + repeats):
        b = batches[i % len(batches)]
        sync(device)
        t0 = time.perf_counter()
        loss = model(**b).loss
        sync(device)
        t1 = time.perf_counter()
        loss.backward()
        sync(device)
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        t3 = time.perf_counter()
        if i >= warmup:
            backward.append((t2 - t1) * 1e3)
            step.append((t3 - t0) * 1e3)
    out = {"backward_ms": round(statistics.median(backward), 3), "step_ms": round(statistics.median(step), 3),
           "backward_ms_all": [round(v, 3) for v in backward], "step_ms_all": [round(v, 3) for v in step],
           "final_loss": float(loss.detach())}
    if device.type == "cuda":
        out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a small model on the CPU (checks the script)")
    ap.add_argument("--levels", default="0,0.5,0.7,0.9,0.95,0.99", help="ReSprop reuse levels")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--median-length", type=int, default=300)
    ap.add_argument("--sigma", type=float, default=0.6, help="spread of the log-normal lengths (log space)")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--batches", type=int, default=4, help="different batches, cycled over the repeats")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default="runs/resprop_bench.json")
    ap.add_argument("--breakdown", action="store_true", help="also one profiled backward per variant on a GPU: "
                    "kernel time by kind and the slowest kernels (a backward's wall time far above its kernel "
                    "time means the host's launches bound it)")
    a = ap.parse_args(argv)
    levels = [float(v) for v in a.levels.split(",") if v.strip()]
    if a.tiny:
        a.batch, a.median_length, a.max_length, a.batches, a.warmup, a.repeats = 2, 12, 32, 2, 2, 3
    device = torch.device("cpu" if a.tiny else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run with --tiny to check the script on the CPU")
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**(TINY if a.tiny else LLAMA_1B), pad_token_id=0)
    torch.manual_seed(a.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).train()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    gen = torch.Generator().manual_seed(a.seed)
    lengths = [lognormal_lengths(a.batch, a.median_length, a.sigma, a.max_length, gen) for _ in range(a.batches)]
    batches = [make_batch(ls, cfg.vocab_size, gen, device) for ls in lengths]
    tokens = sum(map(sum, lengths))
    result = {"experiment": "resprop_bench", "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
              "environment": environment(device),
              "settings": {"model": "tiny llama" if a.tiny else "Llama-3.2-1B shape (random weights)",
                           "config": TINY if a.tiny else LLAMA_1B, "dtype": "bfloat16", "optimizer": "AdamW",
                           "batch": a.batch, "median_length": a.median_length, "sigma": a.sigma,
                           "max_length": a.max_length, "lengths": lengths,
                           "token_density": round(tokens / sum(len(ls) * max(ls) for ls in lengths), 4),
                           "warmup": a.warmup, "repeats": a.repeats},
              "variants": {}}
    print(f"{result['environment']['device']}: batches of lengths {lengths}", flush=True)
    variants = [("dense", None), ("sebp_exact", None)] + [(f"resprop_{r:g}", r) for r in levels]
    for name, reuse in variants:
        if name == "sebp_exact":
            patch_model(model, SEBPConfig("exact"))
        elif reuse is not None:
            patch_resprop(model, reuse)
        r = time_variant(model, opt, batches, a.warmup, a.repeats, device)
        if a.breakdown and device.type == "cuda":
            from sebp_probe.bench.bench_steps import backward_breakdown

            r["breakdown"] = backward_breakdown(model, lambda: model(**batches[0]).loss, top=12)
            print(json.dumps(r["breakdown"]), flush=True)
        unpatch_model(model)
        unpatch_resprop(model)
        result["variants"][name] = r
        print(f"  {name:>14}: backward {r['backward_ms']:9.2f} ms, step {r['step_ms']:9.2f} ms", flush=True)
    dense = result["variants"]["dense"]
    for r in result["variants"].values():
        r["backward_vs_dense"] = round(r["backward_ms"] / dense["backward_ms"], 4)
        r["step_vs_dense"] = round(r["step_ms"] / dense["step_ms"], 4)
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
