"""Programs per SM, tile size, pipeline depth, accumulator layout and warps of the SEBP norm backward (``_triton/norm.py``): its
backward time (forward + backward as a CUDA graph, minus the forward) at d = 0.05 and 1.0 for the shapes of
scripts/norm_bench.py. (An earlier sweep of programs per SM, 1-16, with a reduction of 3-24 programs, found 1
best; GRID tries 2 and 4 again with the current reduction.)

    python scripts/norm_sweep.py OUT.json
"""
import json
import sys

import torch

from sebp_kernels import sebp_layer_norm, sebp_rms_norm
from sebp_kernels._triton import norm as N
from sebp_probe.bench import _Flush, environment, padded_rows, time_methods


# (programs per SM, column sums per tile row, tile elements, stages, warps)
GRID = ([(1, a, t, s, 8) for a in (False, True) for t in (4096, 8192, 16384) for s in (2, 3, 4)]
        + [(p, True, t, s, 8) for p in (2, 4) for t in (4096, 8192) for s in (2, 3)]
        + [(p, True, t, s, w) for w in (4, 16) for p in (1, 2) for t in (8192, 16384) for s in (3,)])


def main():
    flush = _Flush()
    time_methods({"warm-up": (lambda: flush(), True)}, 3, flush)
    out = []
    for name, kind, m, n, seq in (("LayerNorm", "layer", 16384, 768, 512), ("RMSNorm", "rms", 4096, 3072, 4096)):
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, n, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
        w = torch.randn(n, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
        b = torch.randn(n, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
        leafs = (x, w, b) if kind == "layer" else (x, w)
        f = (lambda: sebp_layer_norm(x, (n,), w, b)) if kind == "layer" else (lambda: sebp_rms_norm(x, w))
        for d in (0.05, 1.0):
            gy = torch.randn(m, n, device="cuda", generator=g, dtype=torch.bfloat16) * \
                padded_rows(m, seq, d, "cuda")[:, None].to(torch.bfloat16)
            methods = {"forward": (f, True)}
            for pps, acc2d, tile, stages, warps in GRID:
                def step(pps=pps, acc2d=acc2d, tile=tile, stages=stages, warps=warps):
                    N.PROGRAMS_PER_SM, N.TILE, N.STAGES, N.ACC2D, N.WARPS = pps, tile, stages, acc2d, warps
                    return torch.autograd.grad(f(), leafs, gy)
                methods[f"pps{pps}_acc2d{int(acc2d)}_tile{tile}_st{stages}_w{warps}"] = (step, True)
            ms = time_methods(methods, 15, flush)
            rec = {"norm": name, "rows": m, "features": n, "density": d,
                   "backward_us": {k: round((v - ms["forward"]) * 1e3, 1) for k, v in ms.items() if k != "forward"}}
            best = min(rec["backward_us"], key=rec["backward_us"].get)
            print(name, d, "best", best, rec["backward_us"][best], rec["backward_us"], flush=True)
            out.append(rec)
    with open(sys.argv[1], "w") as fh:
        json.dump({"command": "python " + " ".join(sys.argv), "environment": environment(), "rows": out}, fh, indent=1)


if __name__ == "__main__":
    main()
