"""Where autograd records nothing (``torch.no_grad()``, evaluation, generation) the SEBP ops are their plain
forward: the same values as with grad, no autograd Function, no flags pass."""
from __future__ import annotations

import contextlib

import pytest
import torch

from sebp_kernels import functional, norms
from sebp_kernels.activations import SEBPActFunction, sebp_gelu, sebp_swiglu
from sebp_kernels.functional import sebp_linear
from sebp_kernels.norms import sebp_layer_norm, sebp_rms_norm


def _ops(dtype, device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=g).to(device, dtype)
    w, b = torch.randn(12, 16, generator=g).to(device, dtype), torch.randn(12, generator=g).to(device, dtype)
    nw, nb = torch.randn(16, generator=g).to(device), torch.randn(16, generator=g).to(device)
    if device == "cuda":  # torch's layer norm refuses bf16 x with fp32 weights on CUDA (checked on an H100)
        nw, nb = nw.to(dtype), nb.to(dtype)
    x[1, 2] = float("nan")  # a non-finite row: the same in both paths
    return {
        "linear": (lambda x, w, b, nw, nb: sebp_linear(x, w, b), functional.SEBPLinearFunction),
        "layer_norm": (lambda x, w, b, nw, nb: sebp_layer_norm(x, (16,), nw, nb), norms.SEBPLayerNormFunction),
        "rms_norm": (lambda x, w, b, nw, nb: sebp_rms_norm(x, nw.to(dtype)), norms.SEBPRMSNormFunction),
        "gelu": (lambda x, w, b, nw, nb: sebp_gelu(x), SEBPActFunction),
        "swiglu": (lambda x, w, b, nw, nb: sebp_swiglu(x, x.flip(-1)), SEBPActFunction),
    }, (x, w, b, nw, nb)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["linear", "layer_norm", "rms_norm", "gelu", "swiglu"])
def test_no_grad_gives_the_grad_path_values_without_the_function(name, dtype, autocast, device, monkeypatch):
    """On the GPU the SwiGLU forward is the Triton kernel in both paths (the no-grad one without its flags)."""
    ops, args = _ops(dtype, device)
    op, fn = ops[name]
    ctx = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    leaves = [a.clone().requires_grad_() for a in args]
    with ctx():
        want = op(*leaves)
    assert want.requires_grad  # the grad path ran the Function
    monkeypatch.setattr(fn, "apply", lambda *a: pytest.fail(f"{fn.__name__} ran without a backward to come"))
    with torch.no_grad(), ctx():
        got = op(*args)
    with ctx():
        frozen = op(*args)  # grad mode on, nothing requires grad
    for out in (got, frozen):
        assert not out.requires_grad and out.dtype == want.dtype
        torch.testing.assert_close(out, want.detach(), rtol=0, atol=0, equal_nan=True)  # bit for bit, NaNs alike
