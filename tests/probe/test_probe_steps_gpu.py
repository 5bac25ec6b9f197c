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
