"""The row-statistics kernel of the gradient collector (``finetune --probe-every``, ``analyze``) on the GPU, at the
dL/dY shapes of BERT-base and Llama-3.2-1B, against one plain pass over the same gradient (torch's row max,
``vector_norm(inf, dim=1)``): how close the kernel is to reading dL/dY once (CUDA-graph replays, L2 flushed,
methods taking turns; bench.time_methods).

    python benchmarks/rowstats_bench.py OUT.json

Per shape: microseconds per call of each method, the kernel's GB/s over the bytes of dL/dY, and its time over
the plain pass's (1.0: the kernel costs what reading the gradient costs).
"""
import json
import sys

import torch

from sebp_kernels._triton import rowstats
from sebp_probe.analysis.hooks import N_GROUPS
from sebp_probe.analysis.knee import FINE_SHIFT, N_FINE, N_OCTAVE, OCTAVE_SHIFT
from sebp_probe.bench.bench import environment, time_methods

# (what, rows, cols): rows = tokens of a step's micro-batch (BERT-base longest ~2k, Llama SFT 8 x 1024)
SHAPES = [("bert-base q/k/v/o", 2048, 768), ("bert-base intermediate", 2048, 3072),
          ("llama-3.2-1b k/v", 8192, 512), ("llama-3.2-1b q/o/down", 8192, 2048),
          ("llama-3.2-1b gate/up", 8192, 8192)]
SAMPLE = 1 << 14  # the collector's ELEMENT_SAMPLE
DEVICE = "cuda"


class Flush:
    """Writes a buffer larger than L2 between repeats, so every repeat starts from a cold cache."""

    def __init__(self):
        self.buf = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device=DEVICE)

    def __call__(self):
        self.buf.zero_()


def _case(rows: int, cols: int, dtype: torch.dtype, flush: Flush, repeats: int) -> dict:
    g = torch.randn(rows, cols, device=DEVICE, dtype=dtype) * torch.logspace(-8, 1, cols, device=DEVICE).to(dtype)
    g[::4] = 0  # zero rows, as padding and label-less rows give
    groups = (torch.arange(rows, device=DEVICE) % (N_GROUPS + 1)).to(torch.int8)
    stats = torch.zeros(1, rowstats.N_SCALARS + N_FINE, dtype=torch.int64, device=DEVICE)
    sample = torch.zeros(1, N_FINE, dtype=torch.int64, device=DEVICE)
    group_hist = torch.zeros(1, N_GROUPS * N_OCTAVE, dtype=torch.int64, device=DEVICE)
    step = max(1, -(-g.numel() // SAMPLE))

    def kernel():
        rowstats.row_stats_(g, stats, sample, 0, step, FINE_SHIFT, groups, group_hist, N_GROUPS, OCTAVE_SHIFT)

    def kernel_no_groups():
        rowstats.row_stats_(g, stats, sample, 0, step, FINE_SHIFT)

    def plain_read():
        torch.linalg.vector_norm(g, ord=float("inf"), dim=1)

    ms = time_methods({"rowstats": (kernel, True), "rowstats_no_groups": (kernel_no_groups, True),
                       "plain_read": (plain_read, True)}, repeats, flush)
    gbytes = g.numel() * g.element_size() / 1e9
    return {"us": {k: round(v * 1e3, 2) for k, v in ms.items()},
            "rowstats_gb_s": round(gbytes / (ms["rowstats"] / 1e3)),
            "rowstats_over_plain_read": round(ms["rowstats"] / ms["plain_read"], 3)}


def main(out: str, repeats: int = 30) -> None:
    flush = Flush()
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for what, m, n in SHAPES:
            r = {"shape": what, "rows": m, "cols": n, "dtype": str(dtype).removeprefix("torch."),
                 **_case(m, n, dtype, flush, repeats)}
            print(json.dumps(r), flush=True)
            rows.append(r)
    with open(out, "w") as f:
        json.dump({"command": "python benchmarks/rowstats_bench.py OUT.json", "environment": environment(),
                   "repeats": repeats, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
