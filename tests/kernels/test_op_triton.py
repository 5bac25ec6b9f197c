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


class _FakeCudaDriver:
    """Only what Triton's front end asks of a driver to lower a kernel to TTIR (no GPU needed for that)."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)


def _recorded_launches(monkeypatch):
    """(kernel, arguments by name) of each ``wrap_triton`` launch of one backward, recorded, not run."""
    launches = []

    def wrap(kernel):
        def launch(*args, **kw):
            launches.append((kernel, {**dict(zip(kernel.arg_names, args)), **kw}))

        return type("Grid", (), {"__getitem__": lambda self, grid: launch})()

    from sebp_kernels._triton import traced

    monkeypatch.setattr(traced, "wrap_triton", wrap)
    dy, x, weight = (torch.randn(*shape) for shape in ((40, 24), (40, 16), (24, 16)))
    traced.linear_grads_traced._opoverload._op(dy, x, weight, True, True, True, 0.0)  # the body, no dispatcher
    return launches, {"dy": dy, "x": x, "weight": weight}


def _writes(kernel, kwargs):
    """The argument names Inductor's analysis finds written (its entry point's name differs by release)."""
    from torch._higher_order_ops import triton_kernel_wrap as wrap

    if hasattr(wrap, "identify_accessed_tensors"):
        return {dep.name for dep in wrap.identify_accessed_tensors(kernel, dict(kwargs), {}).read_writes.writes}
    return set(wrap.identify_mutated_tensors(kernel, dict(kwargs), {}))


@pytest.mark.parametrize("scalars", ["arguments", "constants"])
def test_inductor_finds_what_each_kernel_writes(monkeypatch, scalars):
    """Inductor lowers each wrap_triton kernel to TTIR to find the tensors it writes; where that fails it takes
    every input as written and functionalization copies into them (a weight that requires grad then fails the
    compile). Some torch releases lower every scalar argument as a constant: each kernel must lower both ways,
    and none writes dY, X or W."""
    if INTERPRET:
        pytest.skip("lowered in the main test run")
    import triton
    from torch._higher_order_ops.triton_kernel_wrap import generate_ttir

    if not torch.cuda.is_available():
        monkeypatch.setattr(triton.runtime.driver, "_active", _FakeCudaDriver())
    launches, inputs = _recorded_launches(monkeypatch)
    assert len(launches) == 3
    for kernel, kwargs in launches:
        if scalars == "constants":
            for param in kernel.params:
                if not isinstance(kwargs[param.name], torch.Tensor):
                    for flag, value in (("is_constexpr", True), ("do_not_specialize", False),
                                        ("do_not_specialize_on_alignment", False)):
                        monkeypatch.setattr(param, flag, value)
        generate_ttir(kernel, dict(kwargs), {})  # raises where the kernel does not lower
        writes = _writes(kernel, kwargs)
        written = [name for name, value in kwargs.items()
                   if name in writes and any(value is t for t in inputs.values())]
        assert writes and not written, (kernel.fn.__name__, sorted(writes))


if INTERPRET:
    def test_interpreted_gradients_equal_dense():
        try:
            from sebp_kernels._triton.grads import _grads_kernel
            torch.library.wrap_triton(_grads_kernel)
        except RuntimeError as err:  # torch 2.11's wrap_triton takes only compiled kernels
            pytest.skip(f"this torch's wrap_triton refuses the interpreter's kernels: {err}")
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
