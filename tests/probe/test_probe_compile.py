"""``--probe-every`` under ``--compile``: the probed steps run eagerly and their hooks see every layer; the run
compiles the graphs the unprobed run compiles, no more, and no graph break (aot_eager standing in for
Inductor: the same graphs)."""
from __future__ import annotations

import json

import pytest
import torch
import torch._dynamo as dynamo

from sebp_probe.config import DataConfig
from sebp_probe.train import compiling
from tests.convergence.finetune_helpers import isolated_accelerate  # noqa: F401
from tests.probe.test_finetune_compile import _run
from tests.tiny_models import tiny_model


def _compiled(tmp_path, monkeypatch, name, **kw):
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **k: real(fn, backend="aot_eager",
                                                                          **{x: v for x, v in k.items()
                                                                             if x not in ("options", "backend")}))
    monkeypatch.setattr(compiling, "inductor_problem", lambda device: None)
    dynamo.reset()
    try:
        return _run(tmp_path, name, lambda: tiny_model("bert"), method="dense", compile="default", max_steps=6,
                    data=DataConfig(max_length=24, batch_size=8, padding="max_length"), **kw)
    finally:
        dynamo.reset()


@pytest.mark.slow
def test_probed_steps_add_no_graph_and_no_break(tmp_path, monkeypatch):
    plain = _compiled(tmp_path, monkeypatch, "plain")
    probed = _compiled(tmp_path, monkeypatch, "probed", probe_every=2)
    assert plain["compile"]["graph_breaks"] == probed["compile"]["graph_breaks"] == 0
    assert probed["compile"]["graphs"] == plain["compile"]["graphs"] >= 1
    records = [json.loads(x) for x in (tmp_path / "probed" / "metrics.jsonl").read_text().splitlines()]
    probes = [r for r in records if r["type"] == "grad_stats"]
    assert [r["step"] for r in probes] == [1, 3, 5]
    assert all(e["rows"] > 0 for r in probes for e in r["layers"].values())  # every layer's hook ran
    losses = {name: [r["loss"] for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
                     if r["type"] == "train"] for name in ("plain", "probed")}
    assert losses["plain"] == losses["probed"]  # probing changes no step
