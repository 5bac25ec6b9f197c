"""The collector reads most gradients through ``retain_grad`` (no Python call in the backward): the same
statistics as a hook on every output, a budget that splits the two, in-place changes caught, nothing kept."""
from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from sebp_probe.analysis.causes import grouper
from sebp_probe.analysis.hooks import GradientStatsCollector
from tests.helpers import assert_same_stats
from tests.tiny_models import padded_batch, tiny_model

LENGTHS = (11, 4, 7, 9, 2)


def _collect(model, batches, **kw):
    """(stats, Python tensor hooks registered inside the blocks) of the collector over ``batches``."""
    groups = grouper(model, None)
    registered = []
    real = torch.Tensor.register_hook

    def counting(self, hook):
        registered.append(hook)
        return real(self, hook)

    with GradientStatsCollector(model, **kw) as col, pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "register_hook", counting)
        for b in batches:
            model.zero_grad(set_to_none=True)
            with col.batch(b["attention_mask"], groups(b)):
                model(**b).loss.backward()
    return col.stats(), len(registered), len(col.names)


@pytest.mark.parametrize("arch, side", [("bert", "right"), ("llama", "left")])
def test_retained_gradients_give_the_hooks_statistics(arch, side):
    model = tiny_model(arch)
    batches = [padded_batch(arch, LENGTHS, side=side, seed=s) for s in range(2)]
    hooked, n_hooks, n = _collect(model, batches, retain_bytes=0)
    assert n_hooks == 2 * n  # every output of both batches
    retained, n_none, _ = _collect(model, batches)
    assert n_none == 0  # a small model: no Python call in the backward
    assert_same_stats(retained, hooked)
    hidden = 2 * 4 * len(LENGTHS) * max(LENGTHS) * 32  # bytes of a 32-wide fp32 output, counted twice
    mixed, n_mixed, _ = _collect(model, batches, retain_bytes=3 * hidden)
    assert 0 < n_mixed < 2 * n  # the budget retains some outputs per batch, hooks the rest
    assert_same_stats(mixed, hooked)


class _InPlace(torch.nn.Module):
    """Two linears; the first one's output is scaled in place after the layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.a(x)
        y.mul_(3.0)  # dL/dY of layer a is 3x the gradient of the changed tensor
        return (self.b(y) ** 2).sum()


def _batches(model, collector, n=2):
    for s in range(n):
        model.zero_grad(set_to_none=True)
        with collector.batch():
            model(torch.randn(5, 8, generator=torch.Generator().manual_seed(s))).backward()


def test_an_output_changed_in_place_is_left_out_once_then_hooked():
    model = _InPlace()
    with GradientStatsCollector(model, target_modules="all-linear", retain_bytes=0) as want:
        _batches(model, want)
    with GradientStatsCollector(model, target_modules="all-linear") as got:
        with pytest.warns(RuntimeWarning, match="changed in place"):
            _batches(model, got)
    w, g = want.stats().layers, got.stats().layers
    assert list(g["a"].rows) == [0, 5]  # the first batch leaves layer a out, the second hooks it
    np.testing.assert_array_equal(g["a"].row_octaves[1], w["a"].row_octaves[1])
    assert g["a"].max_abs[1] == w["a"].max_abs[1]
    assert g["b"].rows == w["b"].rows and g["b"].max_abs == w["b"].max_abs  # b is retained, unchanged


def test_retained_outputs_are_let_go_after_the_block():
    model = tiny_model("bert")
    batch = padded_batch("bert", LENGTHS)
    outputs = []
    handles = [m.register_forward_hook(lambda m, a, o: outputs.append(weakref.ref(o)))
               for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with GradientStatsCollector(model) as col:
        with col.batch(batch["attention_mask"]):
            model(**batch).loss.backward()
        assert not col._retained
    for h in handles:
        h.remove()
    gc.collect()
    assert outputs and all(ref() is None for ref in outputs)


def test_a_peft_layer_is_read_at_its_wrapper():
    """Under LoRA the collector reads a projection's dL/dY at the peft wrapper's output (base + adapter), so the
    first layer's frozen projections, whose base output gets no gradient, count too: at LoRA's start (its B is
    zero) every target's statistics are the plain model's."""
    import copy
    import dataclasses

    peft = pytest.importorskip("peft")
    model = tiny_model("bert")
    plain = copy.deepcopy(model)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["query", "value"]))
    batches = [padded_batch("bert", LENGTHS, seed=s) for s in range(2)]
    got, _, _ = _collect(lora, batches, target_modules=["query", "value"])  # (a frozen key of layer 0: no dL/dY)
    want, _, _ = _collect(plain, batches, target_modules=["query", "value"])
    got = dataclasses.replace(got, layers={k.removeprefix("base_model.model."): v for k, v in got.layers.items()})
    assert len(want.layers) == 4 and all(sum(e.rows) > 0 for e in got.layers.values())
    assert_same_stats(got, want)
