"""Shared memory that each SEBP Triton kernel takes per program, as compiled for this GPU, over BERT-base and
Llama-3.2-3B widths in bf16 and fp32: which kernels would not launch on a GPU with less shared memory per
block (A100: 163 KB usable, L4 and consumer cards: about 99 KB).

    python benchmarks/smem_probe.py [out.json]
"""
import datetime
import json
import sys

import torch
import triton

from sebp_kernels import SEBPConfig
from sebp_kernels._triton import grads, norm, select
from sebp_kernels._triton.act import _bwd, _fwd, act_backward_triton, act_forward_triton
from sebp_kernels._triton.backward import sebp_backward_triton
from sebp_probe.bench.bench import padded_rows


def shared(launcher):
    """The largest shared-memory size among the kernels a FastLaunch has compiled so far."""
    return max((k.metadata.shared for k, _ in launcher._cache.values()), default=0)


def main():
    dev = torch.device("cuda")
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": "python benchmarks/smem_probe.py " + " ".join(sys.argv[1:]), "bytes": {}}
    for dtype in (torch.bfloat16, torch.float32):
        for launcher in (grads._grads, norm._norm_bwd, norm._sum_parts, select._row_flags, select._compact, _fwd,
                         _bwd):
            launcher.clear()
        for m, n_in, n_out in ((4096, 768, 3072), (4096, 3072, 768), (4096, 3072, 8192), (4096, 8192, 3072)):
            mask = padded_rows(m, 512, 0.2, dev)
            dy = torch.randn(m, n_out, device=dev, dtype=dtype) * mask[:, None].to(dtype)
            x = torch.randn(m, n_in, device=dev, dtype=dtype)
            w = torch.randn(n_out, n_in, device=dev, dtype=dtype)
            sebp_backward_triton(dy, x, w, SEBPConfig("exact"))
            sebp_backward_triton(dy, x, w, SEBPConfig("exact"))  # the fast path's cache holds the kernel now
            for n in (n_in, n_out):
                xs, dys = torch.randn(m, n, device=dev, dtype=dtype), torch.randn(m, n, device=dev, dtype=dtype)
                wt = torch.randn(n, device=dev, dtype=dtype)
                mean, rstd = xs.float().mean(1), torch.rsqrt(xs.float().var(1) + 1e-5)
                for _ in range(2):
                    norm.norm_backward_triton(dys, xs, wt, mean, rstd, True, True, True, 132)
                    h, bad = act_forward_triton("swiglu", xs, dys, True)
                    act_backward_triton("swiglu", dys, xs, dys, bad, True, True, True)
        torch.cuda.synchronize()
        sizes = {name: shared(launcher) for name, launcher in (
            ("fused gradient kernel", grads._grads), ("norm backward", norm._norm_bwd),
            ("norm partial sums", norm._sum_parts), ("row flags", select._row_flags), ("compact", select._compact),
            ("activation forward", _fwd), ("activation backward", _bwd))}
        out["bytes"][str(dtype)] = sizes
        print(dtype, {k: f"{v / 1024:.1f} KB" for k, v in sizes.items()}, flush=True)
    if len(sys.argv) > 1:
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
