"""The fast launcher's cache key (CPU: pure Python): everything Triton specialises on must change the key."""
import pytest
import torch

triton = pytest.importorskip("triton")

from sebp_kernels._triton.launch import _spec  # noqa: E402


def test_integer_specialisations_are_told_apart():
    assert _spec(16) != _spec(17)  # divisibility by 16
    assert _spec(1) != _spec(3)  # == 1
    assert _spec(2**31) != _spec(2**31 - 16 * 2**20)  # 32-bit range
    assert _spec(32) == _spec(48) and _spec(5) == _spec(7)
    assert _spec(True) != _spec(1) and _spec(True) != _spec(False)


def test_tensor_dtype_and_alignment_are_told_apart():
    buf = torch.zeros(64, dtype=torch.float32)
    assert _spec(buf) == _spec(buf[4:])  # 16 bytes further: still aligned
    assert _spec(buf) != _spec(buf[1:])  # 4 bytes: not
    assert _spec(buf) != _spec(buf.to(torch.float16))
    assert _spec(0.5) == _spec(2.0) and _spec(None) != _spec(0.5)


def test_launch_hooks_count_as_active_only_when_they_do_something():
    from sebp_kernels._triton.launch import _active

    class Chain:
        def __init__(self, calls):
            self.calls = calls

    assert not _active(None) and not _active(Chain([]))
    assert _active(Chain([print])) and _active(print)


class _FakeCompiled:
    """Stands in for Triton's CompiledKernel: records what the fast path hands its launcher."""

    function = object()
    packed_metadata = "meta"

    def __init__(self):
        self.launches = []

    @property
    def run(self):
        return lambda *a: self.launches.append(a)


class _FakeJIT:
    """Stands in for a @triton.jit kernel ``k(x_ptr, n, eps, B: constexpr)``: counts JIT-path launches."""

    arg_names = ["x_ptr", "n", "eps", "B"]

    def __init__(self):
        self.jit_launches = 0
        self.compiled = _FakeCompiled()

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.jit_launches += 1
            return self.compiled

        return launch


def _fast(monkeypatch, hook=None):
    from types import SimpleNamespace

    from sebp_kernels._triton import launch

    monkeypatch.setattr(launch, "_stream", lambda device: 7)
    fn = _FakeJIT()
    fl = launch.FastLaunch(fn)
    fl._hooks = SimpleNamespace(launch_enter_hook=hook)  # as on a CUDA build
    return fn, fl


class _EmptyChain:  # Triton >= 3.5 keeps one in launch_enter_hook when no profiler is attached
    calls = []


@pytest.mark.parametrize("hook", [None, _EmptyChain()])
def test_fast_path_after_the_first_launch_of_a_specialisation(monkeypatch, hook):
    fn, fl = _fast(monkeypatch, hook)
    buf = torch.zeros(64)
    fl[(3,)](buf, 32, 0.5, B=16, num_warps=4)
    assert fn.jit_launches == 1 and not fn.compiled.launches
    fl[(5, 2)](buf, 48, 0.25, B=16, num_warps=4)  # same specialisation (48 is also a multiple of 16)
    assert fn.jit_launches == 1
    # grid padded to 3-D, the stream, Triton's function and metadata, no launch hooks, then every argument
    # in signature order with the constexprs last
    assert fn.compiled.launches == [(5, 2, 1, 7, _FakeCompiled.function, "meta", None, None, None, buf, 48, 0.25,
                                     16)]
    for other in ((buf[1:], 32, 0.5), (buf, 33, 0.5), (buf.double(), 32, 0.5)):  # alignment, divisibility, dtype
        fl[(1,)](*other, B=16, num_warps=4)
    fl[(1,)](buf, 32, 0.5, B=32, num_warps=4)  # another constexpr
    fl[(1,)](buf, 32, 0.5, B=16, num_warps=8)  # another launch option
    assert fn.jit_launches == 6 and len(fn.compiled.launches) == 1


def test_active_launch_hooks_take_the_jit_path(monkeypatch):
    class Chain:
        calls = [print]

    fn, fl = _fast(monkeypatch, hook=Chain())
    buf = torch.zeros(64)
    for _ in range(3):
        fl[(1,)](buf, 32, 0.5, B=16)
    assert fn.jit_launches == 3 and not fn.compiled.launches


def test_planned_launch_keys_on_the_plan_and_tensor_alignment(monkeypatch):
    """launch_planned: the caller's plan number stands for every non-tensor argument, so only the plan and
    the tensors' 16-byte alignment pick the compiled kernel; clear() forgets them all."""
    fn, fl = _fast(monkeypatch)
    buf = torch.zeros(64)
    fl.launch_planned((3,), 0, 1, (buf, 32, 0.5), {"B": 16, "num_warps": 4})
    fl.launch_planned((3,), 0, 1, (buf[4:], 32, 0.5), {"B": 16, "num_warps": 4})  # still aligned: fast path
    assert fn.jit_launches == 1 and len(fn.compiled.launches) == 1
    assert fn.compiled.launches[0][10:] == (32, 0.5, 16)  # the arguments, then the constexpr
    fl.launch_planned((3,), 0, 1, (buf[1:], 32, 0.5), {"B": 16, "num_warps": 4})  # misaligned: JIT
    fl.launch_planned((3,), 1, 1, (buf, 33, 0.5), {"B": 16, "num_warps": 4})  # another plan: JIT
    assert fn.jit_launches == 3
    fl.launch_planned((3,), 1, 1, (buf, 33, 0.5), {"B": 16, "num_warps": 4})
    assert fn.jit_launches == 3 and len(fn.compiled.launches) == 2
    fl.clear()
    fl.launch_planned((3,), 1, 1, (buf, 33, 0.5), {"B": 16, "num_warps": 4})
    assert fn.jit_launches == 4



def test_plans_start_afresh_past_their_limit(monkeypatch):
    """Plans keeps at most ``limit`` keys; past it, the plans and its launchers' fast-path entries go."""
    from sebp_kernels._triton.launch import Plans

    fn, fl = _fast(monkeypatch)
    plans = Plans(fl, limit=2)
    buf = torch.zeros(64)
    fl.launch_planned((1,), 0, 1, (buf, 32, 0.5), {"B": 16})
    assert plans.add("a", 1) == 1 and plans.add("b", 2) == 2 and plans.get("a") == 1
    plans.add("c", 3)
    assert plans.get("a") is None and plans.get("b") is None and plans.get("c") == 3
    fl.launch_planned((1,), 0, 1, (buf, 32, 0.5), {"B": 16})  # its entry went too: the JIT path again
    assert fn.jit_launches == 2


def test_what_changes_between_layers_and_batches_is_not_specialised():
    """The kernels' row count and the integers that follow from it, the row count's pointer (its alignment
    differs between the padding's count and a layer's own) and the fused kernel's bias column blocks (not
    divisible by 16 for some widths) are declared do_not_specialize: Triton compiles no kernel anew for them in
    the middle of a run (4.7 s at a Llama-1B run's ninth step on an H200, before)."""
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter does not specialise")
    from sebp_kernels._triton import dw, dx, grads, select

    def loose(kernel):
        return {p.name for p in kernel.params if p.do_not_specialize}

    assert {"M", "DW_SPLIT", "DB_SPLIT", "N_DW", "N_DX", "DB_COLS", "count_ptr"} <= loose(grads._grads_kernel)
    assert {"M", "count_ptr"} <= loose(dx._dx_kernel) & loose(dw._dw_kernel) & loose(dw._db_kernel)
    assert {"M", "count_ptr"} <= loose(select._compact_kernel)
    assert "N_IN" not in loose(grads._grads_kernel)  # feature sizes, fixed per layer, stay specialised
