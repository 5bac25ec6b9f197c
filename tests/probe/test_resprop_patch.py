"""patch_resprop / unpatch_resprop and the reuse-drop collector on tiny BERT and Llama models."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from sebp_kernels import ReSpropLinear, SEBPConfig, SEBPLinear
from sebp_probe import (PatchError, ReuseDropCollector, find_targets, patch_model, patch_resprop, reset_resprop,
                        resprop_layers, unpatch_resprop)
from sebp_probe.analysis.hooks import GradientStatsCollector
from tests.tiny_models import ENCODERS, padded_batch, tiny_model


def _grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_patch_shares_parameters_and_keeps_state_dict(arch):
    model = tiny_model(arch)
    before = {k: (v.data_ptr(), v.shape) for k, v in model.state_dict().items()}
    params = list(model.parameters())
    names = patch_resprop(model, 0.9)
    assert names == find_targets(tiny_model(arch)) and len(names) == (6 if arch in ENCODERS else 7) * 2
    assert all(isinstance(model.get_submodule(n), ReSpropLinear) for n in names)
    assert {k: (v.data_ptr(), v.shape) for k, v in model.state_dict().items()} == before
    assert all(a is b for a, b in zip(params, model.parameters()))
    assert set(resprop_layers(model).values()) == {0.9}


def test_patch_twice_is_a_noop_and_unpatch_restores():
    model = tiny_model("llama")
    first = patch_resprop(model, 0.9)
    _grads(model, padded_batch("llama"))
    modules = {n: model.get_submodule(n) for n in first}
    p = modules[first[0]].resprop_state.p
    assert p is not None
    assert patch_resprop(model, 0.9) == first
    assert all(model.get_submodule(n) is m for n, m in modules.items())
    assert modules[first[0]].resprop_state.p is p  # P kept
    patch_resprop(model, 0.5, targets="q_proj")
    assert {n for n, r in resprop_layers(model).items() if r == 0.5} == {n for n in first if n.endswith("q_proj")}
    assert sorted(unpatch_resprop(model)) == sorted(first)
    assert all(type(model.get_submodule(n)) is nn.Linear for n in first)
    assert all(model.get_submodule(n).weight is m.weight for n, m in modules.items())


def test_bad_requests():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="reuse must be"):
        patch_resprop(model, 1.5)
    with pytest.raises(PatchError, match="matches no linear"):
        patch_resprop(model, 0.9, targets="nope")
    patch_model(model, SEBPConfig("exact"), target_modules="q_proj")
    with pytest.raises(PatchError, match="unpatch SEBP first"):
        patch_resprop(model, 0.9)
    assert isinstance(model.get_submodule("model.layers.0.self_attn.q_proj"), SEBPLinear)


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_reuse_zero_gives_the_dense_gradients(arch):
    dense = tiny_model(arch)
    model = copy.deepcopy(dense)
    patch_resprop(model, 0.0)
    batch = padded_batch(arch)
    for _ in range(2):
        loss_d, g_d = _grads(dense, batch)
        loss_r, g_r = _grads(model, batch)
    assert torch.equal(loss_d, loss_r) and g_d.keys() == g_r.keys()
    for k in g_d:
        torch.testing.assert_close(g_r[k], g_d[k], atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_first_step_exact_then_approximate_and_train_eval_resets():
    dense = tiny_model("llama")
    model = copy.deepcopy(dense)
    patch_resprop(model, 0.9)
    batch = padded_batch("llama")
    _, g_d = _grads(dense, batch)
    _, g_first = _grads(model, batch)
    _, g_second = _grads(model, padded_batch("llama", lengths=(6, 9, 3), seed=1))  # other lengths: P aligned
    key = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(g_first[key], g_d[key], atol=1e-6, rtol=1e-5)
    layers = [m for m in model.modules() if isinstance(m, ReSpropLinear)]
    assert all(m.resprop_state.updates == 2 for m in layers)
    model.eval()
    assert all(m.resprop_state.p is None for m in layers)
    model.train()
    _, g_again = _grads(model, batch)  # exact again after the switch
    torch.testing.assert_close(g_again[key], g_d[key], atol=1e-6, rtol=1e-5)
    assert reset_resprop(model) == len(layers) and all(m.resprop_state.p is None for m in layers)


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_tiny_model_trains_at_reuse_09(arch):
    torch.manual_seed(0)
    model = tiny_model(arch)
    patch_resprop(model, 0.9)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = [padded_batch(arch, lengths=(11, 4, 7), seed=0), padded_batch(arch, lengths=(9, 10, 5), seed=1)]
    losses = []
    for step in range(24):
        loss = model(**batches[step % 2]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    # (dense reaches about 0.4x of its first losses here, reuse 0.9 about 0.45x (BERT) and 0.77x (Llama))
    assert sum(losses[-4:]) / 4 < 0.85 * sum(losses[:4]) / 4, losses


def test_lora_base_layer_gets_resprop_without_dw():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    names = patch_resprop(model, 0.9, targets=["q_proj", "v_proj"])
    assert names and all(n.endswith("base_layer") for n in names)
    for seed in range(2):
        model(**padded_batch("llama", seed=seed)).loss.backward()
    base = model.get_submodule(names[-1])  # (layer 0's input needs no gradient: its backward never runs)
    assert isinstance(base, ReSpropLinear) and base.weight.grad is None and base.resprop_state.updates == 2
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for n, p in model.named_parameters() if "lora_" in n and p.requires_grad)


def test_reuse_drop_collector_over_a_few_steps():
    model = tiny_model("bert")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with ReuseDropCollector(model, levels=(0.5, 0.9, 0.99)) as col:
        for step in range(3):
            model(**padded_batch("bert", seed=step)).loss.backward()
            opt.step()
            opt.zero_grad()
    summary = col.summary()
    assert list(summary) == find_targets(model)
    for name, s in summary.items():
        assert s["steps"] == 2
        d, t = list(s["dropped"].values()), list(s["topk_dropped"].values())
        assert all(0 <= v <= max(1.0, s["residual"]) + 1e-9 for v in d), (name, s)
        assert d == sorted(d) and t == sorted(t)
    assert all(len(v) == 2 for v in col.drops().values())
    model(**padded_batch("bert")).loss.backward()  # outside the block: nothing recorded
    assert all(v["steps"] == 2 for v in col.summary().values())


def test_gradient_stats_collector_sees_resprop_layers():
    model = tiny_model("llama")
    patch_resprop(model, 0.9)
    with GradientStatsCollector(model) as col:
        for seed in range(2):
            with col.batch():
                model(**padded_batch("llama", seed=seed)).loss.backward()
    assert len(col.names) == 14 and col.stats().batches == 2


@pytest.mark.gpu
def test_tiny_llama_trains_on_gpu_in_bf16():
    model = tiny_model("llama").cuda().to(torch.bfloat16)
    patch_resprop(model, 0.9)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = [{k: v.cuda() for k, v in padded_batch("llama", lengths=ls, seed=i).items()}
               for i, ls in enumerate([(11, 4, 7), (9, 10, 5)])]
    losses = []
    for step in range(16):
        loss = model(**batches[step % 2]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    layer = next(m for m in model.modules() if isinstance(m, ReSpropLinear))
    assert layer.resprop_state.p.dtype == torch.bfloat16 and layer.resprop_state.p.is_cuda
    assert all(math.isfinite(v) for v in losses) and sum(losses[-4:]) < sum(losses[:4]), losses
