"""Cross-entropy loss and the logits' gradient of a chunk of rows, in place of the logits, in one launch.

For logits ``z`` (rows x V; float32, float16 or bfloat16, unit column stride) and labels ``y`` (int64, every
one in [0, V)), each program owns one row and reads it twice:

1. online maximum and sum of ``exp(z - max)`` (and, with label smoothing, the sum of ``z``) in fp32, giving
   ``lse = max + log(sum)`` and the row's loss ``lse - z[y]`` (smoothed: ``(1 - e)(lse - z[y]) + e(lse -
   mean z)``, as ``F.cross_entropy`` defines it);
2. ``scale * (softmax(z) - (1 - e) onehot(y) - e / V)`` written over ``z`` in its own dtype.

So the logits never get an fp32 copy: 3 passes of the chunk's own bytes (read, read, write) instead of the
dozen that the same computation takes as separate torch ops, and no second buffer. The caller multiplies the
gradient with the weight (dL/dh) and with the hidden states (dL/dW) by cuBLAS.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..interpret import INTERPRET

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK = 4096  # columns per step of a row's loop (a row of 128k logits: 32 steps)


@triton.jit
def _ce_kernel(z_ptr, z_stride, y_ptr, loss_ptr, V, scale, smoothing,
               SMOOTH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * z_stride
    cols = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    total = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        mask = start + cols < V
        z = tl.load(base + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
        if SMOOTH:
            total += tl.sum(tl.where(mask, z, 0.0), axis=0)
    lse = m + tl.log(s)
    y = tl.load(y_ptr + row)
    zy = tl.load(base + y).to(tl.float32)
    loss = lse - zy
    if SMOOTH:
        loss = (1.0 - smoothing) * loss + smoothing * (lse - total / V)
    tl.store(loss_ptr + row, loss)
    for start in range(0, V, BLOCK):
        mask = start + cols < V
        z = tl.load(base + start + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(z - lse)
        if SMOOTH:
            g = g - smoothing / V
        g = tl.where(start + cols == y, g - (1.0 - smoothing), g) * scale
        tl.store(base + start + cols, g.to(z_ptr.dtype.element_ty), mask=mask)


def ce_grad_inplace(z: torch.Tensor, y: torch.Tensor, scale: float, smoothing: float = 0.0) -> torch.Tensor:
    """Per-row losses (fp32) of logits ``z`` for labels ``y``; ``z`` is overwritten with ``scale`` times the
    gradient of the loss sum (see the module docstring)."""
    rows, vocab = z.shape
    loss = torch.empty(rows, dtype=torch.float32, device=z.device)
    if rows:
        _ce_kernel[(rows,)](z, z.stride(0), y, loss, vocab, float(scale), float(smoothing),
                            SMOOTH=bool(smoothing), BLOCK=min(BLOCK, triton.next_power_of_2(vocab)),
                            num_warps=8)
    return loss


def usable(z_like: torch.Tensor) -> bool:
    """Whether the kernel takes logits like ``z_like`` here (CUDA, or CPU tensors under the interpreter)."""
    want = "cpu" if INTERPRET else "cuda"
    return z_like.device.type == want and z_like.dtype in DTYPES and (z_like.dtype != torch.bfloat16 or
                                                                       not INTERPRET)
