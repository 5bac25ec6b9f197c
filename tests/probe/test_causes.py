"""Rows of dL/dY split by cause on hand-built batches whose padding and label-less rows are known, the
FLOP-weighted totals, and the padding-layout advice."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sebp_probe.analysis.analyze import AnalyzeSettings, collect, summarize
from sebp_probe.data.batching import padding_share
from sebp_probe.analysis.causes import (
    CAUSES,
    LABEL_LESS,
    PADDING,
    cause_totals,
    classifier_pooling,
    grouper,
    layout_advice,
    packed_issue,
    row_groups,
)
from tests.tiny_models import tiny_config, tiny_model

P, L = PADDING, LABEL_LESS
# Per position-wise linear of a decoder layer: a row of it reaches only its own position's output.
POSITION_WISE = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _causal_batch(side: str) -> tuple[dict, torch.Tensor]:
    """Two samples, 5 and 3 tokens, whose first 2 and 1 tokens are a prompt (labels -100), and the row groups
    worked out by hand: position t reads the label of t + 1."""
    ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    # sample 0: t=1..3 predict the response tokens 2..4; t=0 predicts a prompt token, t=4 nothing
    # sample 1: t=0, 1 predict its tokens 1, 2; t=2 (its last) predicts nothing
    labels = torch.tensor([[-100, -100, 7, 8, 9], [-100, 11, 12, -100, -100]])
    groups = torch.tensor([[L, 0, 0, 0, L], [0, 0, L, P, P]])
    if side == "left":
        ids[1] = torch.tensor([0, 0, 10, 11, 12])
        mask[1] = torch.tensor([0, 0, 1, 1, 1])
        labels[1] = torch.tensor([-100, -100, -100, 11, 12])
        groups[1] = torch.tensor([P, P, 0, 0, L])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}, groups.reshape(-1).to(torch.int8)


def _fractions(report_layers: dict, name: str) -> dict:
    return report_layers[name]["stats"]["rows_by_cause"]


@pytest.mark.parametrize("side", ["right", "left"])
def test_causal_lm_with_prompt_masked_labels(side):
    batch, want = _causal_batch(side)
    assert torch.equal(row_groups(batch, "causal-lm"), want)
    model = tiny_model("llama")
    settings = AnalyzeSettings(max_batches=1, tile=8)
    layers = summarize(collect(model, [batch], settings, task="causal-lm"), settings)["layers"]
    rows = want.numel()
    n_pad, n_ll = int((want == P).sum()), int((want == L).sum())
    for name, e in layers.items():
        f, s = e["stats"]["rows_by_cause"], e["stats"]
        assert f["padding"] == n_pad / rows and s["padding_not_zero"] == 0, name
        assert s["label_less_positions"] == n_ll / rows
        assert sum(f.values()) == pytest.approx(1.0)
    for t in POSITION_WISE:  # the last layer: every label-less row is exactly zero
        assert _fractions(layers, f"model.layers.1.{t}")["label_less"] == n_ll / rows, t
    # earlier, a prompt token's row is read by the later tokens' attention: only the rows of each sample's
    # last token (nothing attends to it) stay zero
    for t in ("mlp.down_proj", "mlp.up_proj", "self_attn.v_proj"):
        assert _fractions(layers, f"model.layers.0.{t}")["label_less"] == 2 / rows, t
    assert _fractions(layers, "model.layers.1.self_attn.v_proj")["label_less"] == 2 / rows  # keys/values: same


def test_bert_classifier_last_layer_reads_only_cls():
    ids = torch.tensor([[2, 5, 6, 7], [2, 8, 0, 0]])
    batch = {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": torch.tensor([0, 2])}
    want = torch.tensor([0, L, L, L, 0, L, P, P], dtype=torch.int8)
    model = tiny_model("bert")
    assert classifier_pooling(model) == "first"
    assert torch.equal(grouper(model, None)(batch), want)  # the task from the labels: one per sequence
    settings = AnalyzeSettings(max_batches=1, tile=8)
    summary = summarize(collect(model, [batch], settings), settings)
    layers = summary["layers"]
    for t in ("attention.self.query", "attention.output.dense", "intermediate.dense", "output.dense"):
        f = _fractions(layers, f"bert.encoder.layer.1.{t}")
        assert f["label_less"] == 4 / 8 and f["padding"] == 2 / 8 and f["active"] == 2 / 8, t
    for t in ("attention.self.key", "attention.self.value"):  # the CLS query reads every token's key and value
        f = _fractions(layers, f"bert.encoder.layer.1.{t}")
        assert f["label_less"] == 0 and f["padding"] == 2 / 8, t
    # FLOP-weighted totals: what is not active is what the threshold setting skips (no pad row is active)
    share = summary["totals"]["share_by_cause"]
    assert sum(share.values()) == pytest.approx(1.0)
    assert 1 - share["active"] == pytest.approx(summary["totals"]["saving_threshold"])


def test_decoder_classifier_reads_the_last_real_token():
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    cfg = tiny_config("llama")
    cfg.num_labels = 3
    model = AutoModelForSequenceClassification.from_config(cfg)
    assert classifier_pooling(model) == "last"
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])  # pad id 0, right padding
    batch = {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": torch.tensor([1, 2])}
    want = torch.tensor([L, L, L, 0, L, 0, P, P], dtype=torch.int8)
    assert torch.equal(grouper(model, "classification")(batch), want)
    settings = AnalyzeSettings(max_batches=1, tile=8)
    layers = summarize(collect(model, [batch], settings, task="classification"), settings)["layers"]
    for t in POSITION_WISE:  # transformers' pooled row is the one that stays active
        f = _fractions(layers, f"model.layers.1.{t}")
        assert f["label_less"] == 4 / 8 and f["active"] == 2 / 8, t


def test_masked_lm_label_less_are_the_unmasked_tokens():
    batch = {"input_ids": torch.tensor([[2, 5, 6, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 0]]),
             "labels": torch.tensor([[-100, 5, -100, -100]])}
    assert row_groups(batch, "mlm").tolist() == [L, 0, L, P]
    assert row_groups(batch, None).tolist() == [0, 0, 0, P]  # no task: padding only
    assert row_groups({"labels": torch.tensor([1])}, "classification") is None


def _layer(flops: dict) -> dict:
    return {"stats": {"backward_flops_by_cause": {c: float(flops.get(c, 0.0)) for c in CAUSES}}}


def _summary(layers: dict) -> dict:
    return {"layers": layers, "totals": cause_totals(layers)}


def test_flop_weighted_totals_by_hand():
    layers = {"model.layers.0.mlp.up_proj": _layer({"padding": 40, "active": 60}),
              "model.layers.1.mlp.up_proj": _layer({"padding": 40, "label_less": 50, "active": 10}),
              "model.layers.1.mlp.down_proj": _layer({"padding": 200, "near_zero": 100, "other_zero": 100,
                                                      "active": 400})}
    t = cause_totals(layers)
    assert t["backward_flops_by_cause"] == {"padding": 280, "label_less": 50, "other_zero": 100, "near_zero": 100,
                                            "active": 470}
    assert t["share_by_cause"] == pytest.approx({"padding": 0.28, "label_less": 0.05, "other_zero": 0.1,
                                                 "near_zero": 0.1, "active": 0.47})


# lengths where padding dominates: mostly short sequences and a few long ones
LENGTHS = np.array([4, 6, 5, 60, 3, 7, 5, 4, 62, 6, 5, 4, 8, 3, 5, 6] * 4)


def test_advice_picks_packed_and_stacks_sebp_on_label_less_rows():
    layers = {"model.layers.0.mlp.up_proj": _layer({"padding": 80, "active": 20}),
              "model.layers.1.mlp.up_proj": _layer({"padding": 80, "label_less": 15, "active": 5})}
    advice = layout_advice(_summary(layers), LENGTHS, 16, 64, None)
    table = advice["layouts"]
    for name in ("max_length", "longest", "bucket", "packed"):
        assert table[name]["padding_share"] == padding_share(LENGTHS, 16, 64, name)
    assert advice["recommended"] == "packed" and advice["stack_sebp"]
    p = table["packed"]["padding_share"]
    assert p < table["bucket"]["padding_share"] < table["longest"]["padding_share"]  # 16%, 37%, 80% here
    # the real rows' FLOPs: 40 of which 15 label-less
    assert table["packed"]["sebp_skips"] == pytest.approx(p + (1 - p) * 15 / 40)
    assert table["packed"]["dense_backward_vs_max_length"] == pytest.approx(
        (1 - table["max_length"]["padding_share"]) / (1 - p))
    assert "packed:" in advice["recommendation"] and "label-less rows of the last layer" in advice["recommendation"]
    assert "stack SEBP" in advice["recommendation"]


def test_advice_without_packing_or_sparsity_beyond_padding():
    from transformers import AutoModelForMaskedLM

    layers = {"model.layers.0.mlp.up_proj": _layer({"padding": 80, "active": 20}),
              "model.layers.1.mlp.up_proj": _layer({"padding": 80, "label_less": 1, "active": 19})}
    reason = packed_issue(AutoModelForMaskedLM.from_config(tiny_config("bert")), "mlm")
    assert reason.startswith("padding 'packed' runs exactly only on") and "\n" not in reason
    assert packed_issue(tiny_model("llama"), "causal-lm") is None
    advice = layout_advice(_summary(layers), LENGTHS, 16, 64, reason)
    assert advice["layouts"]["packed"] == {"applies": False, "reason": reason}
    # bucket leaves 37% padding, which SEBP skips
    assert advice["recommended"] == "bucket" and advice["stack_sebp"]
    assert "(mostly the padding left)" in advice["recommendation"]
    assert advice["recommendation"].endswith(f"packed does not apply: {reason}")
    # equal lengths: no layout beats padding to max_length by a point, so the simplest stays; SEBP would skip
    # only the 1 in 40 label-less rows
    same = layout_advice(_summary(layers), np.full(64, 64), 16, 64, None)
    assert same["recommended"] == "max_length" and not same["stack_sebp"]
    assert same["layouts"]["max_length"]["sebp_skips"] == pytest.approx(1 / 40)
    assert "SEBP adds little on top (under 10%)" in same["recommendation"]


def test_recommendation_says_where_the_label_less_rows_are():
    spread = {"model.layers.0.mlp.up_proj": _layer({"padding": 50, "label_less": 15, "active": 35}),
              "model.layers.1.mlp.up_proj": _layer({"padding": 50, "label_less": 35, "active": 15})}
    advice = layout_advice(_summary(spread), LENGTHS, 16, 64, None)
    assert "(mostly label-less rows over 2 layers, 70% in the last layer)" in advice["recommendation"]
