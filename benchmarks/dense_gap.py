"""Where the SEBP backward loses to cuBLAS when most rows are active (bf16, CUDA-graph timings).

Per BERT-base / Llama-3.2-3B layer shape and density: the dense backward (cuBLAS on all rows), the whole
SEBP backward (kernels only, no density estimate), cuBLAS dX and dW on the k active rows laid out
contiguously, the select pass alone, the fused gradient kernel alone (all three gradients; dX only; dW only)
over a given permutation, and the fused kernel with forced dW row splits.

    python benchmarks/dense_gap.py out.json [densities, default 1.0,0.5]
"""
import argparse
import json
import sys

import torch
from triton.testing import do_bench_cudagraph

from sebp_kernels import SEBPConfig
from sebp_kernels._triton import sebp_backward_triton
from sebp_kernels._triton.backward import _ieee
from sebp_kernels._triton.grads import grads_rows
from sebp_kernels._triton.select import _sm_count, select_rows_device
from sebp_probe.bench.bench import environment, padded_rows, resolve_shapes


def bench(fn):
    """Median microseconds of ``fn`` as CUDA-graph replays, after one call (compile, allocate)."""
    fn()
    torch.cuda.synchronize()
    return round(do_bench_cudagraph(fn, rep=40, return_mode="median") * 1000, 1)  # us


def layer_shapes(dev):
    """(shape, a generator seeded 0 on ``dev``) for every BERT-base and Llama-3.2-3B layer shape."""
    for model in ("bert-base", "llama-3.2-3b"):
        for shape in resolve_shapes(model):
            yield shape, torch.Generator(device=dev).manual_seed(0)


def operands(shape, g):
    """bf16 X, W (scaled by 1/sqrt(in)) and a full dY for ``shape``, drawn in this order from ``g``."""
    m, n_in, n_out, dev = shape.rows, shape.in_features, shape.out_features, g.device
    x = torch.randn(m, n_in, device=dev, dtype=torch.bfloat16, generator=g)
    w = (torch.randn(n_out, n_in, device=dev, generator=g) / n_in**0.5).to(torch.bfloat16)
    return x, w, torch.randn(m, n_out, device=dev, dtype=torch.bfloat16, generator=g)


def write_rows(path, rows):
    """The JSON every diagnostic script writes: environment, the exact command, its rows."""
    with open(path, "w") as f:
        json.dump({"environment": environment(), "command": " ".join(sys.argv), "rows": rows}, f, indent=1)


def run_probe(main):
    """The command line of the probe scripts: ``OUT.json [--repeats N]`` (default 20), then ``main(out, repeats)``."""
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    main(a.out, a.repeats)


def padded(dy_full, shape, density):
    """(dY with the rows of right padding at ``density`` zeroed, the active-row mask)."""
    mask = padded_rows(shape.rows, shape.seq, density, dy_full.device)
    return dy_full * mask.unsqueeze(1).to(dy_full.dtype), mask


def selected(dev, densities):
    """(shape, X, W, density, dY, k, permutation, device-side count) for every layer shape and density: the
    right-padded dY and its row selection (the loop of the probe scripts)."""
    for shape, g in layer_shapes(dev):
        x, w, dy_full = operands(shape, g)
        for d in densities:
            dy, mask = padded(dy_full, shape, d)
            yield (shape, x, w, d, dy, int(mask.sum()), *select_rows_device(dy, "exact"))


def main(path, densities):
    dev = torch.device("cuda")
    n_sm = _sm_count(dev)
    rows = []
    for shape, g in layer_shapes(dev):
        x, w, dy_full = operands(shape, g)
        for d in densities:
            dy, mask = padded(dy_full, shape, d)
            act = mask.nonzero().squeeze(1)
            dy_k, x_k = dy.index_select(0, act).contiguous(), x.index_select(0, act).contiguous()
            perm, count = select_rows_device(dy, "exact")
            ie = _ieee(dy.dtype)
            b = shape.bias
            r = {"shape": shape.name, "density": d, "k": int(act.numel())}
            r["dense"] = bench(lambda: (dy @ w, dy.t() @ x, dy.sum(0) if b else None))
            r["sebp"] = bench(lambda: sebp_backward_triton(dy, x, w, SEBPConfig("exact"), True, True, b))
            r["cublas_dx"] = bench(lambda: dy_k @ w)
            r["cublas_dw"] = bench(lambda: dy_k.t() @ x_k)
            r["select"] = bench(lambda: select_rows_device(dy, "exact"))
            r["grads"] = bench(lambda: grads_rows(dy, x, w, perm, count, True, True, b, ie, n_sm))
            r["grads_dx_only"] = bench(lambda: grads_rows(dy, x, w, perm, count, True, False, False, ie, n_sm))
            r["grads_dw_only"] = bench(lambda: grads_rows(dy, x, w, perm, count, False, True, False, ie, n_sm))
            for s in (1, 2, 4):
                r[f"grads_split{s}"] = bench(lambda: grads_rows(dy, x, w, perm, count, True, True, b, ie, n_sm,
                                                                dw_split=s))
            print(r, flush=True)
            rows.append(r)
    write_rows(path, rows)


if __name__ == "__main__":
    main(sys.argv[1], [float(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "1.0,0.5").split(",")])
