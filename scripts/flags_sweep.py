"""The flags pass of row selection (``select._row_flags_kernel``) over tile settings, with the L2 cache flushed
as ``sebp-probe bench`` times it: rows per program, columns per block, column blocks per loop step (UNROLL)
and warps, against the module's own choice (``select._flag_blocks``). CUDA-graph replays, median of 30, bf16,
right-padded rows.

    python scripts/flags_sweep.py [out.json]     (TRITON_INTERPRET=1: a CPU check of the settings only)

(``results/h100_flags_sweep_flushed.json`` came from this script's first version, ``scripts/flags2_sweep.py``,
which held its own copy of the two-phase kernel and timed it against the early-exit kernel of the time.)
"""
import datetime
import json
import os
import sys

import torch
import triton

from sebp_kernels._triton import select
from sebp_kernels._triton.tuning import cdiv
from sebp_probe.bench import _Flush, padded_rows, time_methods

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def variant(dy, r, c, u, w):
    m, n = dy.shape
    nb = cdiv(m, r)
    flags = torch.empty(m, dtype=torch.int32, device=dy.device)
    counts = torch.empty(nb, dtype=torch.int32, device=dy.device)

    def run():
        select._row_flags_kernel[(nb,)](dy, flags, counts, m, n, dy.stride(0), dy.stride(1), 0.0, MODE=0,
                                        BLOCK_R=r, BLOCK_C=c, UNROLL=u, num_warps=w)
        return flags, counts
    return run


def current(dy):
    return variant(dy, *select._flag_blocks(dy.shape[1], INTERPRET))


def check(dy, r, c, u, w):
    want = (dy != 0).any(1).to(torch.int32)
    flags, counts = variant(dy, r, c, u, w)()
    assert torch.equal(flags, want), (r, c, u)
    assert int(counts.sum()) == int(want.sum())


def main():
    if INTERPRET:
        for m, n in ((40, 50), (17, 8), (64, 130)):
            dy = torch.randn(m, n) * (torch.rand(m) < 0.5)[:, None]
            dy[3, :] = 0
            dy[5, :] = 0
            dy[5, -1] = 1.0  # a row whose only non-zero is in its last column block
            for r, c, u in ((8, 16, 1), (4, 16, 2), (8, 32, 4)):
                check(dy, r, c, u, 1)
        print("two-phase flags match (dy != 0).any(1) (interpreter)")
        return
    flush = _Flush()
    configs = [(r, c, u, w) for r in (4, 8, 16) for c in (256, 512) for u in (1, 2, 4) for w in (4, 8)]
    out = []
    shapes = ((16384, 3072, 512), (16384, 768, 512), (4096, 8192, 4096), (4096, 3072, 4096), (4096, 1024, 4096))
    for m, n, seq in shapes:
        for d in (0.1, 0.5, 1.0):
            mask = padded_rows(m, seq, d, "cuda")
            dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * mask[:, None].to(torch.bfloat16)
            methods = {"current": (current(dy), True)}
            for r, c, u, w in configs:
                if c * u > 2 * triton.next_power_of_2(n):
                    continue
                check(dy, r, c, u, w)
                methods[f"{r}x{c}u{u}w{w}"] = (variant(dy, r, c, u, w), True)
            us = {k: round(v * 1e3, 2) for k, v in time_methods(methods, 30, flush).items()}
            best = min(us, key=us.get)
            print(f"{m}x{n} d={d}: current {us['current']} us, best {best} {us[best]} us", flush=True)
            out.append({"m": m, "n": n, "density": d, "us": us})
    # one config for all: the smallest sum of ratios to each case's best
    keys = [k for k in out[0]["us"] if all(k in o["us"] for o in out)]
    score = {k: sum(o["us"][k] / min(o["us"].values()) for o in out) / len(out) for k in keys}
    for k in sorted(score, key=score.get)[:8]:
        print(f"mean ratio to best {score[k]:.3f}: {k}")
    if len(sys.argv) > 1:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "command": "python scripts/flags_sweep.py " + sys.argv[1], "results": out,
                   "mean_ratio_to_best": score}, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
