"""``--probe-every`` under ``--compile``: the probed steps run compiled, the collector's taps in their graphs
(aot_eager standing in for Inductor: the same graphs). The run compiles a probed graph beside each unprobed one,
in its first two steps and no later, without a graph break; its statistics are those of an eager probed run."""
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


def _compiled(tmp_path, monkeypatch, name, method="dense", **kw):
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **k: real(fn, backend="aot_eager",
                                                                          **{x: v for x, v in k.items()
                                                                             if x not in ("options", "backend")}))
    monkeypatch.setattr(compiling, "inductor_problem", lambda device: None)
    dynamo.reset()
    try:
        return _run(tmp_path, name, lambda: tiny_model("bert"), method=method, compile="default", max_steps=6,
                    data=DataConfig(max_length=24, batch_size=8, padding="max_length"), **kw)
    finally:
        dynamo.reset()


def _records(tmp_path, name, kind):
    return [r for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
            if r["type"] == kind]


@pytest.mark.slow
@pytest.mark.parametrize("method, lora", [("dense", False), ("sebp", True)])
def test_probed_steps_compile_once_and_see_every_layer(tmp_path, monkeypatch, method, lora):
    plain = _compiled(tmp_path, monkeypatch, "plain", method, lora=lora)
    probed = _compiled(tmp_path, monkeypatch, "probed", method, lora=lora, probe_every=2)
    assert plain["compile"]["graph_breaks"] == probed["compile"]["graph_breaks"] == 0
    assert probed["compile"]["graphs"] == 2 * plain["compile"]["graphs"] >= 2  # a probed graph beside each
    # step 1 (probed) and step 2 compile; no step after them does
    assert [r.get("untimed") for r in _records(tmp_path, "probed", "train")] == ["compile"] * 2 + [None] * 4
    probes = _records(tmp_path, "probed", "grad_stats")
    assert [r["step"] for r in probes] == [1, 3, 5]
    assert all(e["rows"] > 0 for r in probes for e in r["layers"].values())  # every layer's tap ran
    losses = {name: [r["loss"] for r in _records(tmp_path, name, "train")] for name in ("plain", "probed")}
    assert losses["plain"] == losses["probed"]  # probing changes no step
    _run(tmp_path, "eager", lambda: tiny_model("bert"), method=method, lora=lora, max_steps=6, probe_every=2,
         data=DataConfig(max_length=24, batch_size=8, padding="max_length"))
    for got, want in zip(probes, _records(tmp_path, "eager", "grad_stats"), strict=True):
        assert got["layers"].keys() == want["layers"].keys()
        for name, e in got["layers"].items():
            assert e["rows"] == want["layers"][name]["rows"]
            assert e.get("causes", {}) == pytest.approx(want["layers"][name].get("causes", {}), abs=0.02), name
