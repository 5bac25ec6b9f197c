"""A compiled run's probe (:mod:`sebp_probe.analysis.graph_tap`): the collector's taps inside Dynamo's graphs
(aot_eager standing in for Inductor) give the statistics of its hooks; a probed graph beside the unprobed one,
no recompile after them, no graph break; nothing runs on an unprobed step; the model gets its classes back."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch._dynamo as dynamo

from sebp_probe.analysis.causes import grouper
from sebp_probe.analysis.grad_records import _WIDTH
from sebp_probe.analysis.grad_reduce import ELEMENT_SAMPLE, add_stats_, reduce_calls, summarize_grad
from sebp_probe.analysis.knee import N_FINE
from sebp_probe.analysis.hooks import GradientStatsCollector
from sebp_probe.train.compiling import compile_layers, dynamo_counts
from tests.helpers import assert_same_stats
from tests.tiny_models import padded_batch, tiny_model

LENGTHS = (11, 4, 7, 9, 2)


def _probe_then_plain(model, batches, col):
    """Per batch a probed step, then an unprobed one; (stats, graphs compiled after the first batch's two
    steps)."""
    groups, graphs = grouper(model, None), None
    for i, b in enumerate(batches):
        model.zero_grad(set_to_none=True)
        with col, col.batch(b["attention_mask"], groups(b)):
            model(**b).loss.backward()
        model.zero_grad(set_to_none=True)
        model(**b).loss.backward()
        assert all(not inputs.flat.any() for inputs in col._taps.inputs.values())  # the unprobed step: no tap
        if i == 0:
            graphs = dynamo_counts()[0]
    return col.stats(), dynamo_counts()[0] - graphs


@pytest.fixture
def fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_taps_in_compiled_layers_give_the_hooks_statistics(fresh_dynamo, backend):
    """Bit for bit under aot_eager; under Inductor, whose gradients differ from eager ones in the last bits, the
    rows exactly and the rows' distribution over the fine buckets within 5% (a BERT compiled with taps: tests/probe/test_probe_compile.py,
    through finetune; the ops themselves under Inductor: test_tap_ops_give_the_reductions_numbers)."""
    arch, side = "llama", "left"
    model = tiny_model(arch).train()
    batches = [padded_batch(arch, LENGTHS[: 5 - s], side=side, seed=s) for s in range(3)]  # three shapes
    ref = copy.deepcopy(model)
    with GradientStatsCollector(ref) as hooks:
        groups = grouper(ref, None)
        for b in batches:
            ref.zero_grad(set_to_none=True)
            with hooks.batch(b["attention_mask"], groups(b)):
                ref(**b).loss.backward()
    col = GradientStatsCollector(model, graph=True)
    undo = compile_layers(model, backend=backend, dynamic=True)
    try:
        stats, recompiles = _probe_then_plain(model, batches, col)
    finally:
        undo()
        col.close()
    if backend == "aot_eager":
        assert_same_stats(stats, hooks.stats())
    else:
        for name, want in hooks.stats().layers.items():
            got = stats.layers[name]
            assert got.rows == want.rows and got.elements == want.elements
            gap = np.abs(np.cumsum(got.row_hist) - np.cumsum(want.row_hist)).max()
            assert gap <= 0.05 * sum(want.rows), name
    assert recompiles == 0
    assert dict(dynamo.utils.counters["graph_break"]) == {}


def _odd_grads(dtype):
    """Gradients with zero rows, zeros, infinities and NaNs; one wide enough to be sampled."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for rows, cols in ((7, 5), (40, 24), (3 * ELEMENT_SAMPLE // 64 + 5, 64)):
        g = torch.randn(rows, cols, generator=gen) * torch.logspace(-30, 30, rows)[:, None]
        g[::3] = 0
        g[1, 2], g[2, 0], g[4, 1], g[5, 4] = float("inf"), float("nan"), -float("inf"), -0.0
        out.append(g.to(dtype))
    return out


@pytest.mark.parametrize("backend", [None, "aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tap_ops_give_the_reductions_numbers(fresh_dynamo, backend, dtype):
    """What a compiled tap adds to its slot, eager or compiled (dynamic shapes), equals the torch reductions
    of the hook path, the element sample and the row groups included, plus the rows and elements it counts."""
    grads, n_layers = _odd_grads(dtype), 3
    flat = torch.zeros(n_layers * (_WIDTH + N_FINE), dtype=torch.int64)
    groups = torch.zeros(4096, dtype=torch.int8)
    n_tokens = torch.full((), -1, dtype=torch.int64)
    add = add_stats_ if backend is None else torch.compile(add_stats_, backend=backend, dynamic=True)
    want_stats, want_hist = torch.zeros(n_layers, _WIDTH, dtype=torch.int64), torch.zeros(n_layers, N_FINE,
                                                                                          dtype=torch.int64)
    for slot, g in enumerate(grads):
        grouped = slot == 1  # the second gradient's rows are tokens with groups
        win = torch.randint(0, 3, (g.shape[0],), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
        if grouped:
            groups[: g.shape[0]] = win
        n_tokens.fill_(g.shape[0] if grouped else g.shape[0] + 1)  # the others: a window of other rows
        for _ in range(2):  # twice into the same slot: sums, and the max of the largest
            add(g, flat, torch.tensor(slot), groups, n_tokens, n_layers)
            batch, hist = reduce_calls([summarize_grad(g, win if grouped else None)], [slot], n_layers)
            batch[slot, -2:] = torch.tensor([g.shape[0], g.numel()])
            want_stats = _added(want_stats, batch)
            want_hist += hist
    got_stats = flat[: n_layers * _WIDTH].view(n_layers, _WIDTH)
    assert torch.equal(got_stats, want_stats) and torch.equal(flat[n_layers * _WIDTH:].view(n_layers, N_FINE),
                                                              want_hist)


def test_tap_ops_make_no_tensor_from_host_data(fresh_dynamo):
    """A tensor built from Python values inside the compiled backward is a constant on the host: on a GPU it is
    copied to the device at every call, and that copy from pageable memory waits for the device, once per layer
    (it made a probed step 2.5x an unprobed one). The graph of the tap's ops holds no such constant."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []
    backend = aot_autograd(fw_compiler=lambda gm, _: graphs.append(gm) or gm)
    n_layers = 2
    flat = torch.zeros(n_layers * (_WIDTH + N_FINE), dtype=torch.int64)
    groups, n_tokens = torch.zeros(64, dtype=torch.int8), torch.full((), 30, dtype=torch.int64)
    torch.compile(add_stats_, backend=backend, dynamic=True)(torch.randn(30, 16), flat, torch.tensor(1), groups,
                                                              n_tokens, n_layers)
    assert graphs and flat.any()
    consts = [n for g in graphs for n in g.graph.nodes if n.op == "get_attr" or "lift_fresh" in str(n.target)]
    assert consts == []


@pytest.mark.slow
def test_inductor_compiles_the_tap_ops_without_an_aten_fallback(fresh_dynamo):
    """Inductor has no int64 atomic add: an int64 scatter with repeats (a histogram) becomes a call of aten's
    index_put_, on a GPU a sort and several launches per call. The taps' code calls no aten operator."""
    import re

    from torch._inductor.utils import run_and_get_code

    n_layers = 2
    flat = torch.zeros(n_layers * (_WIDTH + N_FINE), dtype=torch.int64)
    groups, n_tokens = torch.zeros(64, dtype=torch.int8), torch.full((), 30, dtype=torch.int64)
    _, codes = run_and_get_code(torch.compile(add_stats_, dynamic=True), torch.randn(30, 16), flat,
                                torch.tensor(1), groups, n_tokens, n_layers)
    assert codes and flat.any()
    assert [line for c in codes for line in c.splitlines() if re.search(r"\baten\.\w+\(", line)] == []


def _added(acc, batch):
    """Window statistics summed, the largest bits taken as a max."""
    from sebp_probe.analysis.grad_records import _MAX_BITS

    out = acc + batch
    out[:, _MAX_BITS] = torch.maximum(acc[:, _MAX_BITS], batch[:, _MAX_BITS])
    return out


def test_taps_outside_a_graph_call_the_hook_path():
    """A tapped layer that runs eagerly (no compile, or a layer a run leaves eager) goes through the hooks."""
    model = tiny_model("bert").train()
    batches = [padded_batch("bert", LENGTHS, seed=s) for s in range(2)]
    ref = copy.deepcopy(model)
    with GradientStatsCollector(ref) as hooks:
        for b in batches:
            with hooks.batch(b["attention_mask"]):
                ref(**b).loss.backward()
    col = GradientStatsCollector(model, graph=True)
    for b in batches:
        with col, col.batch(b["attention_mask"]):
            model(**b).loss.backward()
    col.close()
    assert_same_stats(col.stats(), hooks.stats())


def test_close_gives_the_model_back():
    model = tiny_model("llama")
    classes = {n: type(m) for n, m in model.named_modules()}
    keys = set(model.state_dict())
    col = GradientStatsCollector(model, graph=True)
    tapped = [n for n, m in model.named_modules() if type(m) is not classes[n]]
    assert len(tapped) == len(col.names) > 0
    assert all(isinstance(model.get_submodule(n), classes[n]) for n in tapped)  # a subclass of its own
    assert set(model.state_dict()) == keys  # nothing saved with the model
    with col:
        assert col._taps.state.on
    assert not col._taps.state.on
    col.close()
    assert {n: type(m) for n, m in model.named_modules()} == classes
    assert not any(a.startswith("_sebp_probe") for m in model.modules() for a in vars(m))


def test_tapped_linears_are_still_targets():
    """While tapped, a model's linears are found as before (a second collector, a patch during the run)."""
    from sebp_probe.model.patch import find_targets

    model = tiny_model("bert")
    before = find_targets(model)
    col = GradientStatsCollector(model, graph=True)
    assert find_targets(model) == before == list(col._modules)
    col.close()


def test_the_buffer_the_taps_write_keeps_its_address_for_cuda_graphs():
    """A CUDA graph that records the taps (``reduce-overhead``) writes the buffer where it was at recording:
    marked as a static address, it is not copied into the graph's own memory, and it never moves."""
    model = tiny_model("llama")
    col = GradientStatsCollector(model, graph=True)
    (inputs,) = col._taps.inputs.values()
    flat = inputs.flat
    assert getattr(flat, "_dynamo_static_input_type", None) is not None
    for _ in range(2):
        b = padded_batch("llama", LENGTHS)
        with col, col.batch(b["attention_mask"]):
            model(**b).loss.backward()
    assert inputs.flat is flat and col.stats().batches == 2
    col.close()
