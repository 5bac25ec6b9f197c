"""The SEBP linear's backward as a ``torch.library.triton_op``: the same Triton kernels, launched through
``wrap_triton`` so that Inductor launches them from its own generated code, for ``benchmarks/op_overhead.py``
to time against the operator of :mod:`sebp_kernels.library` (whose Python body launches them through
``FastLaunch``).

What it leaves out, so that its body is only torch allocations and kernel launches: exact mode only (a pass
over dY selects the rows), no density state (never the dense fallback), no row hint, no bias gradient, the
first tile setting (no fallback for GPUs with less shared memory), no reused dX buffer. The launch plan is
worked out from the shapes when Inductor traces the body, so a compiled caller should take static shapes
(``dynamic=False``): the plan branches on the row count. The ticket counters are a fresh zeroed tensor a call
(the operator of :mod:`sebp_kernels.library` keeps one per device), one fill more on the GPU.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.library import triton_op, wrap_triton

from sebp_kernels._triton.backward import INTERPRET, _ieee
from sebp_kernels._triton.grads import _grads_kernel, _plan
from sebp_kernels._triton.select import EXACT, _compact_kernel, _flag_blocks, _row_flags_kernel, _sm_count, \
    compact_plan
from sebp_kernels._triton.tuning import cdiv


def _select(dy: Tensor) -> tuple[Tensor, Tensor]:
    """(perm, count) of dY's non-zero rows, as ``select.select_rows_device`` in exact mode."""
    m, n = dy.shape
    block_r, block_c, unroll, warps = _flag_blocks(n, INTERPRET)
    nb = cdiv(m, block_r)
    flags = torch.empty(m, dtype=torch.int32, device=dy.device)
    block_count = torch.empty(nb, dtype=torch.int32, device=dy.device)
    perm = torch.empty(m, dtype=torch.int32, device=dy.device)
    count = torch.empty(1, dtype=torch.int32, device=dy.device)
    wrap_triton(_row_flags_kernel)[(nb,)](dy, flags, block_count, m, n, dy.stride(0), dy.stride(1), 0.0,
                                          MODE=EXACT, BLOCK_R=block_r, BLOCK_C=block_c, UNROLL=unroll,
                                          num_warps=warps)
    n_compact, compact_kw = compact_plan(m, block_r, INTERPRET)
    wrap_triton(_compact_kernel)[(n_compact,)](flags, block_count, perm, count, m, **compact_kw)
    return perm, count


@triton_op("sebp_bench::linear_backward_tt", mutates_args=())
def linear_backward_tt(dy: Tensor, x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """(dX, dW) of ``Y = X Wᵀ`` over the non-zero rows of 2-D ``dy`` (exact mode): select, then the fused
    gradient kernel, as :func:`sebp_kernels._triton.backward.sebp_backward_triton` runs them."""
    m, n_out = dy.shape
    n_in = weight.shape[1]
    perm, count = _select(dy)
    n_sm = _sm_count(dy.device)
    plan = _plan(m, n_out, n_in, dy.dtype, True, True, False, _ieee(dy.dtype), n_sm, INTERPRET,
                 1 if INTERPRET else None, None, dy.stride(), x.stride(), weight.stride(), 0)
    dev = dy.device
    dx = torch.empty((m, n_in), dtype=dy.dtype, device=dev)
    dw = torch.empty((n_out, n_in), dtype=weight.dtype, device=dev)
    dw_part_n, _, dx_part_n = plan.part_n
    # distinct tensors in every slot (one tensor in two slots would alias under functionalization)
    dw_part = torch.empty(max(dw_part_n, 1), dtype=torch.float32, device=dev)
    dx_part = torch.empty(max(dx_part_n, 1), dtype=torch.float32, device=dev)
    unused = [torch.empty(1, dtype=t, device=dev) for t in (dy.dtype, torch.float32, torch.int8, torch.int32)]
    tickets = torch.zeros(plan.n_tickets, dtype=torch.int32, device=dev)
    wrap_triton(_grads_kernel)[plan.grid](dy, x, weight, dx, dw, unused[0], dw_part, unused[1], dx_part, perm,
                                          count, tickets, unused[2], unused[3], *plan.ints, **plan.kw)
    return dx, dw


class TritonOpLinear(torch.autograd.Function):
    """``F.linear`` without bias whose backward is :func:`linear_backward_tt`."""

    @staticmethod
    def forward(x, weight):
        return torch.nn.functional.linear(x, weight)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx, dw = linear_backward_tt(dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1]), weight)
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
