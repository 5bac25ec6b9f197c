"""The SEBP backward as a ``triton_op`` (benchmarks/op_triton.py, timed by ``op_overhead.py --triton-op``)
against dense: run as written under the Triton interpreter (a subprocess), and traced by Dynamo and
AOTAutograd on the CPU into the three kernel launches Inductor would make (no launch there: no GPU driver);
compiled by Inductor on a GPU where there is one."""
from __future__ import annotations

import functools
import os

import pytest
import torch

from tests.helpers import interpreter_suite, load_benchmark

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytest.importorskip("triton")
# loaded once a process: it defines its operator on import
op_triton = functools.cache(lambda: load_benchmark("op_triton"))


def _case(device="cpu", dtype=torch.float32, layers=3, width=24, rows=(2, 20), real=13):
    """(the triton_op stack, the same linears, input, a mask zeroing the rows from ``real`` on)."""
    torch.manual_seed(0)
    linears = [torch.nn.Linear(width, width, bias=False).to(device, dtype) for _ in range(layers)]
    x = torch.randn(*rows, width, device=device, dtype=dtype)
    mask = torch.ones(*rows, 1, device=device, dtype=dtype)
    mask[:, real:] = 0
    return op_triton().TritonOpStack(linears), torch.nn.Sequential(*linears), x, mask


def _grads(net, x, mask):
    x = x.detach().clone().requires_grad_()
    (net(x) * mask).float().pow(2).sum().backward()
    return [x.grad] + [p.grad for p in net.parameters()]


def _assert_dense(got, want, tol):
    for a, b in zip(got, want):
        assert float((a.float() - b.float()).abs().max()) <= tol * float(b.float().abs().max()), (a, b)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the compiled test below runs the kernels")
def test_the_traced_backward_is_the_three_kernel_launches():
    """Without the interpreter, on the CPU: Dynamo and AOTAutograd trace the stack's backward into the flags,
    compaction and fused gradient kernels of each layer (what Inductor would launch from its own code), with no
    sebp_bench operator left in the graph."""
    if INTERPRET:
        pytest.skip("traced in the main test run (the interpreter's kernels are not wrap_triton's)")
    from torch._functorch.aot_autograd import aot_module_simplified

    stack, _, x, mask = _case()
    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return gm

    compiled = torch.compile(stack, dynamic=False, backend=lambda gm, ex: aot_module_simplified(
        gm, ex, fw_compiler=keep, bw_compiler=keep))
    out = compiled(x.requires_grad_())
    with pytest.raises(RuntimeError, match="driver"):  # the backward is traced, then its kernels need a GPU
        (out * mask).sum().backward()
    code = graphs[-1].code
    kernels = code.count("triton_kernel_wrapper_functional(")
    assert kernels == 3 * len(stack.weights) and "sebp_bench" not in code, code[:2000]


if INTERPRET:
    def test_interpreted_gradients_equal_dense():
        stack, dense, x, mask = _case()
        _assert_dense(_grads(stack, x, mask), _grads(dense, x, mask), 1e-5)
else:
    test_interpreter_suite = interpreter_suite(__file__)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_inductor_compiled_gradients_equal_dense(dtype):
    stack, dense, x, mask = _case("cuda", dtype, layers=4, width=256, rows=(4, 300), real=170)
    want = _grads(dense, x, mask)
    _assert_dense(_grads(torch.compile(stack, dynamic=False), x, mask), want, 2e-2 if dtype == torch.bfloat16 else 1e-4)
