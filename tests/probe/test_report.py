"""The report contract: built from a real collection on tiny models, saved, loaded, checked against a
model, and turned into per-layer SEBP settings that patch_model accepts."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from sebp_kernels import SEBPLinear
from sebp_probe import patch_model, patched_layers
from sebp_probe.analysis.analyze import AnalyzeSettings, build_report, collect, layer_type, layer_type_rows, summarize
from sebp_probe.data.assets import model_identity
from sebp_probe.analysis.causes import layout_advice
from sebp_probe.analysis.report import (
    SCHEMA_VERSION,
    ReportError,
    check_report_for_model,
    layer_configs_from_report,
    load_report,
    save_report,
)
from tests.helpers import roundoff_first_queries
from tests.tiny_models import padded_batch, tiny_model

LENGTHS = (11, 4, 7, 9, 2)


def _report(arch="llama", side="left", tile=8, n_batches=3):
    model = tiny_model(arch)
    batches = [padded_batch(arch, LENGTHS, side=side, seed=s) for s in range(n_batches)]
    settings = AnalyzeSettings(max_batches=n_batches, tile=tile)
    with roundoff_first_queries(model):  # the noise rows a left-padded decoder's first queries hold on most CPUs
        stats = collect(model, batches, settings)
    summary = summarize(stats, settings)
    padding = {"padding": "longest", "max_length": 64, "padding_side": side, "batch_size": len(LENGTHS)}
    layouts = layout_advice(summary, np.concatenate(stats.lengths), len(LENGTHS), 64, None)
    report = build_report(summary, {"name": f"tiny-{arch}", **model_identity(model)},
                          {"name": "synthetic", "num_samples": n_batches * len(LENGTHS)}, padding, layouts)
    return report, model, batches


@pytest.fixture(scope="module")
def llama_report():
    return _report()


def test_report_content_matches_the_batches(llama_report):
    report, model, batches = llama_report
    assert report["schema_version"] == SCHEMA_VERSION and report["model"]["model_type"] == "llama"
    rows = sum(b["input_ids"].numel() for b in batches)
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    assert report["tokens"]["pad_fraction"] == pytest.approx(1 - real / rows)
    assert report["tokens"]["per_sample"] == {"avg": pytest.approx(np.mean(LENGTHS)), "max": 11, "min": 2}
    assert len(report["layers"]) == 14
    for name, entry in report["layers"].items():
        m = model.get_submodule(name)
        st = entry["stats"]
        assert st["shape"] == [m.in_features, m.out_features]
        assert st["backward_flops"]["dense"] == 4 * rows * m.in_features * m.out_features
        assert entry["top_n"] == st["rows_per_batch"] or entry["top_n"] % 8 == 0
        assert entry["mode"] == ("threshold" if st["knee_found"] else "exact")
        assert entry["eps"] > 0 if st["knee_found"] else entry["eps"] == 0
        # right after the pads and each last token, every other row is active at eps=0
        if entry["mode"] == "exact":
            assert st["active_row_fraction"]["avg"] == pytest.approx(1 - st["zero_row_fraction"]["avg"])
    # the left-padded decoder's query rows of the first token are noise: a knee there
    assert report["layers"]["model.layers.1.self_attn.q_proj"]["mode"] == "threshold"
    t = report["totals"]
    assert 0 < t["saving_threshold"] < 1 and t["backward_flops"]["threshold"] < t["backward_flops"]["dense"]
    assert layer_type("model.layers.1.self_attn.q_proj") == "self_attn.q_proj" and layer_type("score") == "score"
    types = {r["type"]: r for r in layer_type_rows(report)}
    assert set(types) == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    assert all(r["layers"] == 2 for r in types.values())


def test_save_load_round_trip_and_patch(tmp_path, llama_report):
    report, model, _ = llama_report
    path = save_report(report, tmp_path / "sub" / "report.json")
    loaded = load_report(path)
    assert loaded == json.loads(json.dumps(report))
    check_report_for_model(loaded, model)
    for mode in ("recommended", "exact", "threshold", "topk"):
        configs = layer_configs_from_report(loaded, mode)
        m = copy.deepcopy(model)
        assert sorted(patch_model(m, layer_configs=configs)) == sorted(loaded["layers"])
        got = patched_layers(m)
        for name, entry in loaded["layers"].items():
            want = entry["mode"] if mode == "recommended" else mode
            assert got[name].mode == want and got[name].eps == entry["eps"] and got[name].top_n == entry["top_n"]
    glob = layer_configs_from_report(loaded, "topk", use_global=True)
    assert {c.top_n for c in glob.values()} == {loaded["global"]["top_n"]}
    with pytest.raises(ReportError, match="unknown mode"):
        layer_configs_from_report(loaded, "fast")


def test_exact_settings_from_a_report_keep_dense_gradients(llama_report):
    report, model, batches = llama_report
    sebp = copy.deepcopy(model)
    patch_model(sebp, layer_configs=layer_configs_from_report(report, "exact"))
    assert all(isinstance(sebp.get_submodule(n), SEBPLinear) for n in report["layers"])
    for m in (model, sebp):
        m.zero_grad(set_to_none=True)
        m(**batches[0]).loss.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), sebp.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-5, msg=n)


def test_report_for_another_model_is_refused(llama_report):
    report, model, _ = llama_report
    with pytest.raises(ReportError, match="made for tiny-llama .llama., not for this bert model"):
        check_report_for_model(report, tiny_model("bert"))
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import tiny_config

    cfg = tiny_config("llama")
    cfg.intermediate_size = 48
    with pytest.raises(ReportError, match=r"is 32x48 here, 32x40 in the report"):
        check_report_for_model(report, AutoModelForCausalLM.from_config(cfg))
    deeper = tiny_config("llama")
    deeper.num_hidden_layers = 3  # every layer of the report exists, with its shape: still another model
    with pytest.raises(ReportError, match="num_hidden_layers 2; this model has 3"):
        check_report_for_model(report, AutoModelForCausalLM.from_config(deeper))
    bad = copy.deepcopy(report)
    bad["layers"]["model.layers.9.mlp.up_proj"] = bad["layers"]["model.layers.1.mlp.up_proj"]
    with pytest.raises(ReportError, match="no linear layer 'model.layers.9.mlp.up_proj'"):
        check_report_for_model(bad, model)


def test_a_lora_wrapped_model_accepts_the_report(llama_report):
    peft = pytest.importorskip("peft")
    report, model, _ = llama_report
    wrapped = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    check_report_for_model(report, wrapped)


def _write(tmp_path, obj, raw=None):
    p = tmp_path / "r.json"
    p.write_text(raw if raw is not None else json.dumps(obj))
    return p


def test_bad_report_files_give_one_clear_line(tmp_path, llama_report):
    report = llama_report[0]
    cases = [
        (tmp_path / "missing.json", "does not exist"),
        (tmp_path, "is a directory"),
        (_write(tmp_path, None, raw="{not json"), "not valid JSON"),
    ]
    for path, words in cases:
        with pytest.raises(ReportError, match=words) as e:
            load_report(path)
        assert "\n" not in str(e.value)
    for mutate, words in [
        (lambda r: r.pop("schema"), "not a sebp-probe report"),
        (lambda r: r.__setitem__("schema_version", 99), "schema version 99"),
        (lambda r: r.pop("layers"), "lacks 'layers'"),
        (lambda r: r.__setitem__("layers", {}), "no per-layer settings"),
        (lambda r: next(iter(r["layers"].values())).__setitem__("eps", -1.0), "eps must be"),
        (lambda r: next(iter(r["layers"].values())).__setitem__("top_n", 0), "N"),
        (lambda r: next(iter(r["layers"].values())).__setitem__("top_n", None), "top_n is missing"),
        (lambda r: r["global"].pop("eps"), "global setting needs"),
        (lambda r: r["global"].__setitem__("eps", -2.0), "global setting: eps must be"),
    ]:
        r = copy.deepcopy(report)
        mutate(r)
        with pytest.raises(ReportError, match=words):
            load_report(_write(tmp_path, r))
    r = copy.deepcopy(report)
    r["global"]["eps"] = float("nan")
    with pytest.raises(ValueError):
        save_report(r, tmp_path / "nan.json")
    assert not (tmp_path / "nan.json").exists()


def test_a_version_1_report_still_loads(tmp_path, llama_report):
    """finetune --report takes reports of schema version 1 (before the rows by cause and the layouts)."""
    report, model, _ = llama_report
    old = copy.deepcopy(report)
    old["schema_version"] = 1
    del old["layouts"]
    for entry in old["layers"].values():
        for key in ("rows_by_cause", "label_less_positions", "padding_not_zero", "backward_flops_by_cause"):
            del entry["stats"][key]
    del old["totals"]["backward_flops_by_cause"], old["totals"]["share_by_cause"]
    loaded = load_report(_write(tmp_path, old))
    check_report_for_model(loaded, model)
    assert layer_configs_from_report(loaded) == layer_configs_from_report(report)
    with pytest.raises(ReportError, match="made for tiny-llama .llama., not for this bert model"):
        check_report_for_model(loaded, tiny_model("bert"))
    new = copy.deepcopy(report)
    del new["layouts"]
    with pytest.raises(ReportError, match="lacks 'layouts'"):
        load_report(_write(tmp_path, new))


def test_nan_gradients_and_frozen_models_are_refused():
    from sebp_probe.analysis.analyze import AnalysisError

    model = tiny_model("bert")
    batch = padded_batch("bert", LENGTHS)
    with torch.no_grad():
        model.bert.encoder.layer[0].intermediate.dense.weight[0, 0] = float("nan")
    with pytest.raises(AnalysisError, match="loss is nan"):
        collect(model, [batch])
    frozen = tiny_model("bert").requires_grad_(False)
    with pytest.raises(AnalysisError, match="does not depend on any trainable parameter"):
        collect(frozen, [batch])
    frozen.classifier.requires_grad_(True)  # a loss with a gradient, but none reaches the encoder
    with pytest.raises(AnalysisError, match="no target layer received a gradient"):
        summarize(collect(frozen, [batch]))
    with pytest.raises(AnalysisError, match="no batches"):
        collect(frozen, [])
    with pytest.raises(ValueError, match="tile"):
        AnalyzeSettings(tile=0)
    with pytest.raises(ValueError, match="max batches"):
        AnalyzeSettings(max_batches=0)
