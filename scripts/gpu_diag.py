"""Device diagnostics for the Triton SEBP backward: host launch overhead per call, and a per-kernel config
sweep (select, dX, dW) against cuBLAS at full and partial density. Prints tables; writes JSON to argv[1]."""
import json
import sys
import time

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from sebp_kernels import SEBPConfig
from sebp_kernels._triton import sebp_backward_triton
from sebp_kernels._triton.dw import MIN_CHUNK, ROW_ALIGN, _dw_kernel, dw_db_rows, dw_splits
from sebp_kernels._triton.dx import _dx_kernel, dx_rows
from sebp_kernels._triton.select import select_rows_device
from sebp_probe.bench import padded_rows

out = {"host_us": {}, "sweep": []}
dev = "cuda"


@triton.jit
def _noop(a, b, c, d, e, f, g, h, i, j, k, l, m, n, BLOCK: tl.constexpr):
    pass


def host_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


m, o, i = 512, 256, 256
dy = torch.randn(m, o, device=dev, dtype=torch.bfloat16)
dy[::2] = 0
x = torch.randn(m, i, device=dev, dtype=torch.bfloat16)
w = torch.randn(o, i, device=dev, dtype=torch.bfloat16)
cfg = SEBPConfig()
perm, count = select_rows_device(dy, "exact")
t = torch.empty(16, device=dev)
tests = {
    "noop jit launch (14 args)": lambda: _noop[(1,)](t, t, t, t, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, BLOCK=16),
    "torch.empty": lambda: torch.empty(m, dtype=torch.int32, device=dev),
    "dense dX+dW+db (3 torch ops)": lambda: (dy @ w, dy.t() @ x, dy.sum(0)),
    "select_rows_device": lambda: select_rows_device(dy, "exact"),
    "dx_rows": lambda: dx_rows(dy, w, perm, count, rows_hint=512),
    "dw_db_rows": lambda: dw_db_rows(dy, x, perm, count, True, 1, rows_hint=512),
    "sebp_backward_triton": lambda: sebp_backward_triton(dy, x, w, cfg),
}
for name, fn in tests.items():
    out["host_us"][name] = round(host_us(fn), 1)
    print(f"host {name:34s} {out['host_us'][name]:8.1f} us/call", flush=True)

DX = [(128, 256, 64, 4, 8), (128, 256, 64, 3, 8), (64, 256, 64, 4, 8), (128, 128, 64, 4, 8)]
DW = [(128, 256, 64, 4, 8), (128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 64, 5, 8), (128, 128, 64, 4, 4)]
SHAPES = [(4096, 3072, 8192), (16384, 768, 3072), (16384, 768, 768)]
n_sm = torch.cuda.get_device_properties(0).multi_processor_count
for (M, IN, OUT) in SHAPES:
    x = torch.randn(M, IN, device=dev, dtype=torch.bfloat16)
    w = torch.randn(OUT, IN, device=dev, dtype=torch.bfloat16) / IN**0.5
    full = torch.randn(M, OUT, device=dev, dtype=torch.bfloat16)
    for dens in (1.0, 0.2):
        mask = padded_rows(M, 512 if M == 16384 else 4096, dens, dev)
        dy = full * mask.unsqueeze(1).to(full.dtype)
        rows = mask.nonzero().squeeze(1)
        k = rows.numel()
        dyk, xk = dy[rows].contiguous(), x[rows].contiguous()
        perm, count = select_rows_device(dy, "exact")
        row = {"M": M, "in": IN, "out": OUT, "density": dens, "k": k}
        row["cublas_dx"] = do_bench(lambda: dyk @ w, return_mode="median")
        row["cublas_dw"] = do_bench(lambda: dyk.t() @ xk, return_mode="median")
        row["select"] = do_bench(lambda: select_rows_device(dy, "exact"), return_mode="median")
        dxo = torch.empty(M, IN, device=dev, dtype=torch.bfloat16)
        for (bm, bn, bk, st, wp) in DX:
            grid = (triton.cdiv(M, bm) * triton.cdiv(IN, bn),)
            fn = lambda: _dx_kernel[grid](dy, w, dxo, perm, count, M, IN, OUT, M, dy.stride(0), dy.stride(1),
                                          w.stride(0), w.stride(1), dxo.stride(0), dxo.stride(1), BLOCK_M=bm,
                                          BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, EVEN_K=OUT % bk == 0, IEEE=False,
                                          num_warps=wp, num_stages=st)
            try:
                row[f"dx {bm}x{bn}x{bk} s{st}w{wp}"] = do_bench(fn, return_mode="median")
            except Exception as e:  # noqa: BLE001
                row[f"dx {bm}x{bn}x{bk} s{st}w{wp}"] = str(e)[:80]
        split = dw_splits(OUT, IN, k, n_sm)
        row["split"] = split
        part = torch.empty((split, OUT * IN), device=dev, dtype=torch.float32)
        dwo = torch.empty(OUT, IN, device=dev, dtype=torch.bfloat16)
        for (bm, bn, bk, st, wp) in DW:
            grid = (triton.cdiv(OUT, bm) * triton.cdiv(IN, bn), split)
            tgt = part if split > 1 else dwo
            fn = lambda: _dw_kernel[grid](dy, x, tgt, tgt, perm, count, M, OUT, IN, split, M, dy.stride(0),
                                          dy.stride(1), x.stride(0), x.stride(1), HAS_DB=False,
                                          USE_PARTIAL=split > 1, IEEE=False, ROW_ALIGN=ROW_ALIGN,
                                          MIN_CHUNK=MIN_CHUNK, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                                          num_warps=wp, num_stages=st)
            try:
                row[f"dw {bm}x{bn}x{bk} s{st}w{wp}"] = do_bench(fn, return_mode="median")
            except Exception as e:  # noqa: BLE001
                row[f"dw {bm}x{bn}x{bk} s{st}w{wp}"] = str(e)[:80]
        row["triton_total"] = do_bench(lambda: sebp_backward_triton(dy, x, w, SEBPConfig(), True, True, False),
                                       return_mode="median")
        out["sweep"].append(row)
        best_dx = min((v, kk) for kk, v in row.items() if kk.startswith("dx ") and isinstance(v, float))
        best_dw = min((v, kk) for kk, v in row.items() if kk.startswith("dw ") and isinstance(v, float))
        print(f"{M}x{IN}->{OUT} d={dens} k={k}: cublas dx {row['cublas_dx']:.4f} dw {row['cublas_dw']:.4f} | "
              f"select {row['select']:.4f} | best dx {best_dx[0]:.4f} ({best_dx[1]}) | best dw {best_dw[0]:.4f} "
              f"({best_dw[1]}, split {split}) | total {row['triton_total']:.4f}", flush=True)
        print("   ", {kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in row.items()
                      if kk.startswith(("dx ", "dw "))}, flush=True)
if len(sys.argv) > 1:
    json.dump(out, open(sys.argv[1], "w"), indent=1)
