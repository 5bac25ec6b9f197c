"""The width rule: an SEBP linear with fewer outputs than NARROW_OUT keeps autograd's dense backward on a GPU."""
import pytest
import torch
import torch.nn.functional as F

import sebp_kernels.density as density
import sebp_kernels.modules as modules
from sebp_kernels import SEBPLinear
from sebp_kernels.density import sparse_backward_can_pay


def test_only_narrow_linears_on_a_gpu_keep_the_dense_backward(monkeypatch):
    monkeypatch.setattr(density, "NARROW_OUT", 256)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not sparse_backward_can_pay(128, cuda) and not sparse_backward_can_pay(255, cuda)
    assert sparse_backward_can_pay(256, cuda) and sparse_backward_can_pay(4864, cuda)
    assert sparse_backward_can_pay(128, cpu)  # the rule is the GPU kernels'
    monkeypatch.setattr(density, "NARROW_OUT", 0)
    assert sparse_backward_can_pay(1, cuda)


def _layer(out_features=16):
    torch.manual_seed(0)
    return SEBPLinear.from_linear(torch.nn.Linear(24, out_features))


def test_a_linear_the_rule_keeps_dense_is_f_linear_with_its_gradients(monkeypatch):
    layer = _layer()
    x = torch.randn(3, 5, 24, requires_grad=True)
    assert "SEBP" in type(layer(x).grad_fn).__name__  # the SEBP Function on the CPU
    monkeypatch.setattr(modules, "sparse_backward_can_pay", lambda out, dev: out >= 256)
    y = layer(x)
    assert "SEBP" not in type(y.grad_fn).__name__
    ref = F.linear(x, layer.weight, layer.bias)
    assert torch.equal(y, ref)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, layer.weight, layer.bias), g)
    want = torch.autograd.grad(ref, (x, layer.weight, layer.bias), g)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_a_compiled_graph_holds_a_plain_linear_where_the_rule_keeps_it_dense(monkeypatch):
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    layer = _layer()
    x = torch.randn(2, 4, 24, requires_grad=True)
    monkeypatch.setattr(modules, "sparse_backward_can_pay", lambda out, dev: False)
    torch._dynamo.reset()
    torch.compile(layer, backend=backend)(x).sum().backward()
    assert seen and all("sebp" not in t.lower() and "apply" not in t for t in seen), seen
    assert any("linear" in t for t in seen), seen
    torch._dynamo.reset()


@pytest.mark.gpu
def test_qwen_key_value_projection_on_a_gpu_takes_autograds_backward(monkeypatch):
    monkeypatch.setattr(density, "NARROW_OUT", 256)
    kv = SEBPLinear.from_linear(torch.nn.Linear(896, 128, bias=True)).cuda()
    qo = SEBPLinear.from_linear(torch.nn.Linear(896, 896, bias=False)).cuda()
    x = torch.randn(2, 64, 896, device="cuda", requires_grad=True)
    assert "SEBP" not in type(kv(x).grad_fn).__name__
    assert "SEBP" in type(qo(x).grad_fn).__name__


def test_patching_names_the_linears_the_rule_keeps_dense(monkeypatch, caplog):
    from sebp_probe.model.patch import narrow_linears, patch_model
    from tests.tiny_models import tiny_model

    model = tiny_model("llama")
    monkeypatch.setattr(density, "sparse_backward_can_pay", lambda out, dev: out >= 32)  # k/v: 16 outputs
    with caplog.at_level("WARNING", logger="sebp_probe"):
        names = patch_model(model)
    kept = narrow_linears(model, names)
    assert kept and all(n.endswith(("k_proj", "v_proj")) for n in kept) and len(kept) == 4
    assert "4 of the 14 SEBP linears (self_attn.k_proj, self_attn.v_proj) have fewer than" in caplog.text
