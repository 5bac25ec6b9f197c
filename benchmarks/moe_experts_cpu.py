"""CPU experiment: the fused experts of a Mixtral layer (transformers 5's ``MixtralExperts``, grouped_mm forward),
forward and backward, dense against the SEBP experts (sebp_probe.model.experts), on padded batches.

The router's choice comes from the layer's own gate on random hidden states; dL/dY is random on the real tokens and
exactly zero on the padding tokens (as a loss gives them). Entries, each timed interleaved with the others on the
same inputs, ``--reps`` rounds:
  dense       the model's experts (transformers' grouped_mm forward, autograd's backward)
  sebp        the SEBP experts: the same forward, the backward over the routed rows whose dY is not zero
  real_rows   the dense experts on the real tokens alone: what dropping the padding before routing would cost
Writes one JSON: device, versions, date, command, and per padding share and entry the median, the quartiles and
the extremes of the forward and backward milliseconds, and of each round's backward over dense's in that round.

Usage: python benchmarks/moe_experts_cpu.py [--hidden 256] [--intermediate 512] [--experts 8] [--top-k 2]
       [--batch 8] [--length 128] [--padding 0,0.5] [--reps 21] [--output OUT.json]
       then: python tools/docs/make_docs.py --add moe_experts.json cpu OUT.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages, not an installed copy

import torch  # noqa: E402

from sebp_probe import __version__  # noqa: E402
from sebp_probe.families import family_of  # noqa: E402
from sebp_probe.model.experts import patch_experts  # noqa: E402
from resprop_cpu import cpu_name  # noqa: E402

ENTRIES = ("dense", "sebp", "real_rows")


def build(args):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=16, hidden_size=args.hidden, intermediate_size=args.intermediate,
                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                        num_local_experts=args.experts, num_experts_per_tok=args.top_k)
    torch.manual_seed(0)
    dense = MixtralForCausalLM(cfg).train()
    sebp = MixtralForCausalLM(cfg).train()
    sebp.load_state_dict(dense.state_dict())
    assert patch_experts(sebp, family_of(sebp), print) == ["model.layers.0.mlp.experts"]
    return dense.model.layers[0].mlp, sebp.model.layers[0].mlp


def inputs(args, block, padding: float, seed: int = 0):
    """Hidden states (tokens, hidden), the routing, dY (zero on the padding tokens) and the real-token mask."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(args.batch * args.length, args.hidden, generator=g)
    real = torch.ones(args.batch, args.length, dtype=torch.bool)
    for i in range(args.batch):  # lengths around the padding share, right padding
        keep = round(args.length * (1 - padding) * (0.5 + torch.rand((), generator=g).item()))
        keep = keep if padding else args.length
        real[i, min(max(keep, 1), args.length):] = False
    real = real.reshape(-1)
    with torch.no_grad():
        _, weights, index = block.gate(x)
    dy = torch.randn(x.shape, generator=g) * real.unsqueeze(1)
    return x, weights, index, dy, real


def timed(experts, x, weights, index, dy) -> tuple[float, float]:
    x = x.detach().requires_grad_(True)
    w = weights.detach().requires_grad_(True)
    t0 = time.perf_counter()
    y = experts(x, index, w)
    t1 = time.perf_counter()
    y.backward(dy)
    t2 = time.perf_counter()
    experts.zero_grad(set_to_none=True)
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def stats(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4)
    return {"median": statistics.median(xs), "q1": q[0], "q3": q[2], "min": min(xs), "max": max(xs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--padding", default="0,0.5")
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--output", default="moe_experts_cpu.json")
    args = ap.parse_args()
    import transformers

    dense, sebp = build(args)
    rows = []
    for share in (float(p) for p in args.padding.split(",")):
        x, weights, index, dy, real = inputs(args, dense, share)
        calls = {"dense": lambda: timed(dense.experts, x, weights, index, dy),
                 "sebp": lambda: timed(sebp.experts, x, weights, index, dy),
                 "real_rows": lambda: timed(dense.experts, x[real], weights[real], index[real], dy[real])}
        for fn in calls.values():  # warm-up
            fn()
        times = {e: ([], []) for e in ENTRIES}
        for _ in range(args.reps):
            for e in ENTRIES:
                f, b = calls[e]()
                times[e][0].append(f)
                times[e][1].append(b)
        for e in ENTRIES:  # per round against dense's of the same round: steadier than medians on a shared CPU
            ratios = [b / d for b, d in zip(times[e][1], times["dense"][1])]
            rows.append({"padding_share": round(1 - real.float().mean().item(), 4), "entry": e,
                         "tokens": int(x.shape[0]), "real_tokens": int(real.sum()),
                         "forward_ms": stats(times[e][0]), "backward_ms": stats(times[e][1]),
                         "backward_over_dense": stats(ratios)})
            r = rows[-1]
            print(f"padding {r['padding_share']:.3f} {e:10s} fwd {r['forward_ms']['median']:7.2f} "
                  f"bwd {r['backward_ms']['median']:7.2f} ms, bwd / dense {r['backward_over_dense']['median']:.3f} "
                  f"({r['backward_over_dense']['q1']:.3f}-{r['backward_over_dense']['q3']:.3f})")
    out = {"experiment": "moe_experts_cpu", "command": "python " + " ".join(sys.argv),
           "environment": {"cpu": cpu_name(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                           "transformers": transformers.__version__, "sebp_probe": __version__,
                           "python": platform.python_version(),
                           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
           "settings": {"model": "MixtralExperts (grouped_mm forward), fp32", "hidden": args.hidden,
                        "intermediate": args.intermediate, "experts": args.experts, "top_k": args.top_k,
                        "batch": args.batch, "length": args.length, "reps": args.reps},
           "rows": rows}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
