"""The SEBP linear's backward as a triton_op (sebp_kernels._triton.traced), which a compiled SEBP linear takes
with ``SEBPConfig(triton_op=True)``: against the torch reference under the interpreter (row counts below their bucket, bias,
frozen weight, threshold); traced on the CPU into its kernel launches, with a graph per row-count bucket; and
compiled by Inductor on a GPU against dense."""
from __future__ import annotations

import pytest
import torch

from sebp_kernels import SEBPConfig, functional, registry
from sebp_kernels.interpret import INTERPRET
from sebp_kernels.modules import SEBPLinear

pytest.importorskip("triton")
from sebp_kernels._triton import traced  # noqa: E402
from sebp_kernels.reference import sebp_backward_torch  # noqa: E402


def test_row_counts_are_planned_for_their_power_of_two():
    assert [traced.row_bucket(m) for m in (1, 256, 257, 300, 512, 513, 4096, 4097)] == \
        [256, 256, 512, 512, 512, 1024, 4096, 8192]


def _stack(device="cpu", dtype=torch.float32, width=24, layers=3, triton_op=True):
    torch.manual_seed(0)
    linears = [torch.nn.Linear(width, width, bias=i == 1).to(device, dtype) for i in range(layers)]
    dense = torch.nn.Sequential(*linears)
    sebp = torch.nn.Sequential(*[SEBPLinear.from_linear(lin, SEBPConfig("exact", triton_op=triton_op)) for lin in linears])
    registry.keys_as_inputs(sebp)
    return sebp, dense


def _counting(compiles: list):
    """A torch.compile backend tracing forward and backward with AOTAutograd; keeps each backward graph."""
    from torch._functorch.aot_autograd import aot_module_simplified

    def backend(gm, example):
        return aot_module_simplified(gm, example, fw_compiler=lambda g, _: g,
                                     bw_compiler=lambda g, _: compiles.append(g) or g)
    return backend


@pytest.fixture
def triton_op(monkeypatch):
    """The compiled SEBP linears of :func:`_stack` take the triton_op on the CPU too (no GPU to ask for)."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(functional, "_traced_eps", lambda config, x, weight: 0.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the compiled test below runs the kernels")
def test_a_compiled_sebp_linear_launches_the_kernels_from_the_graph_a_graph_per_bucket(triton_op, monkeypatch):
    """Dynamo and AOTAutograd trace each layer's backward into the flags, compaction and fused gradient
    launches (no sebp operator); with dynamic shapes, row counts in one power-of-two bucket share the graph and
    the next bucket traces another."""
    if INTERPRET:
        pytest.skip("traced in the main test run (the interpreter's kernels are not wrap_triton's)")
    import triton

    from tests.helpers import FakeCudaDriver

    monkeypatch.setattr(triton.runtime.driver, "_active", FakeCudaDriver())  # torch 2.11 lowers as it traces
    sebp, _ = _stack()
    graphs = []
    compiled = torch.compile(sebp, dynamic=True, backend=_counting(graphs))
    for seq, want in ((150, 1), (200, 1), (250, 1), (300, 2)):  # 2 x seq rows: 300-500 in one bucket, 600 not
        out = compiled(torch.randn(2, seq, 24, requires_grad=True))
        with pytest.raises(AttributeError, match="FakeCudaDriver"):  # traced whole; launching asks for a GPU
            out.sum().backward()
        assert len(graphs) == want, seq
    code = graphs[-1].code
    assert code.count("triton_kernel_wrapper_functional(") == 3 * 3 and "sebp.linear_backward" not in code


def test_without_the_setting_the_compiled_backward_is_the_operator():
    sebp, _ = _stack(triton_op=False)
    graphs = []
    torch.compile(sebp, dynamic=False, backend=_counting(graphs))(torch.randn(30, 24, requires_grad=True)).sum() \
        .backward()  # the operator runs the torch path on the CPU
    assert "sebp.linear_backward" in graphs[-1].code and "triton_kernel_wrapper" not in graphs[-1].code


@pytest.mark.parametrize("mode,backend", [("topk", "auto"), ("exact", "torch")])
def test_layers_the_kernels_do_not_serve_keep_the_operator(mode, backend):
    cfg = SEBPConfig(mode, top_n=4, backend=backend, triton_op=True)
    assert functional._traced_eps(cfg, torch.zeros(2, 4), torch.zeros(4, 4)) is None


def test_a_torch_without_triton_op_keeps_the_operator(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "sebp_kernels._triton.traced", None)  # its import fails
    assert not functional.triton_op_available()
    functional._triton_op_here.cache_clear()
    try:
        assert functional._traced_eps(SEBPConfig(triton_op=True), torch.zeros(2, 4), torch.zeros(4, 4)) is None
    finally:
        functional._triton_op_here.cache_clear()


def test_the_setting_is_off_by_default_and_the_cpu_keeps_the_operator():
    assert functional._traced_eps(SEBPConfig("exact"), torch.zeros(2, 4), torch.zeros(4, 4)) is None
    if not INTERPRET:  # (the interpreter's kernels take CPU tensors: its suite checks them below)
        assert functional._traced_eps(SEBPConfig(triton_op=True), torch.zeros(2, 4), torch.zeros(4, 4)) is None


def _reference(dy, x, weight, need, eps):
    cfg = SEBPConfig("exact") if eps == 0 else SEBPConfig("threshold", eps=eps)
    return sebp_backward_torch(dy, x, weight, cfg, *need)


if INTERPRET:
    @pytest.mark.parametrize("shape", [(6, 4), (2, 3, 4), (2, 3, 5, 4)])
    def test_layers_of_any_leading_shape_take_the_kernels(shape):
        """A model's linears see (batch, seq, features): the check is on the rows, not on x as it comes."""
        weight, on = torch.zeros(5, 4), SEBPConfig("exact", triton_op=True)
        assert functional._traced_eps(on, torch.zeros(shape), weight) == 0.0
        assert functional._traced_eps(SEBPConfig("threshold", eps=0.25, triton_op=True), torch.zeros(shape),
                                      weight) == 0.25
        assert functional._traced_eps(on, torch.zeros(shape, dtype=torch.float64), weight) is None

    def test_dynamo_reads_the_choice_without_a_graph_break():
        cfg = SEBPConfig("threshold", eps=0.5, triton_op=True)

        def f(x, w):
            return x * functional._traced_eps(cfg, x, w)

        torch._dynamo.reset()
        explained = torch._dynamo.explain(f)(torch.ones(2, 3, 4), torch.zeros(5, 4))
        assert explained.graph_break_count == 0 and explained.graph_count == 1
        assert torch.compile(f, backend="eager")(torch.ones(2, 3, 4), torch.zeros(5, 4)).max() == 0.5

    @pytest.mark.parametrize("rows", [5, 300])  # below their buckets (256, 512): the grids cover more rows
    # every output set and both modes (exact, threshold), each mode with and without dX: the selection does
    # not depend on which outputs are asked for
    @pytest.mark.parametrize("need,eps", [((True, True, True), 0.0), ((True, True, True), 0.5),
                                          ((True, False, False), 0.0), ((False, True, True), 0.5)])
    def test_interpreted_gradients_equal_the_reference(rows, need, eps):
        try:
            torch.library.wrap_triton(traced._grads_kernel)
        except RuntimeError as err:  # torch 2.11's wrap_triton takes only compiled kernels
            pytest.skip(f"this torch's wrap_triton refuses the interpreter's kernels: {err}")
        torch.manual_seed(rows)
        dy, x, weight = torch.randn(rows, 24), torch.randn(rows, 40), torch.randn(24, 40)
        dy[::3] = 0  # rows without gradient
        dy[1::3] *= 0.1  # rows below the threshold
        got = traced.linear_grads_traced(dy, x, weight, *need, eps)
        for g, w, wanted in zip(got, _reference(dy, x, weight, need, eps), need):
            if wanted:
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
            else:
                assert g.numel() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_inductor_compiled_sebp_linears_equal_dense_across_buckets(monkeypatch, dtype):
    traced_calls = []
    real = functional._grads_traced
    monkeypatch.setattr(functional, "_grads_traced", lambda *a: traced_calls.append(1) or real(*a))
    torch._dynamo.reset()
    sebp, dense = _stack("cuda", dtype, width=256, layers=4)
    compiled = torch.compile(sebp, dynamic=True)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for seq in (350, 450, 750):  # (batch, seq, features) as a model's linears see them; rows 700-1500
        x = torch.randn(2, seq, 256, device="cuda", dtype=dtype)
        mask = (torch.arange(seq, device="cuda") % 3 != 0).to(dtype)[None, :, None]  # a third: no gradient
        grads = []
        for net in (compiled, dense):
            xi = x.clone().requires_grad_()
            for p in net.parameters():
                p.grad = None
            (net(xi) * mask).float().pow(2).sum().backward()
            grads.append([xi.grad] + [p.grad.clone() for p in net.parameters()])
        for a, b in zip(*grads):
            assert float((a.float() - b.float()).abs().max()) <= tol * float(b.float().abs().max()), seq
    assert traced_calls  # the layers' backward was the triton_op (traced once a layer a compile), not the operator
