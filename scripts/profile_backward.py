"""Kernel-by-kernel GPU time of one SEBP backward (torch.profiler, CUDA activity), to check that the whole
path costs what its kernels cost alone.   python scripts/profile_backward.py"""
import torch
from torch.profiler import ProfilerActivity, profile

from sebp_kernels import SEBPConfig
from sebp_kernels._triton import sebp_backward_triton
from sebp_probe.bench import padded_rows

dev = "cuda"
for (M, IN, OUT) in [(16384, 768, 3072), (4096, 3072, 8192)]:
    x = torch.randn(M, IN, device=dev, dtype=torch.bfloat16)
    w = torch.randn(OUT, IN, device=dev, dtype=torch.bfloat16) / IN**0.5
    for dens in (0.01, 0.2, 1.0):
        mask = padded_rows(M, 512 if M == 16384 else 4096, dens, dev)
        dy = torch.randn(M, OUT, device=dev, dtype=torch.bfloat16) * mask.unsqueeze(1).to(torch.bfloat16)
        for _ in range(3):
            sebp_backward_triton(dy, x, w, SEBPConfig(), True, True, True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                sebp_backward_triton(dy, x, w, SEBPConfig(), True, True, True)
            torch.cuda.synchronize()
        print(f"=== {M}x{IN}->{OUT} d={dens}")
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]:
            print(f"   {e.key[:60]:60s} calls {e.count:4d} avg {e.device_time_total / e.count:9.1f} us")
