"""A stack of bias-free linears whose backward is the SEBP linear's ``torch.library.triton_op``
(:mod:`sebp_kernels._triton.traced`: the row selection and fused gradient kernels launched through
``wrap_triton``, so that Inductor launches them from its own generated code), for ``benchmarks/op_overhead.py
--triton-op`` to time against the operator of :mod:`sebp_kernels.library` (whose Python body launches them
through ``FastLaunch``). Exact mode: every row with a non-zero gradient.
"""
from __future__ import annotations

import torch

from sebp_kernels._triton.traced import linear_grads_traced


class TritonOpLinear(torch.autograd.Function):
    """``F.linear`` without bias whose backward is :func:`linear_grads_traced` (exact)."""

    @staticmethod
    def forward(x, weight):
        return torch.nn.functional.linear(x, weight)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx, dw, _ = linear_grads_traced(dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1]), weight, True,
                                        True, False, 0.0)
        return dx.view(x.shape), dw


class TritonOpStack(torch.nn.Module):
    """Bias-free linears applied in turn, each through :class:`TritonOpLinear`."""

    def __init__(self, linears):
        super().__init__()
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(lin.weight.detach().clone()) for lin in linears])

    def forward(self, x):
        for w in self.weights:
            x = TritonOpLinear.apply(x, w)
        return x
