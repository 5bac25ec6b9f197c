"""patch_model / unpatch_model on tiny BERT, RoBERTa, Llama, Qwen2 and Qwen3 models."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from sebp_kernels import SEBPConfig, SEBPLinear
from sebp_probe import PatchError, patch_model, patched_layers, unpatch_model
from tests.helpers import loss_and_grads
from tests.tiny_models import ENCODERS, padded_batch, tiny_model

ARCHS = ("bert", "roberta", "llama", "qwen2", "qwen3")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("side", ["right", "left"])
def test_exact_mode_gradients_equal_dense(arch, side):
    dense = tiny_model(arch)
    sebp = copy.deepcopy(dense)
    names = patch_model(sebp, SEBPConfig("exact"))
    n_proj = 6 if arch in ENCODERS else 7
    assert len(names) == n_proj * 2
    batch = padded_batch(arch, side=side)
    loss_d, g_d = loss_and_grads(dense, batch)
    loss_s, g_s = loss_and_grads(sebp, batch)
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
    loss_and_grads(model, padded_batch(arch))
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


def test_model_of_no_known_family_gets_every_linear_but_its_head(caplog):
    seq = nn.Sequential(nn.Linear(3, 3))
    seq.classifier = nn.Linear(3, 2)
    with caplog.at_level("WARNING", logger="sebp_probe"):
        assert patch_model(seq) == ["0"]
    [line] = [r.getMessage() for r in caplog.records]
    assert "every linear but the output head (0)" in line and "--targets" in line and "target_modules" not in line
    with pytest.raises(PatchError, match="no nn.Linear layer but its output head"):
        patch_model(nn.Sequential(nn.ReLU()))


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


def test_hooks_and_mode_survive_patch_and_unpatch():
    model = tiny_model("llama")
    name = "model.layers.0.mlp.up_proj"
    calls = []
    handle = model.get_submodule(name).register_forward_hook(lambda m, i, o: calls.append("fwd"))
    model.get_submodule(name).register_full_backward_hook(lambda m, gi, go: calls.append("bwd"))
    model.eval()
    patch_model(model)
    assert isinstance(model.get_submodule(name), SEBPLinear) and not model.get_submodule(name).training
    model(**padded_batch("llama")).loss.backward()
    assert calls == ["fwd", "bwd"]
    unpatch_model(model)
    calls.clear()
    model(**padded_batch("llama")).loss.backward()
    assert calls == ["fwd", "bwd"]
    handle.remove()  # a handle taken before patching still removes the hook
    calls.clear()
    model(**padded_batch("llama")).loss.backward()
    assert calls == ["bwd"]


def test_per_layer_keys_are_exact_names_not_patterns():
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4)))
    names = patch_model(seq, layer_configs={"0": {"mode": "threshold", "eps": 0.1}})
    assert names == ["0"] and type(seq[2][0]) is nn.Linear
    with pytest.raises(PatchError, match="leave out"):
        patch_model(tiny_model("llama"), target_modules=["q_proj"],
                    layer_configs={"model.layers.0.mlp.up_proj": {"mode": "exact"}})


def test_per_layer_setting_under_a_lora_wrapper_name():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    wrapper = next(n for n, m in model.named_modules() if n.endswith("layers.0.self_attn.q_proj"))
    names = patch_model(model, layer_configs={wrapper: {"mode": "threshold", "eps": 1e-3}})
    assert names == [f"{wrapper}.base_layer"]
    assert patched_layers(model)[names[0]] == SEBPConfig("threshold", eps=1e-3)


def test_all_linear_keeps_attention_out_proj_and_regex_skips_non_linear_leaves():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.out_proj, self.act = nn.Linear(4, 4), nn.Linear(4, 4), nn.GELU()

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.lm_head = Attn(), nn.Linear(4, 9)

    assert sorted(patch_model(Toy(), target_modules="all-linear")) == ["self_attn.out_proj", "self_attn.q_proj"]
    assert sorted(patch_model(Toy(), target_modules=[r"self_attn\..*"])) == ["self_attn.out_proj",
                                                                          "self_attn.q_proj"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("side", ["right", "left"])
def test_norms_too_exact_gradients_equal_dense(arch, side):
    from sebp_kernels import SEBPNorm
    from sebp_probe import patch_norms

    dense = tiny_model(arch)
    sebp = copy.deepcopy(dense)
    before = {k: v.data_ptr() for k, v in sebp.state_dict().items()}
    patch_model(sebp, SEBPConfig("exact"))
    norms = patch_norms(sebp)
    # every LayerNorm (embeddings + 2 per layer) or RMSNorm (2 per layer + final, + q/k norms in Qwen3)
    assert len(norms) == {"qwen3": 9}.get(arch, 5)
    assert all(isinstance(sebp.get_submodule(n), SEBPNorm) for n in norms)
    assert {k: v.data_ptr() for k, v in sebp.state_dict().items()} == before
    assert patch_norms(sebp) == []  # already swapped
    batch = padded_batch(arch, side=side)
    loss_d, g_d = loss_and_grads(dense, batch)
    loss_s, g_s = loss_and_grads(sebp, batch)
    assert torch.equal(loss_d, loss_s)
    assert g_d.keys() == g_s.keys()
    for k in g_d:
        torch.testing.assert_close(g_s[k], g_d[k], atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    originals = {n: sebp.get_submodule(n).original() for n in norms}
    unpatch_model(sebp)
    assert all(sebp.get_submodule(n) is m for n, m in originals.items())
    assert not any(isinstance(m, (SEBPLinear, SEBPNorm)) for m in sebp.modules())


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_torch_compile_gives_the_eager_gradients(arch):
    """torch.compile of a model with SEBP linears, norms and activations (Dynamo + AOTAutograd, the eager
    backend: no C++ build): the loss and gradients of eager SEBP, twice (the second call from the cache), in
    one graph: the SEBP layers are sebp:: custom ops (tests/kernels/test_ops.py has the details)."""
    from sebp_probe import patch_activations, patch_norms

    dense = tiny_model(arch).eval()  # no dropout: the runs must see the same masks
    sebp = copy.deepcopy(dense)
    patch_model(sebp, SEBPConfig("exact"))
    patch_norms(sebp)
    patch_activations(sebp)
    batch = padded_batch(arch)
    loss_e, g_e = loss_and_grads(sebp, batch)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(sebp, backend="aot_eager")
    for _ in range(2):
        sebp.zero_grad(set_to_none=True)
        loss = compiled(**batch).loss
        loss.backward()
        g_c = {n: p.grad for n, p in sebp.named_parameters() if p.grad is not None}
        torch.testing.assert_close(loss.detach(), loss_e, atol=1e-6, rtol=1e-6)
        assert g_c.keys() == g_e.keys() and len(g_e) > 10
        for k in g_e:
            torch.testing.assert_close(g_c[k], g_e[k], atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    torch._dynamo.reset()


def test_patch_sebp_puts_in_linears_activations_and_norms():
    """patch_sebp patches every kind asked for, in order (the activations hand rows to the linears present);
    an empty per-layer dict patches no linear, the norms and activations still go in."""
    from sebp_kernels import SEBPConfig, SEBPLinear, SEBPNorm
    from sebp_probe.model.patch import patch_sebp, patched_activations, unpatch_model
    from tests.tiny_models import tiny_model

    model = tiny_model("llama")
    names = patch_sebp(model, SEBPConfig("exact"), norms=True, acts=True)
    assert names["linears"] and names["acts"] == patched_activations(model) and names["norms"]
    mlp = model.get_submodule(names["acts"][0])
    assert mlp.gate_proj._sebp_hint is mlp._sebp_act_hint  # the activation hands its rows to gate and up
    unpatch_model(model)
    names = patch_sebp(model, layer_configs={}, norms=True)
    assert names == {"linears": [], "acts": [], "norms": names["norms"]} and names["norms"]
    assert not any(isinstance(m, SEBPLinear) for m in model.modules())
    assert sum(isinstance(m, SEBPNorm) for m in model.modules()) == len(names["norms"])
