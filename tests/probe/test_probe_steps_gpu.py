"""``finetune --probe-every`` on a CUDA GPU: a probed step never waits for the device (hooks on and off, the
micro-batches' statistics added up on the device, the copy to the host queued), and its record equals the one
made from the same micro-batches recorded batch by batch (``analyze``'s way)."""
from __future__ import annotations

import types

import pytest
import torch

from sebp_probe.analysis.causes import grouper
from sebp_probe.analysis.hooks import GradientStatsCollector
from sebp_probe.analysis.through_training import step_counts, step_record
from sebp_probe.train.probe_steps import StepProbe
from tests.tiny_models import padded_batch, tiny_model

pytestmark = pytest.mark.gpu


def _probed_step(model, probe, batches, loss_of):
    with probe.step(1) as around:
        for b in batches:
            with around(b):
                loss_of(b).backward()


def _model_loss(model):
    """The model's own forward, with sync checks off: transformers' mask handling may read the mask back (not
    the probe's doing); the probe's forward hooks run inside it and are checked by the next test."""
    def loss_of(b):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return model(**b).loss
        finally:
            torch.cuda.set_sync_debug_mode("error")
    return loss_of


@pytest.mark.parametrize("arch, side", [("bert", "right"), ("llama", "left")])
def test_a_probed_step_never_syncs_and_records_what_batch_by_batch_records(arch, side):
    model = tiny_model(arch).cuda()
    task = "classification" if arch == "bert" else "causal-lm"
    batches = [{k: v.cuda() for k, v in padded_batch(arch, (11, 4, 7, 9), side=side, seed=s).items()} for s in (1, 2)]
    probe = StepProbe(1, model, task, False, None)
    _probed_step(model, probe, batches, lambda b: model(**b).loss)  # warm-up: kernel compiled, memory pinned
    probe.take(1)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync in the probed step raises
    try:
        _probed_step(model, probe, batches, _model_loss(model))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    got = probe.take(1)

    model.zero_grad(set_to_none=True)
    groups = grouper(model, task)
    with GradientStatsCollector(model) as col:
        for b in batches:
            with col.batch(b.get("attention_mask"), groups(b)):
                model(**b).loss.backward()
    assert got == step_record(step_counts(col.stats()), 1)
    assert sum(e["rows"] for e in got["layers"].values()) > 0


class _Stack(torch.nn.Module):
    """Linears one after the other, named as a Llama's projections (the probe's default targets): a forward
    without any host sync of its own."""

    def __init__(self, width=256, depth=4):
        super().__init__()
        self.config = types.SimpleNamespace(model_type="llama", pad_token_id=None)
        self.layers = torch.nn.ModuleList(torch.nn.ModuleDict({"o_proj": torch.nn.Linear(width, width)})
                                          for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer["o_proj"](x))
        return x.square().mean()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forward_hooks_and_backward_of_a_probed_step_never_sync(dtype):
    model = _Stack().to("cuda", dtype)
    probe = StepProbe(1, model, None, False, None)
    rows = 8 * 64
    group_of = torch.randint(0, 3, (rows,), dtype=torch.int8, device="cuda")
    probe.groups = lambda b: group_of  # one group per row of dL/dY
    xs = [torch.randn(8, 64, 256, device="cuda", dtype=dtype) for _ in range(3)]
    for sync_mode in (0, "error"):  # a warm-up, then the checked step
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(sync_mode)
        try:
            _probed_step(model, probe, xs, model)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        rec = probe.take(1)
    assert [e["rows"] for e in rec["layers"].values()] == [3 * rows] * 4


@pytest.mark.parametrize("arch, side", [("bert", "right"), ("llama", "left")])
def test_a_compiled_probed_step_counts_in_its_graph_without_a_sync(arch, side):
    """Inductor and the Triton kernel: a compiled run's probed step (the collector's taps in the graphs of
    layers compiled one by one) counts every row the hooks count on the same weights and batches, its
    histograms within the numerics of compiled code, with no host sync and no recompile once both graphs
    exist."""
    import copy

    import numpy as np
    import torch._dynamo as dynamo

    from sebp_probe.analysis.through_training import totals_counts
    from sebp_probe.train.compiling import compile_layers, dynamo_counts

    model = tiny_model(arch).cuda().train()
    ref = copy.deepcopy(model)
    task = "classification" if arch == "bert" else "causal-lm"
    batches = [{k: v.cuda() for k, v in padded_batch(arch, (11, 4, 7, 9)[: 4 - s], side=side, seed=s).items()}
               for s in range(3)]
    dynamo.reset()
    probe = StepProbe(1, model, task, True, None)
    undo = compile_layers(model, dynamic=True)
    try:
        for b in batches[:1]:  # the graphs: probed, then unprobed
            _probed_step(model, probe, [b], lambda b: model(**b).loss)
            probe.take(1)
            model(**b).loss.backward()
        graphs = dynamo_counts()[0]
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with probe.step(1) as around:
                for b in batches:
                    with around(b):
                        _model_loss(model)(b).backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        got = probe._counts
        assert dynamo_counts()[0] == graphs
    finally:
        undo()
        probe.close()
        dynamo.reset()
    groups = grouper(ref, task)
    with GradientStatsCollector(ref) as col:
        for b in batches:
            with col.accumulate(groups(b)):
                ref(**b).loss.backward()
        want = totals_counts(col.names, col.snapshot().wait())
    assert got.names == want.names and got.rows.sum() > 0
    assert np.array_equal(got.rows, want.rows) and np.array_equal(got.nonfinite, want.nonfinite)
    assert np.array_equal(got.fine[:, 0], want.fine[:, 0])  # the zero rows
    # the compiled gradients differ from the eager ones in their last bits: a row may change bucket
    assert np.abs(got.fine - want.fine).sum() <= 0.02 * 2 * want.rows.sum()
    assert np.abs(got.groups - want.groups).sum() <= 0.02 * 2 * want.rows.sum()
    assert got.groups.sum() > 0
