"""Tile shapes of the SEBP activation's kernels: GPU time of the backward pass (with the compaction) and of the
forward at BERT-base GELU and Llama-3.2-3B SwiGLU shapes, bf16, padding-like dL/dH at density 0.06.

    python3 scripts/act_sweep.py OUT.json

Each setting is (rows per program, columns per tile, warps); the kernels' own choice is ``act._row_blocks``
(until this sweep, 2026-11-22 12:04 UTC, the selection pass's 8 x 512, 8 warps).
Medians of CUDA-graph replays with a cold L2.
"""
from __future__ import annotations

import json
import sys

import torch

from sebp_kernels._triton import act
from sebp_probe.bench import _Flush, environment, padded_rows, time_methods

SETTINGS = [(8, 512, 8), (4, 1024, 4), (8, 1024, 8), (16, 512, 8), (2, 2048, 4), (4, 2048, 8), (16, 256, 4),
            (1, 4096, 8), (32, 256, 8)]
CASES = [("bert-base gelu", "gelu", 16384, 3072, 512), ("llama-3.2-3b swiglu", "swiglu", 4096, 8192, 4096)]


def main(out: str) -> None:
    flush = _Flush()
    rows = []
    orig = act._row_blocks
    for name, kind, m, n, seq in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
        b = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16) if kind == "swiglu" else None
        mask = padded_rows(m, seq, 0.06, "cuda")
        dh = (torch.randn(m, n, device="cuda", generator=g) * mask[:, None]).to(torch.bfloat16)
        for br, bc, w in SETTINGS:
            act._row_blocks = lambda n_, interpret, s=(br, bc, w): s
            act._PLANS._plans.clear()
            try:
                bad = act.act_forward_triton(kind, a, b, True, store_h=False)[1]
                t = time_methods({
                    "fwd": (lambda: act.act_forward_triton(kind, a, b, True, store_h=kind == "swiglu"), True),
                    "bwd": (lambda: act.act_backward_triton(kind, dh, a, b, bad, True, kind == "swiglu", True),
                            True),
                }, 20, flush)
            except Exception as e:  # a setting the compiler refuses
                print(f"{name} {br}x{bc}w{w}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            row = {"case": name, "setting": f"{br}x{bc}w{w}", "us": {k: round(v * 1000, 1) for k, v in t.items()}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    act._row_blocks = orig
    from pathlib import Path
    Path(out).write_text(json.dumps({"environment": environment(), "command": "python3 scripts/act_sweep.py",
                                     "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "act_sweep.json")
