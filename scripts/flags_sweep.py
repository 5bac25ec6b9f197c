"""GPU time of the row-flags kernel (the read of dY that row selection needs) over tile shapes, against the
current choice of `select._row_blocks`: CUDA-graph replays, median of 30, bf16, right-padded rows.

    python scripts/flags_sweep.py [out.json]
"""
import json
import statistics
import sys

import torch

from sebp_kernels._triton import select
from sebp_kernels._triton.tuning import cdiv
from sebp_probe.bench import padded_rows


def graph_us(fn, n=30):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return 1e3 * statistics.median(ts)


def run(dy, block_r, block_c, warps):
    m, n = dy.shape
    nb = cdiv(m, block_r)
    flags = torch.empty(m, dtype=torch.int32, device="cuda")
    counts = torch.empty(nb, dtype=torch.int32, device="cuda")
    return lambda: select._row_flags_kernel[(nb,)](dy, flags, counts, m, n, dy.stride(0), dy.stride(1), 0.0,
                                                   MODE=0, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)


configs = [(r, c, w) for r in (4, 8, 16, 32, 64) for c in (256, 512, 1024, 2048, 4096) for w in (4, 8)
           if 2048 <= r * c <= 65536]
out = []
for m, n, seq in ((16384, 3072, 512), (16384, 768, 512), (4096, 8192, 4096), (4096, 3072, 4096)):
    for d in (0.01, 0.2, 1.0):
        mask = padded_rows(m, seq, d, "cuda")
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * mask[:, None].to(torch.bfloat16)
        cur = select._row_blocks(n, False)
        times = {f"{r}x{c}w{w}": graph_us(run(dy, r, c, w)) for r, c, w in configs}
        best = min(times, key=times.get)
        cur_key = f"{cur[0]}x{cur[1]}w{cur[2]}"
        cur_t = times.get(cur_key) or graph_us(run(dy, *cur))
        gbs = m * n * 2 / (times[best] * 1e-6) / 1e9
        print(f"{m}x{n} d={d}: current {cur_key} {cur_t:6.1f} us; best {best} {times[best]:6.1f} us "
              f"({gbs:.0f} GB/s of dY)", flush=True)
        out.append({"m": m, "n": n, "density": d, "current": cur_key, "current_us": cur_t, "times_us": times})
if len(sys.argv) > 1:
    json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "sweep": out},
              open(sys.argv[1], "w"), indent=1)
