"""Can memory-bound work run on the same SMs as the fused gradient kernel? (bf16, exact mode, microseconds)

The per-layer share of the ideal speedup is held back by memory-bound passes that run before (the row
selection) and after (dX's zero rows) the GEMMs. Hiding them needs other programs resident on an SM beside a
GEMM program. This probe measures what the fused gradient kernel leaves free, per BERT-base / Llama-3.2-3B
layer shape at density 0.2 (right padding):

- the compiled kernel's registers per thread, spills, shared memory and warps, and from them how many
  programs of 4 warps with no shared memory and 32 registers a thread could sit beside it (hardware limits of
  the GPU: 64K registers, 2048 threads per SM; allocation in units of 256 registers a warp);
- ``grads``: the gradient kernel alone (CUDA-graph replays); ``fill``: a zero fill of as many bytes as dX's
  zero rows (``Tensor.zero_`` on a buffer of its own) alone; ``both``: the fill on a second stream while the
  gradient kernel runs; ``serial``: one after the other. ``hidden`` = (grads + fill - both) / fill;
- the same with the gradient kernel's registers capped (Triton's ``maxnreg``) to leave room.

    python scripts/coresidency_probe.py out.json
"""
import sys

import torch

from sebp_kernels._triton import grads as grads_mod
from sebp_kernels._triton import tuning
from sebp_kernels._triton.backward import _ieee
from sebp_kernels._triton.grads import grads_rows
from sebp_kernels._triton.select import _sm_count

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from dense_gap import bench, selected, write_rows  # noqa: E402

REGS_PER_SM, THREADS_PER_SM = 65536, 2048


def kernel_facts():
    """Registers, spills, shared memory and warps of the last kernel the fused launcher compiled."""
    k, _ = list(grads_mod._grads._cache.values())[-1]
    md = k.metadata
    warps = md.num_warps
    regs_cta = -(-k.n_regs * 32 // 256) * 256 * warps
    free_regs = REGS_PER_SM - regs_cta
    side = min(max(free_regs // (4 * 32 * 32), 0), (THREADS_PER_SM - warps * 32) // 128)
    return {"regs": k.n_regs, "spills": k.n_spills, "shared_kb": round(md.shared / 1024, 1), "warps": warps,
            "free_regs": free_regs, "side_programs_fit": side}


def with_maxnreg(cap):
    """Reset the fused kernel's plans so that the next launches use ``maxnreg=cap`` (None: Triton's own)."""
    cfg = dict(tuning.DW_CONFIG)
    cfg.pop("maxnreg", None)
    if cap is not None:
        cfg["maxnreg"] = cap
    tuning.DW_CONFIG = cfg
    grads_mod._PLANS._plans.clear()
    grads_mod._grads.clear()


def main(path):
    dev = torch.device("cuda")
    n_sm = _sm_count(dev)
    side = torch.cuda.Stream()
    rows = []
    for shape, x, w, d, dy, k, perm, count in selected(dev, (0.2,)):
        ie, b = _ieee(dy.dtype), shape.bias
        fill_buf = torch.empty((shape.rows - k) * shape.in_features, dtype=dy.dtype, device=dev)
        for cap in (None, 232, 200, 168):
            with_maxnreg(cap)
            try:
                grads_rows(dy, x, w, perm, count, True, True, b, ie, n_sm)
            except Exception as err:  # noqa: BLE001 (a cap the compiler refuses: record it)
                rows.append({"shape": shape.name, "density": d, "maxnreg": cap, "error": str(err)[:200]})
                continue
            r = {"shape": shape.name, "density": d, "k": k, "maxnreg": cap, **kernel_facts()}

            def grads():
                return grads_rows(dy, x, w, perm, count, True, True, b, ie, n_sm)

            def both():
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fill_buf.zero_()
                out = grads()
                torch.cuda.current_stream().wait_stream(side)
                return out

            def serial():
                fill_buf.zero_()
                return grads()

            r["grads"] = bench(grads)
            r["fill"] = bench(fill_buf.zero_)
            r["both"] = bench(both)
            r["serial"] = bench(serial)
            r["hidden"] = round((r["grads"] + r["fill"] - r["both"]) / r["fill"], 3)
            print(r, flush=True)
            rows.append(r)
    with_maxnreg(None)
    write_rows(path, rows)


if __name__ == "__main__":
    main(sys.argv[1])
