"""Host (CPU) time per call of the launch paths the backward and the collector use, on a GPU machine: a torch
op, an empty Triton kernel through its JIT launcher, the row-statistics launch, one collector hook and one
SEBP backward (small shapes, so the GPU never holds the host back), plus a cProfile of the two heavy ones.

    python scripts/host_cost.py
"""
import cProfile
import io
import pstats
import time

import torch
import triton
import triton.language as tl

from sebp_kernels import SEBPConfig
from sebp_kernels._triton import sebp_backward_triton
from sebp_kernels._triton import rowstats

dev = torch.device("cuda")


@triton.jit
def _noop(x_ptr, n, B: tl.constexpr):
    pass


def per_call(fn, n=3000):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return 1e6 * host / n, 1e6 * (time.perf_counter() - t) / n


def show(name, fn, n=3000):
    host, total = per_call(fn, n)
    print(f"{name:58s} host {host:7.1f} us/call   host+device {total:7.1f} us/call", flush=True)


def profile(fn, n=2000, rows=18):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(rows)
    print("\n".join(s.getvalue().splitlines()[:rows + 12]), flush=True)


a = torch.zeros(16, device=dev)
show("torch a.add_(1)", lambda: a.add_(1))
show("torch.empty(4096, 384) bf16", lambda: torch.empty(4096, 384, device=dev, dtype=torch.bfloat16))
show("triton empty kernel, JIT launcher", lambda: _noop[(1,)](a, 1, B=16))
compiled = _noop[(1,)](a, 1, B=16)
runner = compiled[(1, 1, 1)]
show("triton empty kernel, CompiledKernel[grid](...)", lambda: runner(a, 1, 16))
show("torch.cuda.current_stream().cuda_stream", lambda: torch.cuda.current_stream().cuda_stream)

g = torch.randn(4096, 384, device=dev, dtype=torch.bfloat16)
stats = torch.zeros(36, 3 + 2049, dtype=torch.int64, device=dev)
sample = torch.zeros(36, 2049, dtype=torch.int64, device=dev)
# row_step as the collector picks it (one sampled row in 64 here): the GPU must not be the bottleneck
show("rowstats.row_stats_ (4096 x 384 bf16)", lambda: rowstats.row_stats_(g, stats, sample, 5, 64, 20))

from sebp_probe.hooks import GradientStatsCollector  # noqa: E402

lin = torch.nn.Sequential(torch.nn.Linear(384, 384)).to(dev)
col = GradientStatsCollector(lin, target_modules="all-linear")
with col:
    with col.batch():
        g3 = torch.randn(32, 128, 384, device=dev, dtype=torch.bfloat16)
        show("collector _on_grad (32 x 128 x 384 bf16)", lambda: col._on_grad(0, g3))
        profile(lambda: col._on_grad(0, g3))

for (m, i, o) in [(4096, 384, 384), (16384, 768, 3072)]:
    x = torch.randn(m, i, device=dev, dtype=torch.bfloat16)
    w = torch.randn(o, i, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(m, o, device=dev, dtype=torch.bfloat16)
    dy[m // 5:] = 0
    cfg = SEBPConfig()
    show(f"sebp_backward_triton {m}x{i}->{o} d=0.2", lambda: sebp_backward_triton(dy, x, w, cfg), 500)
    show(f"dense backward (2 mm + sum) {m}x{i}->{o}", lambda: (dy @ w, dy.t() @ x, dy.sum(0)), 500)
    profile(lambda: sebp_backward_triton(dy, x, w, cfg), 500, 16)
