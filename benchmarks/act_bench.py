"""GPU time of the MLP activation, Hugging Face's ops (autograd) against the SEBP activation, and of the SEBP
linear backward with and without the rows the activation hands on (no selection pass).

    python3 benchmarks/act_bench.py OUT.json

Shapes: BERT-base's GELU (16384 x 3072) and the Llama-3.2-3B SwiGLU (4096 x 8192), bf16; dL/dH with the
padding layout of ``sebp_probe.bench.bench`` (the first rows of each sequence active) at densities 0.06, 0.2, 1.0.
"bwd_*_kernels": the backward's kernels alone (Hugging Face: the ops autograd runs; SEBP: the pass and the
compaction). Medians of CUDA-graph replays (the autograd backwards "bwd_hf"/"bwd_sebp": eager calls) with a cold L2
(``sebp_probe.bench.bench.time_methods``).
"""
from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from sebp_kernels import SEBPConfig
from sebp_kernels._triton import sebp_backward_triton
from sebp_kernels._triton.act import act_backward_triton, act_forward_triton
from sebp_kernels.activations import RowHint, sebp_gelu, sebp_swiglu
from sebp_probe.bench.bench import _Flush, environment, padded_rows, time_methods

CASES = [("bert-base gelu", "gelu", 16384, 3072, 512, 768), ("llama-3.2-3b swiglu", "swiglu", 4096, 8192, 4096, 3072)]


def main(out: str) -> None:
    flush = _Flush()
    rows = []
    for name, kind, m, n, seq, d_model in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
        b = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16) if kind == "swiglu" else None
        x = torch.randn(m, d_model, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(n, d_model, device="cuda", generator=g) / d_model**0.5).to(torch.bfloat16)
        for density in (0.06, 0.2, 1.0):
            mask = padded_rows(m, seq, density, "cuda")
            dh = (torch.randn(m, n, device="cuda", generator=g) * mask[:, None]).to(torch.bfloat16)
            leaves = [t.clone().requires_grad_() for t in (a, b) if t is not None]
            hf = (lambda: F.silu(leaves[0]) * leaves[1]) if kind == "swiglu" else (lambda: F.gelu(leaves[0]))
            hint = RowHint()
            ours = ((lambda: sebp_swiglu(leaves[0], leaves[1], hint)) if kind == "swiglu"
                    else (lambda: sebp_gelu(leaves[0], hint)))
            h_hf, h_ours = hf(), ours()
            grads = torch.autograd.grad(h_ours, leaves, dh, retain_graph=True)
            perm_count = hint.take(grads[0])
            if perm_count is None:
                print("warning: no rows handed on", flush=True)
            cfg = SEBPConfig()
            bad = act_forward_triton(kind, a, b, True, store_h=False)[1]
            if kind == "swiglu":
                s_act = F.silu(a)

                def hf_ops():  # the kernels autograd runs for F.silu(a) * b
                    d_act = dh * b
                    return torch.ops.aten.silu_backward(d_act, a), dh * s_act
            else:
                def hf_ops():
                    return torch.ops.aten.gelu_backward(dh, a)
            t = time_methods({
                "bwd_hf_kernels": (hf_ops, True),
                "bwd_sebp_kernels": (lambda: act_backward_triton(kind, dh, a, b, bad, True, kind == "swiglu",
                                                                 True), True),
                "fwd_hf": (hf, True), "fwd_sebp": (ours, True),
                # eager: autograd runs a backward on the forward's stream, which a capture on another
                # stream cannot record (the kernels are long enough for the host to stay ahead)
                "bwd_hf": (lambda: torch.autograd.grad(h_hf, leaves, dh, retain_graph=True), False),
                "bwd_sebp": (lambda: torch.autograd.grad(h_ours, leaves, dh, retain_graph=True), False),
                "linear_bwd_select": (lambda: sebp_backward_triton(grads[0], x, w, cfg), True),
                "linear_bwd_rows": (lambda: sebp_backward_triton(grads[0], x, w, cfg, rows=perm_count), True),
            }, 20, flush)
            row = {"case": name, "m": m, "n": n, "density": density, "k": int(mask.sum()),
                   "us": {k: round(v * 1000, 1) for k, v in t.items()}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path = __import__("pathlib").Path
    Path(out).write_text(json.dumps({"environment": environment(), "command": "python3 benchmarks/act_bench.py",
                                     "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "act_bench.json")
