"""patch_model / unpatch_model on tiny BERT, RoBERTa, Llama, Qwen2 and Qwen3 models."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from sebp_kernels import SEBPConfig, SEBPLinear
from sebp_probe import PatchError, patch_model, patched_layers, unpatch_model
from tests.tiny_models import ENCODERS, padded_batch, tiny_model

ARCHS = ("bert", "roberta", "llama", "qwen2", "qwen3")


def _grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("side", ["right", "left"])
def test_exact_mode_gradients_equal_dense(arch, side):
    dense = tiny_model(arch)
    sebp = copy.deepcopy(dense)
    names = patch_model(sebp, SEBPConfig("exact"))
    n_proj = 6 if arch in ENCODERS else 7
    assert len(names) == n_proj * 2
    batch = padded_batch(arch, side=side)
    loss_d, g_d = _grads(dense, batch)
    loss_s, g_s = _grads(sebp, batch)
    assert torch.equal(loss_d, loss_s)
    assert g_d.keys() == g_s.keys() and len(g_d) > 10
    for k in g_d:
        torch.testing.assert_close(g_s[k], g_d[k], atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("arch", ARCHS)
def test_state_dict_pointers_and_optimizer_survive_patching(arch):
    model = tiny_model(arch)
    before = {k: (v.data_ptr(), v.shape) for k, v in model.state_dict().items()}
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    patch_model(model)
    after = {k: (v.data_ptr(), v.shape) for k, v in model.state_dict().items()}
    assert before == after
    assert all(a is b for a, b in zip(params, model.parameters()))
    w = model.get_submodule(next(iter(patched_layers(model)))).weight
    old = w.detach().clone()
    _grads(model, padded_batch(arch))
    opt.step()
    assert not torch.equal(old, w.detach())  # the optimizer built before patching updates SEBP weights


def test_patch_twice_is_noop_and_unpatch_restores():
    model = tiny_model("llama")
    first = patch_model(model, SEBPConfig("exact"))
    structure = [(n, type(m)) for n, m in model.named_modules()]
    second = patch_model(model, SEBPConfig("exact"))
    assert first == second
    assert structure == [(n, type(m)) for n, m in model.named_modules()]
    restored = unpatch_model(model)
    assert sorted(restored) == sorted(first)
    assert not any(isinstance(m, SEBPLinear) for m in model.modules())
    assert all(type(model.get_submodule(n)) is nn.Linear for n in first)


def test_head_only_when_asked_and_all_linear():
    model = tiny_model("bert")
    names = patch_model(model, target_modules="all-linear")
    assert not any("classifier" in n or "pooler" in n for n in names)
    assert len(names) == 12
    unpatch_model(model)
    assert patch_model(model, target_modules=["classifier"]) == ["classifier"]
    lm = tiny_model("llama")
    assert "lm_head" not in patch_model(lm, target_modules="all-linear")
    assert "lm_head" in patch_model(lm, target_modules=["lm_head"])


def test_regex_exclude_and_filter_fn():
    model = tiny_model("llama")
    names = patch_model(model, target_modules=[r".*layers\.1\..*_proj"], exclude_modules=["down_proj"])
    assert len(names) == 6 and all(".layers.1." in n and "down_proj" not in n for n in names)
    model = tiny_model("llama")
    names = patch_model(model, filter_fn=lambda m, fqn: m.out_features > 32)
    assert names and all(model.get_submodule(n).out_features > 32 for n in names)


def test_per_layer_settings():
    model = tiny_model("bert")
    q = "bert.encoder.layer.0.attention.self.query"
    v = "bert.encoder.layer.1.attention.self.value"
    names = patch_model(model, layer_configs={q: {"mode": "threshold", "eps": 1e-4},
                                              v: SEBPConfig("topk", top_n=8)})
    assert sorted(names) == sorted([q, v])
    cfgs = patched_layers(model)
    assert cfgs[q] == SEBPConfig("threshold", eps=1e-4) and cfgs[v].top_n == 8


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        ({"target_modules": ["nonexistent_proj"]}, "matches no linear layer; linear layers are: model"),
        ({"target_modules": ["model.norm"]}, "not an nn.Linear"),
        ({"target_modules": ["self_attn"]}, "matches no linear layer"),
        ({"layer_configs": {"model.layers.9.mlp.up_proj": {"mode": "exact"}}}, "not in this model"),
        ({"layer_configs": {"model.layers.0.mlp.up_proj": {"mode": "topk", "top_n": 0}}}, "N"),
        ({"layer_configs": {"model.layers.0.mlp.up_proj": {"eps": -1}}}, "eps"),
        ({"layer_configs": {"model.layers.0.mlp.up_proj": {"mode": "bogus"}}}, "unknown SEBP mode"),
        ({"layer_configs": {"model.norm": {"mode": "exact"}}}, "not an nn.Linear"),
    ],
)
def test_bad_requests_fail_at_patch_time(kwargs, msg):
    model = tiny_model("llama")
    with pytest.raises(PatchError, match=msg):
        patch_model(model, **kwargs)
    assert not any(isinstance(m, SEBPLinear) for m in model.modules())


def test_model_without_default_targets_is_an_error():
    seq = nn.Sequential(nn.Linear(3, 3))
    with pytest.raises(PatchError, match="default targets"):
        patch_model(seq)
    assert patch_model(seq, target_modules="all-linear") == ["0"]


def test_lora_base_layer_gets_sebp_and_no_dw():
    peft = pytest.importorskip("peft")
    model = tiny_model("llama")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    names = patch_model(model, target_modules=["q_proj", "v_proj"])
    assert names and all(n.endswith("base_layer") for n in names)
    batch = padded_batch("llama")
    model(**batch).loss.backward()
    base = model.get_submodule(names[0])
    assert isinstance(base, SEBPLinear) and base.weight.grad is None
    assert any(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)
