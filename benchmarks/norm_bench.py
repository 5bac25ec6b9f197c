"""Backward of one LayerNorm / RMSNorm on the GPU: dense autograd against the SEBP norm, at row densities
laid out like right padding (CUDA-graph replays, L2 flushed, methods taking turns; bench.time_methods).

    python benchmarks/norm_bench.py OUT.json

LayerNorm: dense is torch's fused kernel (``F.layer_norm``'s backward). RMSNorm: dense is autograd through the
Llama/Qwen formula (fp32 statistics, several elementwise kernels), as Hugging Face models run it; the SEBP
RMSNorm's kernel is fused too, so its d = 1.0 column shows what fusion alone gives.
"""
import json
import sys

import torch
import torch.nn.functional as F

from sebp_kernels import sebp_layer_norm, sebp_rms_norm
from sebp_probe.bench.bench import environment, padded_rows, time_methods

CASES = [("bert-base LayerNorm", "layer", 16384, 768, 512), ("llama-3.2-3b RMSNorm", "rms", 4096, 3072, 4096)]
DENSITIES = (0.05, 0.2, 0.5, 1.0)


class Flush:
    """Writes a buffer larger than L2 between repeats, so every repeat starts from a cold cache."""

    def __init__(self):
        self.buf = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")

    def __call__(self):
        self.buf.zero_()


def rms_dense(x, w, eps=1e-5):
    xf = x.to(torch.float32)
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def main():
    flush = Flush()
    time_methods({"warm-up": (lambda: flush(), True)}, 3, flush)  # a process's first timings run slow
    rows_out = []
    for name, kind, m, n, seq in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, n, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
        w = torch.randn(n, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
        b = torch.randn(n, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
        leafs = (x, w, b) if kind == "layer" else (x, w)
        if kind == "layer":
            fwd = {"dense": lambda: F.layer_norm(x, (n,), w, b, 1e-5), "sebp": lambda: sebp_layer_norm(x, (n,), w, b, 1e-5)}
        else:
            fwd = {"dense": lambda: rms_dense(x, w, 1e-5), "sebp": lambda: sebp_rms_norm(x, w, 1e-5)}
        for d in DENSITIES:
            mask = padded_rows(m, seq, d, "cuda")
            gy = torch.randn(m, n, device="cuda", generator=g, dtype=torch.bfloat16) * mask[:, None].to(torch.bfloat16)
            # forward + backward in one capture (the autograd engine cannot wait on a forward run outside it);
            # the two forwards are the same ops, so the backward is the step minus the dense forward
            methods = {k: ((lambda f=f: torch.autograd.grad(f(), leafs, gy)), True) for k, f in fwd.items()}
            methods["forward"] = (fwd["dense"], True)
            ms = time_methods(methods, 30, flush)
            bwd = {k: ms[k] - ms["forward"] for k in fwd}
            rec = {"layer": name, "rows": m, "features": n, "density": d,
                   "step_us": {k: round(v * 1e3, 1) for k, v in ms.items()},
                   "backward_us": {k: round(v * 1e3, 1) for k, v in bwd.items()},
                   "backward_speedup": round(bwd["dense"] / bwd["sebp"], 2)}
            rows_out.append(rec)
            print(rec, flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump({"command": "python " + " ".join(sys.argv), "environment": environment(), "rows": rows_out}, f,
                  indent=1)


if __name__ == "__main__":
    main()
