"""The SEBP backward at the row counts of a trimmed BERT-base batch, against cuBLAS (bf16, CUDA-graph timings).

BERT-base on `--padding longest` (batch 32 of SST-2-like lengths, padded to the batch's longest) has about
2100 rows a layer, half of them padding. Per layer shape (768->768, 768->3072, 3072->768, with bias) it times:
dense (cuBLAS dX, dW and the bias sum on all rows), the SEBP backward (select + fused kernel), the fused kernel
alone over a given permutation, the select pass alone, cuBLAS on the active rows gathered (index_select, two
GEMMs, bias sum, dX scattered into zeros; the active rows known on the host), and the fused kernel with other
tile settings (``--configs``), each forced on every shape (over the few-rows rule of ``tuning.few_rows``),
and the few-rows tiles with the dW rows split ``--splits`` ways at least ``--chunks`` rows a split;
``sebp`` runs with the 128 x 256 tiles. Totals weight the shapes as a BERT layer has them (4, 1, 1).

    python benchmarks/small_m_probe.py OUT.json [--batches 2] [--splits 1,2,4 --chunks 128,2048]
"""
import argparse

import torch

from sebp_kernels._triton import grads as _grads_mod
from sebp_kernels._triton import tuning
from sebp_kernels._triton.backward import _ieee, sebp_backward_triton
from sebp_kernels._triton.dw import MIN_CHUNK
from sebp_kernels._triton.grads import grads_rows
from sebp_kernels._triton.select import _sm_count, select_rows_device
from sebp_kernels import SEBPConfig
from sebp_probe.bench.bench_cases import MODEL_CASES, layout_indices, sample_lengths

from dense_gap import bench, write_rows

SHAPES = (("attn 768->768", 768, 768, 4), ("ffn up 768->3072", 768, 3072, 1), ("ffn down 3072->768", 3072, 768, 1))

# name -> (BLOCK_M, BLOCK_N, BLOCK_K, warps, dW stages, dX stages)
CONFIGS = {
    "128x256w8": (128, 256, 64, 8, 3, 4),
    "128x128w8": (128, 128, 64, 8, 3, 4),
    "128x128w4": (128, 128, 64, 4, 3, 4),
    "64x128w4": (64, 128, 64, 4, 4, 4),
    "64x256w8": (64, 256, 64, 8, 3, 4),
    "128x64w4": (128, 64, 64, 4, 4, 4),
    # more settings (session of 2026-11-27): shorter K steps, other pipeline depths, smaller and larger tiles
    "128x128k32w4": (128, 128, 32, 4, 4, 5),
    "128x128w4s2": (128, 128, 64, 4, 2, 2),
    "128x128w4s4": (128, 128, 64, 4, 4, 4),
    "128x128w8s4": (128, 128, 64, 8, 4, 4),
    "64x128k32w4": (64, 128, 32, 4, 4, 5),
    "128x64k32w4": (128, 64, 32, 4, 5, 5),
    "64x64w4": (64, 64, 64, 4, 3, 4),
    "128x256k32w8": (128, 256, 32, 8, 4, 5),
    "256x128w8": (256, 128, 64, 8, 3, 4),
}


def set_config(bm, bn, bk, warps, dw_stages, dx_stages):
    """This tile setting for every shape: the default and the few-rows one alike."""
    base = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": warps}
    tuning.DW_CONFIG = dict(base, num_stages=dw_stages)
    tuning.DX_CONFIG = dict(base, num_stages=dx_stages)
    tuning.SMALL_CONFIG = base
    tuning.SMALL_STAGES = {"dw": dw_stages, "dx": dx_stages}
    _grads_mod._PLANS._plans.clear()
    _grads_mod._grads.clear()


def longest_masks(n_batches, dev):
    """Active-row masks (rows = batch x longest) of the first ``n_batches`` batches BERT-base's case forms."""
    case = MODEL_CASES["bert-base"]
    lengths = sample_lengths(case.lengths, case.batch * n_batches, case.max_length, 0)
    out = []
    for idx in layout_indices(lengths, case.batch, 0)["longest"][:n_batches]:
        ls = [lengths[i] for i in idx]
        pos = torch.arange(max(ls), device=dev)
        out.append((torch.tensor(ls, device=dev)[:, None] > pos[None, :]).reshape(-1))
    return out


def main(out, n_batches, configs, splits=(), chunks=()):
    dev = torch.device("cuda")
    n_sm = _sm_count(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for b, mask in enumerate(longest_masks(n_batches, dev)):
        m = mask.numel()
        act = mask.nonzero().squeeze(1)
        for name, n_in, n_out, weight in SHAPES:
            x = torch.randn(m, n_in, device=dev, dtype=torch.bfloat16, generator=g)
            w = (torch.randn(n_out, n_in, device=dev, generator=g) / n_in**0.5).to(torch.bfloat16)
            dy = torch.randn(m, n_out, device=dev, dtype=torch.bfloat16, generator=g) * mask[:, None]
            perm, count = select_rows_device(dy, "exact")
            ie = _ieee(dy.dtype)
            r = {"batch": b, "shape": name, "weight": weight, "rows": m, "k": int(act.numel())}
            r["dense"] = bench(lambda: (dy @ w, dy.t() @ x, dy.sum(0)))

            def gathered():
                dyk, xk = dy.index_select(0, act), x.index_select(0, act)
                dx = torch.zeros(m, n_in, device=dev, dtype=dy.dtype)
                dx.index_copy_(0, act, dyk @ w)
                return dx, dyk.t() @ xk, dyk.sum(0)

            r["gather_cublas"] = bench(gathered)
            dyk, xk = dy.index_select(0, act), x.index_select(0, act)
            r["cublas_active_only"] = bench(lambda: (dyk @ w, dyk.t() @ xk, dyk.sum(0)))
            r["select"] = bench(lambda: select_rows_device(dy, "exact"))
            set_config(*CONFIGS["128x256w8"])
            r["sebp"] = bench(lambda: sebp_backward_triton(dy, x, w, SEBPConfig("exact"), True, True, True))
            for c in configs:
                set_config(*CONFIGS[c])
                try:
                    r[f"grads_{c}"] = bench(lambda: grads_rows(dy, x, w, perm, count, True, True, True, ie, n_sm))
                except Exception as e:  # a setting that does not launch here
                    r[f"grads_{c}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            for split in splits:  # the few-rows tiles with the dW rows split `split` ways
                for chunk in chunks:
                    set_config(*CONFIGS["128x128w4"])
                    _grads_mod.MIN_CHUNK = chunk
                    r[f"split{split}_chunk{chunk}"] = bench(lambda: grads_rows(
                        dy, x, w, perm, count, True, True, True, ie, n_sm, dw_split=split))
            _grads_mod.MIN_CHUNK = MIN_CHUNK
            set_config(*CONFIGS["128x256w8"])
            print(r, flush=True)
            rows.append(r)
    totals = {}
    for r in rows:
        for key, v in r.items():
            if isinstance(v, float):
                totals[key] = totals.get(key, 0.0) + v * r["weight"] / n_batches
    totals = {k: round(v, 1) for k, v in totals.items()}
    print("per BERT layer, us:", totals, flush=True)
    write_rows(out, rows + [{"per_layer_us": totals}])


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--splits", default="", help="dW row splits to force with the 128x128w4 tiles, e.g. 1,2,3,4")
    p.add_argument("--chunks", default=str(MIN_CHUNK), help="smallest rows per split (the kernel's MIN_CHUNK)")
    a = p.parse_args()
    main(a.out, a.batches, [c for c in a.configs.split(",") if c],
         [int(s) for s in a.splits.split(",") if s], [int(c) for c in a.chunks.split(",") if c])
