"""Inductor's lowering of the kernels the SEBP linear's triton_op backward launches (sebp_kernels._triton.traced):
to find what each writes, Inductor lowers it to TTIR, on the CPU here with a stand-in CUDA target; torch 2.11
lowers every scalar argument as a constant, later releases as an argument. Each kernel must lower both ways."""
from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import FakeCudaDriver

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytest.importorskip("triton")


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
        monkeypatch.setattr(triton.runtime.driver, "_active", FakeCudaDriver())
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

