"""Programmatic dependent launch for the SEBP backward: on against off, interleaved on one GPU (bf16, exact, us).

The backward is three launches (flags pass, compaction, fused gradient kernel); with programmatic dependent
launch (``sebp_kernels._triton.launch.pdl``, Hopper and later) each one's programs start while the one before
finishes, and wait for it before reading anything. Per BERT-base / Llama-3.2-3B layer shape and density
(right padding, as ``sebp-probe bench`` lays rows out), this times as CUDA-graph replays with the L2 cache
flushed, the methods taking turns within each repeat (``bench.time_methods``):

- ``ideal``: cuBLAS on the k active rows, contiguous (as the bench);
- ``pdl`` / ``no_pdl``: ``sebp_backward_triton`` (selection included) with ``SEBP_PDL`` unset / ``0``;
- ``rows_pdl`` / ``rows_no_pdl``: the same with the rows known (the gradient kernel alone).

It also checks that both give the same dX, dW and db, bit for bit.

    python scripts/pdl_probe.py OUT.json [--repeats 20] [--densities 0.01,0.1,0.2,0.5,1.0]
"""
import argparse
import json
import os
import sys

import torch

from sebp_kernels import SEBPConfig
from sebp_kernels._triton import sebp_backward_triton
from sebp_kernels._triton.select import select_rows_device
from sebp_probe.bench import _Flush, environment, padded_rows, resolve_shapes, time_methods


def with_pdl(on, fn):
    def run():
        old = os.environ.get("SEBP_PDL")
        os.environ["SEBP_PDL"] = "1" if on else "0"
        try:
            return fn()
        finally:
            if old is None:
                del os.environ["SEBP_PDL"]
            else:
                os.environ["SEBP_PDL"] = old
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--densities", default="0.01,0.1,0.2,0.5,1.0")
    args = ap.parse_args()
    dev = torch.device("cuda")
    flush = _Flush()
    cfg = SEBPConfig("exact")
    rows_out = []
    for model in ("bert-base", "llama-3.2-3b"):
        for shape in resolve_shapes(model):
            g = torch.Generator(device=dev).manual_seed(0)
            m, n_in, n_out = shape.rows, shape.in_features, shape.out_features
            x = torch.randn(m, n_in, device=dev, dtype=torch.bfloat16, generator=g)
            w = (torch.randn(n_out, n_in, device=dev, generator=g) / n_in**0.5).to(torch.bfloat16)
            dy_full = torch.randn(m, n_out, device=dev, dtype=torch.bfloat16, generator=g)
            for d in map(float, args.densities.split(",")):
                mask = padded_rows(m, shape.seq, d, dev)
                idx = mask.nonzero().squeeze(1)
                dy = dy_full * mask.unsqueeze(1).to(dy_full.dtype)
                dy_k, x_k = dy.index_select(0, idx).contiguous(), x.index_select(0, idx).contiguous()
                known = select_rows_device(dy, "exact")
                b = shape.bias

                def sebp(rows=None):
                    return sebp_backward_triton(dy, x, w, cfg, True, True, b, rows=rows)

                a = with_pdl(True, sebp)()
                z = with_pdl(False, sebp)()
                same = all(torch.equal(p, q) for p, q in zip(a, z) if p is not None)
                methods = {
                    "ideal": (lambda: (dy_k @ w, dy_k.t() @ x_k, dy_k.sum(0) if b else None), True),
                    "pdl": (with_pdl(True, sebp), True),
                    "no_pdl": (with_pdl(False, sebp), True),
                    "rows_pdl": (with_pdl(True, lambda: sebp(known)), True),
                    "rows_no_pdl": (with_pdl(False, lambda: sebp(known)), True),
                }
                us = {k: round(v * 1000, 1) for k, v in time_methods(methods, args.repeats, flush).items()}
                r = {"shape": shape.name, "density": d, "k": int(idx.numel()), "us": us, "same_grads": same,
                     "share_pdl": round(us["ideal"] / us["pdl"], 3), "share_no_pdl": round(us["ideal"] / us["no_pdl"], 3),
                     "saved_us": round(us["no_pdl"] - us["pdl"], 1),
                     "rows_saved_us": round(us["rows_no_pdl"] - us["rows_pdl"], 1)}
                print(r, flush=True)
                rows_out.append(r)
    with open(args.out, "w") as f:
        json.dump({"environment": environment(), "command": " ".join(sys.argv), "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
