"""The sebp:: custom ops that torch.compile traces (sebp_kernels.registry): one graph, the eager gradients, and
each compiled layer reading its own module's settings when the backward runs."""
from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch._dynamo as dynamo
from torch import nn

from sebp_kernels import SEBPConfig, SEBPLinear, functional, registry
from sebp_probe import patch_activations, patch_model, patch_norms
from tests.tiny_models import padded_batch, tiny_model


def _grads(model, owner, batch):
    owner.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in owner.named_parameters() if p.grad is not None}


def _patched(arch):
    model = tiny_model(arch).eval()  # no dropout: eager and compiled runs must see the same masks
    patch_model(model, SEBPConfig("exact"))
    patch_norms(model)
    patch_activations(model)
    return model


@pytest.mark.parametrize("arch,backend", [("bert", "aot_eager"), ("llama", "aot_eager"), ("qwen3", "aot_eager"),
                                          ("llama", "inductor")])
@pytest.mark.slow
def test_compiled_model_is_one_graph_with_the_eager_gradients(arch, backend, monkeypatch):
    """No graph break: every SEBP linear, norm and activation is one op in Dynamo's graph, and each linear's
    backward ran the SEBP backward (counted) with its module's settings."""
    model = _patched(arch)
    batch = padded_batch(arch)
    loss_e, g_e = _grads(model, model, batch)
    calls = []
    real = functional.linear_grads
    monkeypatch.setattr(functional, "linear_grads", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    dynamo.reset()
    dynamo.utils.counters.clear()
    try:
        compiled = torch.compile(model, backend=backend)
        for _ in range(2):  # the second call runs the cached graphs
            calls.clear()
            loss_c, g_c = _grads(compiled, model, batch)
            torch.testing.assert_close(loss_c, loss_e, atol=1e-6, rtol=1e-6)
            assert g_c.keys() == g_e.keys() and len(g_e) > 10
            for k in g_e:
                torch.testing.assert_close(g_c[k], g_e[k], atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
            n_linear = sum(isinstance(m, SEBPLinear) for m in model.modules())
            assert len(calls) == n_linear and all(c.mode == "exact" for c in calls)
        assert sum(dynamo.utils.counters["graph_break"].values()) == 0
    finally:
        dynamo.reset()


def test_compiled_layers_read_their_current_settings_and_copies_their_own():
    """The op carries a key, not the config: a config changed after compiling applies at the next backward
    (no recompile needed), and a deep copy's layers have keys of their own."""
    torch.manual_seed(0)
    lin = SEBPLinear(8, 6, config=SEBPConfig("exact"))
    twin = copy.deepcopy(lin)
    assert twin._sebp_key != lin._sebp_key and registry.lookup(twin._sebp_key) is twin
    x = torch.randn(5, 8)
    x[1] *= 1e-4  # a small row: active in exact mode, dropped at threshold 1e-2
    dy = torch.randn(5, 6)
    dy[1] *= 1e-4
    dynamo.reset()
    try:
        fn = torch.compile(lambda m, x: m(x), backend="aot_eager")

        def dw(module):
            module.zero_grad(set_to_none=True)
            fn(module, x).backward(dy)
            return module.weight.grad.clone()

        exact = dw(lin)
        torch.testing.assert_close(exact, dy.t() @ x)
        twin.sebp_config = SEBPConfig("threshold", eps=1e-2)
        keep = torch.tensor([0, 2, 3, 4])
        torch.testing.assert_close(dw(twin), dy[keep].t() @ x[keep])
        torch.testing.assert_close(dw(lin), exact)  # the original kept its own setting
    finally:
        dynamo.reset()


def test_backward_ops_refuse_a_call_autograd_would_record():
    """The backward operators have no derivative: a call autograd would record (create_graph=True) fails in one
    line instead of a warning and wrong second-order gradients."""
    lin = SEBPLinear(8, 6)
    dy, x, w = torch.randn(4, 6, requires_grad=True), torch.randn(4, 8), torch.randn(6, 8)
    with pytest.raises(RuntimeError, match="no derivative of its own"):
        torch.ops.sebp.linear_backward(dy, x, w, True, True, False, lin._sebp_key_t, 0, 0, 0)
    with torch.no_grad():  # as a backward calls it
        dx, dw, _ = torch.ops.sebp.linear_backward(dy, x, w, True, True, False, lin._sebp_key_t, 0, 0, 0)
    torch.testing.assert_close(dx, dy.detach() @ w)


def test_copies_of_row_hints_keep_their_keys_apart_and_as_inputs():
    """A copy of a model whose keys go in as graph inputs (keys_as_inputs) keeps them so, row hints included,
    each with a key of its own."""
    from sebp_kernels.activations import RowHint

    hint = RowHint()
    hint._sebp_key_input = True
    twin = copy.deepcopy(hint)
    assert twin.key != hint.key and twin._sebp_key_input and int(twin._sebp_key_t) == twin.key
    assert not copy.deepcopy(RowHint())._sebp_key_input


def test_a_key_whose_layer_is_gone_fails_with_one_line():
    lin = nn.Linear(4, 4)
    key = registry.register(lin)
    assert registry.lookup(key) is lin and registry.lookup(0) is None
    del lin
    gc.collect()
    with pytest.raises(RuntimeError, match="no longer exists"):
        registry.lookup(key)


def test_ops_fake_shapes_match_the_real_outputs():
    """Each op's fake (shape-only) result has the real result's shapes and dtypes (torch's own checker)."""
    torch.manual_seed(0)
    lin = SEBPLinear(8, 6)
    x, w = torch.randn(2, 3, 8), torch.randn(6, 8)
    dy = torch.randn(2, 3, 6)
    torch.library.opcheck(torch.ops.sebp.linear_backward, (dy, x.reshape(-1, 8), w, True, True, True,
                                                           lin._sebp_key_t, 0, 0, 0), test_utils=("test_faketensor",))
    torch.library.opcheck(torch.ops.sebp.linear_backward, (dy, None, w, True, False, False, None, lin._sebp_key,
                                                           0, 0), test_utils=("test_faketensor",))
    from sebp_kernels.norms import SEBPNorm

    ln = SEBPNorm(nn.LayerNorm(8))
    x2 = x.reshape(-1, 8)
    mean, rstd = x2.mean(-1), x2.var(-1, unbiased=False).add(1e-5).rsqrt()
    for need in ((True, True, True), (True, False, False)):
        torch.library.opcheck(torch.ops.sebp.norm_backward, (dy.new_ones(6, 8), x2, ln.weight.detach(), mean, rstd,
                                                             *need, 8, ln._sebp_key_t, 0),
                              test_utils=("test_faketensor",))
    for kind, b2 in (("gelu", None), ("swiglu", x.flip(-1))):
        torch.library.opcheck(torch.ops.sebp.act, (kind, x, b2, "auto", None, 0), test_utils=("test_faketensor",))


def test_a_hint_is_taken_once_and_copies_start_empty():
    """A gradient's rows are read once (the entry goes then: nothing outlives the backward, as a CUDA-graph
    pool requires); a copied hint has its own key and no entries."""
    from sebp_kernels.activations import RowHint

    hint = RowHint()
    t = torch.zeros(4, 3)
    perm, count = torch.arange(4, dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    hint.offer(t, perm, count)
    twin = copy.deepcopy(hint)
    assert twin.key != hint.key and registry.lookup(twin.key) is twin and twin.take(t) is None
    got = hint.take(t)
    assert got is not None and got[0] is perm and got[1] is count
    assert hint.take(t) is None and (hint.offered, hint.taken) == (1, 1)


@pytest.mark.parametrize("backend,device", [("aot_eager", "cpu"), ("inductor", "cpu"),
                                            pytest.param("inductor", "cuda", marks=pytest.mark.gpu),
                                            pytest.param("reduce-overhead", "cuda", marks=pytest.mark.gpu)])
@pytest.mark.slow
def test_functional_calls_compile_in_one_graph_with_their_settings(backend, device):
    """sebp_linear / sebp_layer_norm / sebp_rms_norm called as functions (no module) compile without a graph
    break too: the op carries the config's own key, so threshold mode drops the small rows as in eager. On a
    GPU the Triton kernels run, also recorded as CUDA graphs by Inductor's reduce-overhead mode."""
    from sebp_kernels import sebp_linear
    from sebp_kernels.norms import sebp_layer_norm, sebp_rms_norm

    torch.manual_seed(0)
    w1, b1, lw, lb, rw, w2 = (torch.randn(*s, device=device, requires_grad=True)
                              for s in ((12, 8), (12,), (12,), (12,), (12,), (5, 12)))
    cfg = SEBPConfig("threshold", eps=1e-2)

    def f(x, last=cfg):
        h = sebp_layer_norm(sebp_linear(x, w1, b1, SEBPConfig("exact")), (12,), lw, lb)
        return sebp_linear(sebp_rms_norm(h, rw), w2, None, last)

    x = torch.randn(2, 7, 8, device=device)
    x[:, 5:] = 0  # padding rows: exactly zero gradients below
    dy = torch.randn(2, 7, 5, device=device)
    dy[:, 5:] = 0
    dy[0, 1] *= 1e-3  # a small row of the last linear's dL/dY: dropped at eps 1e-2, kept in exact mode

    def grads(fn):
        for p in (w1, b1, lw, lb, rw, w2):
            p.grad = None
        fn(x).backward(dy)
        return [p.grad.clone() for p in (w1, b1, lw, lb, rw, w2)]

    want = grads(f)
    exact = grads(lambda x: f(x, SEBPConfig("exact")))
    assert (want[-1] - exact[-1]).abs().max() > 1e-4  # the setting matters here
    dynamo.reset()
    dynamo.utils.counters.clear()
    try:
        ro = backend == "reduce-overhead"
        compiled = torch.compile(f, mode=backend) if ro else torch.compile(f, backend=backend)
        for _ in range(3):  # reduce-overhead: warm-up, recording, replay
            got = grads(compiled)
        assert sum(dynamo.utils.counters["graph_break"].values()) == 0
    finally:
        dynamo.reset()
    tol = 1e-6 if device == "cpu" else 1e-4  # the GPU's kernels sum in another order
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=tol, rtol=tol)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_compiled_forward_is_traced_and_only_the_backward_is_opaque(arch):
    """The linears' and norms' forward is plain torch code in the compiled graph (Inductor can fuse around it);
    only their backward is an sebp:: op. The activations stay one op each way (their forward also flags rows)."""
    import re

    from torch._dynamo.testing import AotEagerAndRecordGraphs

    model = _patched(arch)
    record = AotEagerAndRecordGraphs()
    dynamo.reset()
    try:
        torch.compile(model, backend=record)(**padded_batch(arch)).loss.backward()
    finally:
        dynamo.reset()

    def ops_in(graphs):
        return {o for g in graphs for o in re.findall(r"torch\.ops\.sebp\.(\w+)", g.code)}

    assert ops_in(record.fw_graphs) == {"act"}
    assert ops_in(record.bw_graphs) == {"linear_backward", "norm_backward", "act_backward"}


def test_a_functional_call_with_its_own_state_and_hint_compiles_and_uses_them(monkeypatch):
    """sebp_linear given a RowDensity and a RowHint of the caller's compiles without a graph break too: the op
    carries their keys, and the backward gets those very objects, as in eager runs."""
    from sebp_kernels import sebp_linear
    from sebp_kernels.activations import RowHint
    from sebp_kernels.density import RowDensity

    torch.manual_seed(0)
    state, hint = RowDensity(), RowHint()
    w = torch.randn(5, 8, requires_grad=True)
    x = torch.randn(2, 3, 8)
    x[:, 2:] = 0
    seen = []
    real = functional.linear_grads
    monkeypatch.setattr(functional, "linear_grads", lambda *a, **k: seen.append(a[7:9]) or real(*a, **k))

    def f(x):
        return sebp_linear(x, w, None, SEBPConfig("exact"), state, hint)

    def grad(fn):
        w.grad = None
        fn(x).square().sum().backward()
        return w.grad.clone()

    want = grad(f)
    dynamo.reset()
    dynamo.utils.counters.clear()
    try:
        got = grad(torch.compile(f, backend="aot_eager"))
        assert sum(dynamo.utils.counters["graph_break"].values()) == 0
    finally:
        dynamo.reset()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert len(seen) == 2 and all(s is state and h is hint for s, h in seen)
    twin = copy.deepcopy(state)
    assert twin.key != state.key and registry.lookup(twin.key) is twin


def test_keys_as_inputs_make_inductor_count_cpu_scalars_aligned():
    """A key tensor is a 0-d CPU input: Inductor must not count it unaligned (which taints the outputs of every op
    it goes into); other CPU tensors are left as Inductor decides."""
    from torch._inductor import graph, utils

    lin = SEBPLinear(4, 4)
    assert registry.keys_as_inputs(lin) == 1 and registry.cpu_scalars_aligned()
    assert graph.should_assume_input_aligned(torch.tensor(3))
    assert graph.should_assume_input_aligned(torch.zeros(4)) == utils.should_assume_input_aligned(torch.zeros(4))


@pytest.mark.slow
@pytest.mark.parametrize("hooked", [True, False])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compiled_sebp_ops_outputs_count_as_aligned(hooked, device, monkeypatch):
    """With the keys as inputs, Inductor's code takes an SEBP op's outputs as aligned (the kernels that read dX keep
    their vectorised loads); with Inductor's own rule (the control) the 0-d key made them all unaligned. On the CPU
    Inductor counts every input unaligned, so there the test gives it its GPU rule (tensors aligned, the key not)."""
    import re

    from torch._inductor import graph, utils
    from torch._inductor.utils import run_and_get_code

    if device == "cpu":
        monkeypatch.setattr(graph, "should_assume_input_aligned", lambda t: t.device.type != "cpu" or t.dim() > 0)
    else:
        monkeypatch.setattr(graph, "should_assume_input_aligned", utils.should_assume_input_aligned)
    if hooked:
        assert registry.cpu_scalars_aligned()
    torch.manual_seed(0)
    model = nn.Sequential(SEBPLinear(16, 32), nn.GELU(), SEBPLinear(32, 16)).to(device)
    for m in model.modules():
        m._sebp_key_input = hasattr(m, "_sebp_key_t")  # keys_as_inputs without installing the hook
    x = torch.randn(4, 8, 16, requires_grad=True, device=device)
    dynamo.reset()
    try:  # compiled afresh: a cached graph of the other case would bring that case's code
        with torch._inductor.config.patch(fx_graph_cache=False, fx_graph_remote_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            compiled = torch.compile(model, backend="inductor")
            _, code = run_and_get_code(lambda: compiled(x).sum().backward())
    finally:
        dynamo.reset()
    code = "\n".join(code)
    assert code.count("torch.ops.sebp.linear_backward.default(") == 2
    unaligned = re.findall(r"is assumed to be not aligned", "\n".join(
        line for line in code.splitlines() if "torch.ops.sebp." in line))
    assert (len(unaligned) == 0) if hooked else (len(unaligned) >= 3)
