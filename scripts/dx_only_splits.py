"""dX alone (a frozen weight: LoRA base layers) with and without splits over K, against cuBLAS.

Per BERT-base / Llama-3.2-3B layer shape and density: the fused kernel with dX only as the backward runs it
(splits over K onto the SMs left idle), with no splits (n_sm = 1 makes none), with the pieces capped at half
the SMs, and cuBLAS dY[active] @ W on the active rows laid out contiguously. bf16, CUDA-graph medians (us).

    python scripts/dx_only_splits.py out.json
"""
import sys

import torch

# beside this file: the same CUDA-graph timing (us), layer shapes and padded inputs
from dense_gap import bench, layer_shapes, padded, write_rows

from sebp_kernels._triton.grads import grads_rows
from sebp_kernels._triton.select import _sm_count, select_rows_device


def main(path):
    dev = torch.device("cuda")
    n_sm = _sm_count(dev)
    rows = []
    for shape, g in layer_shapes(dev):
        m, n_in, n_out = shape.rows, shape.in_features, shape.out_features
        w = (torch.randn(n_out, n_in, device=dev, generator=g) / n_in**0.5).to(torch.bfloat16)
        dy_full = torch.randn(m, n_out, device=dev, dtype=torch.bfloat16, generator=g)
        for d in (0.05, 0.2, 0.5):
            dy, mask = padded(dy_full, shape, d)
            dy_k = dy.index_select(0, mask.nonzero().squeeze(1)).contiguous()
            perm, count = select_rows_device(dy, "exact")
            r = {"shape": shape.name, "density": d}
            r["cublas_dx_k_rows"] = bench(lambda: dy_k @ w)
            r["dense_dx"] = bench(lambda: dy @ w)
            r["split_auto"] = bench(lambda: grads_rows(dy, None, w, perm, count, True, False, False, False, n_sm))
            r["split_none"] = bench(lambda: grads_rows(dy, None, w, perm, count, True, False, False, False, 1))
            r["split_half_sms"] = bench(lambda: grads_rows(dy, None, w, perm, count, True, False, False, False,
                                                           n_sm // 2))
            print(r, flush=True)
            rows.append(r)
    write_rows(path, rows)


if __name__ == "__main__":
    main(sys.argv[1])
