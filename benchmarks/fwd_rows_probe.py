"""The forward over real-token rows against cuBLAS's forward on every row (bf16, CUDA-graph timings).

Per layer shape of BERT-base at its `longest` bench batches (2112 rows, 66 a sequence), Llama-3.2-1B and
Qwen2.5-0.5B (8192 rows, 1024 a sequence; Llama also at 4376 and 6456 rows) and right-padded densities:
``F.linear`` on every row, the forward over the real rows (``sebp_kernels.forward_rows.linear_over_rows``: the
dX kernel fed X and Wᵀ), and cuBLAS on the real rows gathered (the rows known on the host; no scatter: a floor,
not a path). Which shapes it pays on decides ``sebp_kernels.forward_rows``' rule.

    python benchmarks/fwd_rows_probe.py OUT.json [densities, default 0.25,0.5,0.75,1.0]
"""
import sys

import torch
import torch.nn.functional as F

from sebp_kernels.forward_rows import linear_over_rows
from sebp_kernels.pad_rows import PadRows
from sebp_probe.bench.bench import padded_rows, resolve_shapes

from dense_gap import bench, write_rows

SETS = (("bert-base", 2112, 66), ("llama-3.2-1b", 8192, 1024), ("qwen2.5-0.5b", 8192, 1024),
        # two of the Llama bench's `longest` batches near the 4096-row line (8 x 547 and 8 x 807 rows), where
        # compiled SEBP lost to dense on 2026-11-28 (results/triton_op_h100/)
        ("llama-3.2-1b", 4376, 547), ("llama-3.2-1b", 6456, 807))


def main(path, densities):
    dev = torch.device("cuda")
    rows = []
    for model, m, seq in SETS:
        for shape in resolve_shapes(model, rows=m, seq=seq):
            g = torch.Generator(device=dev).manual_seed(0)
            x = torch.randn(m, shape.in_features, device=dev, dtype=torch.bfloat16, generator=g)
            w = (torch.randn(shape.out_features, shape.in_features, device=dev, generator=g)
                 / shape.in_features**0.5).to(torch.bfloat16)
            b = torch.zeros(shape.out_features, device=dev, dtype=torch.bfloat16) if shape.bias else None
            for d in densities:
                mask = padded_rows(m, seq, d, dev).reshape(-1, seq)
                pad = PadRows()
                pad.set(mask)
                perm, count = pad.rows[:2]
                real = mask.reshape(-1).nonzero().squeeze(1)
                x_k = x.index_select(0, real).contiguous()
                r = {"shape": shape.name, "rows": m, "density": d, "k": int(real.numel())}
                r["dense_us"] = bench(lambda: F.linear(x, w, b))
                r["rows_us"] = bench(lambda: linear_over_rows(x, w, b, perm, count))
                r["cublas_real_rows_us"] = bench(lambda: F.linear(x_k, w, b))
                r["speedup"] = round(r["dense_us"] / r["rows_us"], 3)
                print(r, flush=True)
                rows.append(r)
    write_rows(path, rows)


if __name__ == "__main__":
    main(sys.argv[1], [float(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "0.25,0.5,0.75,1.0").split(",")])
