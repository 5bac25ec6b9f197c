"""``analyze --reuse``: what gradient reuse would drop per layer, with P from the previous batch."""
from __future__ import annotations

import pytest
import torch

from sebp_probe.analysis.analyze import AnalysisError, AnalyzeSettings, collect, reuse_report, reuse_type_rows
from sebp_probe.model.resprop import ReuseDropCollector
from tests.tiny_models import tiny_model


def _batch(ids: list[list[int]]) -> dict:
    ids = torch.tensor(ids)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0] * len(ids))}


def _reuse(model, batches) -> dict:
    settings = AnalyzeSettings(max_batches=len(batches), tile=8, train_mode=False)
    with ReuseDropCollector(model) as col:
        collect(model, batches, settings)
    return reuse_report(col)


def test_a_repeated_batch_of_one_sample_leaves_nothing_to_correct():
    # P is one sample's dL/dY broadcast: with every sample equal and the batch repeated (no dropout, no update)
    # dY - P is zero, so reuse drops nothing at any level; top-k of dY itself still drops something.
    model = tiny_model("bert")
    batch = _batch([[2, 5, 6, 7, 8, 9]] * 3)
    report = _reuse(model, [batch, batch])
    assert report["p_from"] == "previous batch" and report["levels"][0] == 0.5
    assert report["layers"]
    for name, e in report["layers"].items():
        assert e["steps"] == 1, name
        assert e["residual"] < 1e-5, name
        assert max(e["dropped"].values()) < 1e-5, name
        assert e["topk_dropped"]["0.9"] > 0.01, name


def test_a_peft_layer_is_watched_at_its_wrapper():
    """Under LoRA the first layer's frozen projections get no dL/dY at their base layer; watched at the peft
    wrapper (base + adapter), every target compares its steps, as on the plain model (LoRA's B starts at zero)."""
    import copy

    peft = pytest.importorskip("peft")
    model = tiny_model("bert")
    plain = copy.deepcopy(model)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["query", "value"]))
    batches = [_batch([[2, 5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 2]]), _batch([[9, 8, 7, 6, 5, 4], [2, 3, 2, 3, 2, 3]])]
    got, want = _reuse(lora, batches), _reuse(plain, batches)
    got = {k.removeprefix("base_model.model."): e for k, e in got["layers"].items()}
    assert set(got) == set(want["layers"]) and len(got) == 12  # the default targets, peft's and plain
    for name in ("bert.encoder.layer.0.attention.self.query", "bert.encoder.layer.0.attention.self.value"):
        assert got[name]["steps"] == want["layers"][name]["steps"] == 1, name
        assert got[name]["residual"] == pytest.approx(want["layers"][name]["residual"], rel=1e-4), name


def test_different_batches_leave_a_residual_and_types_average_their_layers():
    model = tiny_model("bert")
    report = _reuse(model, [_batch([[2, 5, 6, 7, 8, 9], [2, 9, 8, 7, 6, 5]]),
                            _batch([[2, 11, 12, 13, 14, 15], [2, 15, 3, 4, 12, 10]])])
    for name, e in report["layers"].items():
        assert e["residual"] > 1e-3, name
        levels = [e["dropped"][str(r)] for r in report["levels"]]
        assert levels == sorted(levels), name  # more reuse, more dropped
    rows = reuse_type_rows(report)
    query = next(r for r in rows if r["type"] == "attention.self.query")
    names = [n for n in report["layers"] if n.endswith("attention.self.query")]
    assert query["layers"] == len(names) >= 2
    assert query["residual"] == pytest.approx(sum(report["layers"][n]["residual"] for n in names) / len(names))


def test_one_batch_is_one_line_error():
    model = tiny_model("bert")
    with pytest.raises(AnalysisError, match="at least 2 batches"):
        _reuse(model, [_batch([[2, 5, 6, 7]])])
