"""Why the SEBP GELU keeps torch's forward: Triton GELUs against F.gelu on a CUDA GPU, elements that differ.

    python3 scripts/gelu_probe.py

Variants: 0 x*0.5*(1+erf(x/sqrt2)) with libdevice erf (torch's formula), 1 x*normcdf(x), 2 x*0.5*erfc(-x/sqrt2),
3 and 4 other orders of the products, 5 Triton's erf. 2^20 samples of 3*N(0,1), bf16 and fp32. On an H100
(2026-11-22, torch 2.11, triton 3.6): 14630 (bf16) and 94786 (fp32) differ for 0, 3, 4, 5; 72769 / 526628 for 1.
"""
import torch, triton, triton.language as tl
from triton.language.extra import libdevice

@triton.jit
def k(x_ptr, o_ptr, N, V: tl.constexpr, BLOCK: tl.constexpr):
    off = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = off < N
    xin = tl.load(x_ptr + off, mask=m, other=0.0)
    x = xin.to(tl.float32)
    if V == 0:
        y = x * 0.5 * (1.0 + libdevice.erf(x * 0.7071067811865476))
    elif V == 1:
        y = x * libdevice.normcdf(x)
    elif V == 2:
        y = x * 0.5 * libdevice.erfc(-x * 0.7071067811865476)
    elif V == 3:
        y = 0.5 * x * (1.0 + libdevice.erf(x * 0.7071067811865476))
    elif V == 4:
        y = x * (0.5 * (1.0 + libdevice.erf(x * 0.7071067811865476)))
    else:
        y = x * 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
    tl.store(o_ptr + off, y.to(xin.dtype), mask=m)

for dt in (torch.bfloat16, torch.float32):
    x = (torch.randn(1 << 20, device="cuda") * 3).to(dt)
    want = torch.nn.functional.gelu(x)
    for v in range(6):
        o = torch.empty_like(x)
        k[(triton.cdiv(x.numel(), 1024),)](x, o, x.numel(), V=v, BLOCK=1024)
        print(dt, "variant", v, "differ", int((o != want).sum()))
