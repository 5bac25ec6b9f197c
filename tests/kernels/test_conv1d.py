"""SEBPConv1D: the SEBP backward over a weight stored (in, out), as transformers' Conv1D (GPT-2) keeps it, on the
torch path (the CPU's): the same gradients as the dense Conv1D, the Parameters shared both ways, and a module
called several times in one forward (ALBERT's shared layers) giving each call's rows their own backward."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from sebp_kernels import SEBPConfig, SEBPConv1D, SEBPLinear
from sebp_kernels.reference import weight_view


def _conv(n_in: int, n_out: int, dtype=torch.float64, bias: bool = True, seed: int = 0) -> Conv1D:
    torch.manual_seed(seed)
    conv = Conv1D(n_out, n_in).to(dtype)
    nn.init.normal_(conv.weight, std=n_in ** -0.5)
    if bias:
        nn.init.normal_(conv.bias)
    else:
        conv.bias = None  # transformers' Conv1D always has one; the SEBP module takes none too
    return conv


class _NoBias(nn.Module):
    """What a Conv1D without bias computes (transformers' own needs one), over the same Parameter."""

    def __init__(self, conv: Conv1D):
        super().__init__()
        self.weight, self.bias = conv.weight, None

    def forward(self, x):
        return x @ self.weight


def _sparse_dy(shape, dtype, seed=1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dy = torch.randn(*shape, generator=g, dtype=torch.float64)
    keep = torch.rand(shape[:-1], generator=g) < 0.4
    return (dy * keep.unsqueeze(-1)).to(dtype)


def _grads(module, x, dy):
    x = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    y = module(x)
    y.backward(dy)
    return y.detach(), x.grad, module.weight.grad, None if module.bias is None else module.bias.grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_sebp_conv1d_gives_the_dense_conv1d_gradients(dtype, bias):
    conv = _conv(24, 40, dtype, bias)
    x = torch.randn(3, 7, 24, dtype=dtype)
    dy = _sparse_dy((3, 7, 40), dtype)
    want = _grads(conv if bias else _NoBias(conv), x, dy)
    sebp = SEBPConv1D.from_conv1d(copy.deepcopy(conv), SEBPConfig("exact"))
    got = _grads(sebp, x, dy)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-12 if not bias else 0)  # Conv1D's own addmm
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    for name, g, w in zip(("dX", "dW", "db"), got[1:], want[1:]):
        if w is None:
            assert g is None
            continue
        assert g.shape == w.shape, name
        torch.testing.assert_close(g, w, **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("mode", ["threshold", "topk"])
def test_sebp_conv1d_is_the_sebp_linear_of_the_transposed_weight(mode):
    """The approximate modes drop the same rows as an SEBPLinear holding Wᵀ: the same gradients, transposed."""
    conv = _conv(16, 12)
    cfg = SEBPConfig(mode, eps=0.5, top_n=9)
    linear = nn.Linear(16, 12).double()
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    x, dy = torch.randn(4, 6, 16, dtype=torch.float64), _sparse_dy((4, 6, 12), torch.float64)
    want = _grads(SEBPLinear.from_linear(linear, cfg), x, dy)
    got = _grads(SEBPConv1D.from_conv1d(conv, cfg), x, dy)
    torch.testing.assert_close(got[1], want[1])
    torch.testing.assert_close(got[2], want[2].t())
    torch.testing.assert_close(got[3], want[3])


def test_from_conv1d_shares_the_parameters_and_to_linear_gives_the_module_back():
    conv = _conv(8, 6)
    hook_calls = []
    conv.register_forward_hook(lambda *a: hook_calls.append(1))
    conv.eval()
    keys, ptrs = list(conv.state_dict()), (conv.weight.data_ptr(), conv.bias.data_ptr())
    sebp = SEBPConv1D.from_conv1d(conv)
    assert isinstance(sebp, SEBPLinear) and (sebp.in_features, sebp.out_features) == (8, 6)
    assert sebp.weight is conv.weight and sebp.bias is conv.bias and not sebp.training
    assert list(sebp.state_dict()) == keys and [n for n, _ in sebp.named_modules()] == [""]
    sebp(torch.randn(2, 8, dtype=torch.float64))
    assert hook_calls == [1]  # hooks of the Conv1D keep firing
    sebp.train()
    back = sebp.to_linear()
    assert back is conv and back.training and "in_features" not in vars(back)
    assert (back.weight.data_ptr(), back.bias.data_ptr()) == ptrs and list(back.state_dict()) == keys
    copied = copy.deepcopy(sebp)  # a copy's module to give back holds the copy's Parameters
    assert copied.to_linear().weight is copied.weight and copied.weight is not conv.weight


def test_from_conv1d_refuses_what_is_no_conv1d():
    with pytest.raises(TypeError, match="Conv1D-like"):
        SEBPConv1D.from_conv1d(nn.Linear(8, 12))  # weight (12, 8), bias (12,): not (in, out) with (out,)
    with pytest.raises(TypeError, match="Conv1D-like"):
        SEBPConv1D.from_conv1d(SEBPConv1D.from_conv1d(_conv(4, 5)))


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_a_module_called_several_times_in_one_forward_gives_each_call_its_rows(kind):
    """ALBERT applies one layer N times: every call saves its own input and selects its own dY rows."""
    torch.manual_seed(0)
    dense = _conv(10, 10) if kind == "conv1d" else nn.Linear(10, 10).double()
    sebp = copy.deepcopy(dense)
    sebp = SEBPConv1D.from_conv1d(sebp) if kind == "conv1d" else SEBPLinear.from_linear(sebp)
    x = torch.randn(5, 3, 10, dtype=torch.float64)
    masks = [torch.rand(5, 3, 1) < p for p in (0.9, 0.5, 0.2)]  # other zero rows at every call

    def run(module):
        module.zero_grad(set_to_none=True)
        h = x.clone().requires_grad_()
        out = h
        for m in masks:
            out = torch.tanh(module(out)) * m
        out.sum().backward()
        return h.grad, module.weight.grad, module.bias.grad

    for g, w in zip(run(sebp), run(dense)):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_weight_view_reads_a_transposed_weight_without_a_copy():
    w = torch.randn(8, 5)
    assert weight_view(w) is w
    t = torch.randn(5, 8).t()  # a Conv1D's (in, out) weight seen as (out, in)
    assert weight_view(t) is t
    other = torch.randn(8, 10)[:, ::2]  # strided columns: a copy with unit stride
    got = weight_view(other)
    assert got.stride(1) == 1 and torch.equal(got, other)
