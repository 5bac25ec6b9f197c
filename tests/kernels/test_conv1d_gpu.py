"""SEBPConv1D on a CUDA GPU: the Triton backward reads the Conv1D's transposed weight through its strides (no
copy), and gives the dense Conv1D's gradients at GPT-2-base shapes; a patched GPT-2 trains as dense."""
from __future__ import annotations

import copy

import pytest
import torch

from sebp_kernels import SEBPConfig, SEBPConv1D

pytestmark = pytest.mark.gpu

# (rows, in, out) of GPT-2 base's c_attn, c_fc and mlp.c_proj, plus one no tile divides
SHAPES = [(1024, 768, 2304), (512, 768, 3072), (512, 3072, 768), (333, 515, 1027)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_sebp_conv1d_on_triton_equals_the_dense_conv1d(shape, dtype):
    from transformers.pytorch_utils import Conv1D

    m, n_in, n_out = shape
    torch.manual_seed(0)
    conv = Conv1D(n_out, n_in).to("cuda", dtype)
    torch.nn.init.normal_(conv.weight, std=n_in ** -0.5)
    torch.nn.init.normal_(conv.bias)
    x = torch.randn(m, n_in, device="cuda", dtype=dtype)
    dy = (torch.randn(m, n_out, device="cuda") * (torch.rand(m, 1, device="cuda") < 0.3)).to(dtype)
    grads = []
    for module in (conv, SEBPConv1D.from_conv1d(copy.deepcopy(conv), SEBPConfig("exact", backend="triton"))):
        xi = x.clone().requires_grad_()
        module(xi).backward(dy)
        grads.append((xi.grad, module.weight.grad, module.bias.grad))
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for name, got, want in zip(("dX", "dW", "db"), grads[1], grads[0]):
        torch.testing.assert_close(got.float(), want.float(), **tol, msg=lambda s, name=name: f"{name}: {s}")


def test_the_backward_takes_the_transposed_weight_without_a_copy(monkeypatch):
    from sebp_kernels._triton import grads

    seen = []
    real = grads._grads_at

    def spy(level, dy, x, weight, *args, **kw):
        seen.append((weight.data_ptr(), weight.stride()))
        return real(level, dy, x, weight, *args, **kw)

    monkeypatch.setattr(grads, "_grads_at", spy)
    w_t = torch.randn(64, 96, device="cuda")  # stored (in, out)
    from sebp_kernels._triton import sebp_backward_triton

    dy = torch.randn(40, 96, device="cuda") * (torch.rand(40, 1, device="cuda") < 0.5)
    sebp_backward_triton(dy, torch.randn(40, 64, device="cuda"), w_t.t(), SEBPConfig("exact"))
    assert seen == [(w_t.data_ptr(), (1, 96))]


def test_a_patched_gpt2_trains_as_dense_on_the_gpu():
    from sebp_probe.model.patch import patch_sebp
    from tests.tiny_models import family_model

    dense = family_model("gpt2", "causal-lm").cuda()
    sebp = copy.deepcopy(dense)
    names = patch_sebp(sebp, SEBPConfig("exact"), norms=True)["linears"]
    assert names and all(isinstance(sebp.get_submodule(n), SEBPConv1D) for n in names)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 120, (4, 16), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[1, 9:] = mask[3, 5:] = 0
    batch = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    out = []
    for model in (dense, sebp):
        for _ in range(2):  # the second step after the padding rows' check
            model.zero_grad(set_to_none=True)
            loss = model(**batch).loss
            loss.backward()
        out.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (l_d, g_d), (l_s, g_s) = out
    torch.testing.assert_close(l_s, l_d, rtol=1e-5, atol=0)
    assert g_d.keys() == g_s.keys()
    for k in g_d:
        torch.testing.assert_close(g_s[k], g_d[k], rtol=1e-4, atol=1e-5, msg=lambda s, k=k: f"{k}: {s}")
