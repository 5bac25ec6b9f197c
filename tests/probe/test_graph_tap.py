"""A compiled run's probe (:mod:`sebp_probe.analysis.graph_tap`): the collector's taps inside Dynamo's graphs
(aot_eager standing in for Inductor) give the statistics of its hooks; a probed graph beside the unprobed one,
no recompile after them, no graph break; nothing runs on an unprobed step; the model gets its classes back."""
from __future__ import annotations

import copy

import pytest
import torch._dynamo as dynamo

from sebp_probe.analysis.causes import grouper
from sebp_probe.analysis.hooks import GradientStatsCollector
from sebp_probe.train.compiling import compile_layers, dynamo_counts
from tests.helpers import assert_same_stats
from tests.tiny_models import padded_batch, tiny_model

LENGTHS = (11, 4, 7, 9, 2)


def _probe_then_plain(model, batches, col):
    """Per batch a probed step, then an unprobed one; (stats, graphs compiled after the first batch's two
    steps, graph calls of the unprobed steps)."""
    groups, calls, graphs = grouper(model, None), [0], None
    real = col.graph_grad

    def counting(*a):
        calls[0] += 1
        return real(*a)

    col.graph_grad = counting
    for i, b in enumerate(batches):
        model.zero_grad(set_to_none=True)
        with col, col.batch(b["attention_mask"], groups(b)):
            model(**b).loss.backward()
        probed_calls = calls[0]
        model.zero_grad(set_to_none=True)
        model(**b).loss.backward()
        assert calls[0] == probed_calls  # the unprobed step: no tap
        if i == 0:
            graphs = dynamo_counts()[0]
    return col.stats(), dynamo_counts()[0] - graphs, probed_calls


@pytest.fixture
def fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


def test_taps_in_compiled_layers_give_the_hooks_statistics(fresh_dynamo):
    """(A BERT compiled with taps: tests/probe/test_probe_compile.py, through finetune.)"""
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
    undo = compile_layers(model, backend="aot_eager", dynamic=True)
    try:
        stats, recompiles, calls = _probe_then_plain(model, batches, col)
    finally:
        undo()
        col.close()
    assert_same_stats(stats, hooks.stats())
    assert recompiles == 0 and calls > 0
    assert dict(dynamo.utils.counters["graph_break"]) == {}


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


def test_inductor_keeps_the_tap_out_of_its_cuda_graphs():
    """A CUDA-graph replay runs no Python: recorded, the tap would count no rows and read a freed window's row
    groups. Inductor's own test of a graph node says the tap's operator must not be recorded (Inductor then
    cuts the graph around it under ``reduce-overhead``)."""
    import torch
    from torch._inductor import utils

    from sebp_probe.analysis.graph_tap import probe_stats_

    unsafe = getattr(utils, "is_cudagraph_unsafe_fx_node", None)
    if unsafe is None or not hasattr(torch.Tag, "cudagraph_unsafe"):
        pytest.skip("this torch has no cudagraph_unsafe tag")
    graph = torch.fx.Graph()
    node = graph.call_function(probe_stats_, tuple(graph.placeholder(n) for n in ("grad", "buf", "key")))
    assert unsafe(node)
