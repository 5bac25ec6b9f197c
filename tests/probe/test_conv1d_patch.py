"""GPT-2's Conv1D projections through sebp_probe: the family's default targets find them, patching swaps them
for SEBPConv1D and unpatching gives the Conv1D modules back (state_dict keys and data pointers unchanged both
ways), the gradient statistics and report checks read their (in, out) shapes, and gradient reuse, which takes
nn.Linear only, says so in one line before it swaps anything."""
from __future__ import annotations

import pytest
import torch

from sebp_kernels import SEBPConfig, SEBPConv1D
from sebp_probe.analysis.hooks import GradientStatsCollector
from sebp_probe.analysis.report import ReportError, check_report_for_model
from sebp_probe.model.linears import features, is_conv1d
from sebp_probe.model.patch import PatchError, find_targets, patch_model, unpatch_model
from sebp_probe.model.resprop import patch_resprop
from tests.tiny_models import family_model

PROJECTIONS = {"attn.c_attn": (32, 96), "attn.c_proj": (32, 32), "mlp.c_fc": (32, 40), "mlp.c_proj": (40, 32)}


def _gpt2():
    return family_model("gpt2", "causal-lm")


def test_the_gpt2_entry_targets_its_conv1d_projections():
    model = _gpt2()
    names = find_targets(model)
    assert sorted(names) == sorted(f"transformer.h.{i}.{p}" for i in range(2) for p in PROJECTIONS)
    for name in names:
        module = model.get_submodule(name)
        assert is_conv1d(module) and features(module) == PROJECTIONS[name.split(".", 3)[3]]


def test_patch_and_unpatch_keep_state_dict_keys_and_data_pointers():
    model = _gpt2()
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    convs = {n: model.get_submodule(n) for n in find_targets(model)}
    names = patch_model(model, SEBPConfig("exact"))
    assert sorted(names) == sorted(convs)
    assert all(type(model.get_submodule(n)) is SEBPConv1D for n in names)
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before
    assert model.lm_head.weight is model.transformer.wte.weight  # the tied head is left alone
    unpatch_model(model)
    assert all(model.get_submodule(n) is m for n, m in convs.items())  # the very Conv1D modules back
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before


def test_gradient_statistics_and_report_checks_read_conv1d_shapes():
    model = _gpt2()
    ids = torch.randint(3, 120, (2, 10))
    with GradientStatsCollector(model) as collector:
        with collector.batch(torch.ones_like(ids)):
            model(input_ids=ids, labels=ids).loss.backward()
    stats = collector.stats()
    name = "transformer.h.0.mlp.c_fc"
    layer = stats.layers[name]
    assert (layer.in_features, layer.out_features) == (32, 40) and layer.rows == [20]
    report = {"model": {"model_type": "gpt2"}, "layers": {name: {"stats": {"shape": [32, 40]}}}}
    check_report_for_model(report, model)
    report["layers"][name]["stats"]["shape"] = [40, 32]
    with pytest.raises(ReportError, match="is 32x40 here, 40x32 in the report"):
        check_report_for_model(report, model)


def test_gradient_reuse_refuses_conv1d_before_swapping_anything():
    model = _gpt2()
    with pytest.raises(PatchError, match=r"is a Conv1D: gradient reuse takes nn.Linear layers only"):
        patch_resprop(model)
    assert all(is_conv1d(model.get_submodule(n)) for n in find_targets(model))
