"""SEBP activations (SwiGLU, GELU): forward values equal to Hugging Face's formula, backward equal to dense
autograd with zero rows and NaN/Inf inputs, the rows handed to the SEBP linears before them, and patched
tiny models whose loss and gradients match the dense ones.

Runs on the torch path (plain run) and on the Triton kernels under the interpreter (one pytest subprocess
with TRITON_INTERPRET=1; fp32 and fp16 there). bf16 and real shapes: tests/kernels/test_triton_gpu.py.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

from sebp_kernels import SEBPConfig
from sebp_kernels.activations import RowHint, sebp_gelu, sebp_swiglu


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32, torch.float16] if INTERPRET else [torch.float32, torch.bfloat16]
BACKEND = "triton" if INTERPRET else "torch"

def _case(kind, shape, dtype, seed=0, bad_rows=()):
    """Inputs with NaN/Inf in ``bad_rows`` (of the flattened rows), and a dL/dH whose padding rows are zero
    (the second half of every sequence, and the last sequence), one of them a bad row."""
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(*shape, generator=g) * 3).to(dtype)
    b = torch.randn(*shape, generator=g).to(dtype) if kind == "swiglu" else None
    for i, r in enumerate(bad_rows):
        flat = (b if (b is not None and i % 2) else a).view(-1, shape[-1])
        flat[r, (3 * i) % shape[-1]] = (float("nan"), float("inf"), -float("inf"))[i % 3]
    dh = torch.randn(*shape, generator=g)
    dh[:, shape[1] // 2:] = 0
    dh[-1] = 0
    return a, b, dh.to(dtype)


def _fn(kind, hint=None):
    if kind == "swiglu":
        return lambda a, b: sebp_swiglu(a, b, hint, BACKEND)
    return lambda a, b: sebp_gelu(a, hint, BACKEND)


def _hf(kind):
    return (lambda a, b: F.silu(a) * b) if kind == "swiglu" else (lambda a, b: F.gelu(a))


def _run(fn, a, b, dh):
    leaves = [t.detach().clone().requires_grad_() for t in (a, b) if t is not None]
    h = fn(*leaves, *([None] if b is None else []))
    h.backward(dh)
    return h.detach(), [t.grad for t in leaves]


def _same(x, y, dtype):
    """Equal, non-finite where non-finite (torch's CPU GELU of +Inf is NaN, its CUDA formula's is Inf); the
    interpreter's exp/erf may differ from torch's in the last bit."""
    assert torch.equal(torch.isfinite(x), torch.isfinite(y))
    x, y = x.nan_to_num(0.0, 0.0, 0.0).float(), y.nan_to_num(0.0, 0.0, 0.0).float()
    if not INTERPRET:
        assert torch.equal(x, y)
    else:
        tol = {torch.float32: 1e-5, torch.float16: 2e-3}[dtype]  # GELU: 1 + erf(x) cancels for x << 0
        assert torch.allclose(x, y, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
@pytest.mark.parametrize("shape", [(3, 10, 37), (2, 6, 600)])
def test_matches_dense_autograd_with_zero_and_nonfinite_rows(kind, shape, dtype):
    a, b, dh = _case(kind, shape, dtype, bad_rows=(1, shape[1] - 1, 2 * shape[1] - 2))
    want_h, want_g = _run(_hf(kind), a, b, dh)
    hint = RowHint()
    got_h, got_g = _run(_fn(kind, hint), a, b, dh)
    _same(got_h, want_h, dtype)
    for got, want in zip(got_g, want_g):
        _same(got, want, dtype)
    # a NaN/Inf input in a zero row of dL/dH still reaches the gradient, as in dense
    assert torch.isnan(got_g[0].view(-1, shape[-1])[shape[1] - 1]).any()


@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
def test_rows_handed_on_cover_the_nonzero_rows(kind):
    shape = (3, 10, 37)
    a, b, dh = _case(kind, shape, torch.float32, bad_rows=(shape[1] - 1,))
    hint = RowHint()
    leaves = [t.clone().requires_grad_() for t in (a, b) if t is not None]
    grads = []
    for t in leaves:
        t.register_hook(lambda g: grads.append(g) or None)
    h = _fn(kind, hint)(*leaves, *([None] if b is None else []))
    h.backward(dh)
    if not INTERPRET:  # the torch path hands nothing on
        assert hint.offered == 0 and all(hint.take(g) is None for g in grads)
        return
    assert hint.offered == len(leaves)
    for g in grads:
        perm, count = hint.take(g)
        rows = set(perm[: int(count)].tolist())
        nonzero = set(torch.nonzero(g.reshape(-1, shape[-1]).ne(0).any(1)).flatten().tolist())
        assert nonzero <= rows  # NaN counts as non-zero
        assert shape[1] - 1 in rows  # the flagged row, zero in dL/dH
        assert sorted(perm.tolist()) == list(range(shape[0] * shape[1]))
    # a modified tensor is not matched any more
    grads[0].add_(0)
    assert hint.take(grads[0]) is None


def test_hint_refuses_other_tensors():
    hint = RowHint()
    t = torch.zeros(4, 3)
    perm, count = torch.arange(4, dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    hint.offer(t, perm, count)
    assert hint.take(t)[1] is count
    assert hint.take(t.view(3, 4)) is None  # same memory, other shape
    assert hint.take(torch.zeros(4, 3)) is None
    t.mul_(2)
    assert hint.take(t) is None


@pytest.mark.parametrize("arch", ["llama", "qwen3", "bert"])
def test_patched_tiny_model_matches_dense(arch):
    from sebp_probe.model.patch import patch_activations, patch_model, patched_activations, unpatch_model
    from tests.tiny_models import padded_batch, tiny_model

    dense = tiny_model(arch)
    sebp = copy.deepcopy(dense)
    patch_model(sebp, SEBPConfig(backend=BACKEND))
    names = patch_activations(sebp)
    assert names and patched_activations(sebp) == names
    assert sebp.state_dict().keys() == dense.state_dict().keys()
    batch = padded_batch(arch)
    results = []
    for m in (dense, sebp):
        out = m(**batch)
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    (l0, g0), (l1, g1) = results
    assert_same_loss(l0, l1)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-6, msg=n)
    hints = [m._sebp_act_hint for m in sebp.modules() if "_sebp_act_hint" in vars(m)]
    per_mlp = 1 if arch == "bert" else 2  # gate and up, or the intermediate dense
    want = per_mlp if INTERPRET else 0  # the torch linears select for themselves
    assert all(h.taken == want for h in hints), [(h.offered, h.taken) for h in hints]
    assert set(unpatch_model(sebp)) >= set(names)
    assert not patched_activations(sebp)
    assert all("forward" not in vars(m) for m in sebp.modules())


def _loss_and_grads(model, batch):
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_same_loss(l0, l1):
    """The same loss, bit for bit on a GPU (SwiGLU's kernel computes silu with expf, as torch's does). Under the
    interpreter the kernel's exp is numpy's, which differs from torch's CPU one in the last bit on some CPUs
    (an AMD EPYC with AVX2: 511 of 3072 SwiGLU outputs of a 64 x 48 test, 2.4e-7 at most), so there the loss
    only agrees to 1e-6."""
    if INTERPRET:
        torch.testing.assert_close(l1, l0, rtol=1e-6, atol=0)
    else:
        assert torch.equal(l0, l1)


def _assert_same_training(dense, sebp, batch):
    (l0, g0), (l1, g1) = _loss_and_grads(dense, batch), _loss_and_grads(sebp, batch)
    assert_same_loss(l0, l1)
    assert g0.keys() == g1.keys() and g0
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-6, msg=n)


def test_lora_on_the_mlp_and_gradient_checkpointing():
    """LoRA wrappers on gate/up/down (the hint goes to their base layers; down's LoRA branch adds to dL/dH),
    and transformers' gradient checkpointing (the forward runs again in the backward)."""
    peft = pytest.importorskip("peft")
    from sebp_probe.model.patch import patch_activations, patch_model
    from tests.tiny_models import padded_batch, tiny_model

    batch = padded_batch("llama")
    dense = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(
        r=4, target_modules=["gate_proj", "up_proj", "down_proj"], init_lora_weights=False))
    sebp = copy.deepcopy(dense)
    patch_model(sebp, SEBPConfig(backend=BACKEND))
    patch_activations(sebp)
    # the last layer: the first one's gate/up need no gradient at all (frozen embeddings, no LoRA before them)
    mlp = sebp.base_model.model.model.layers[-1].mlp
    assert mlp.gate_proj.base_layer._sebp_hint is mlp._sebp_act_hint
    _assert_same_training(dense, sebp, batch)
    if INTERPRET:
        assert mlp._sebp_act_hint.taken == 2

    dense, sebp = tiny_model("llama"), tiny_model("llama")
    patch_model(sebp, SEBPConfig(backend=BACKEND))
    patch_activations(sebp)
    for m in (dense, sebp):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _assert_same_training(dense, sebp, batch)


@pytest.mark.skipif(INTERPRET, reason="CPU autocast runs the torch path")
def test_cpu_autocast_gives_hugging_faces_values():
    from sebp_probe.model.patch import patch_activations, patch_model
    from tests.tiny_models import padded_batch, tiny_model

    dense, sebp = tiny_model("llama"), tiny_model("llama")
    patch_model(sebp)
    patch_activations(sebp)
    batch = padded_batch("llama")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        l0 = dense(**batch).loss
        l1 = sebp(**batch).loss
    assert torch.equal(l0, l1)


def test_no_rows_worked_out_without_an_sebp_linear_to_read_them():
    from sebp_probe.model.patch import patch_activations, patch_model
    from tests.tiny_models import padded_batch, tiny_model

    model = tiny_model("llama")
    patch_model(model, SEBPConfig(backend=BACKEND), target_modules=["down_proj"])  # gate/up stay nn.Linear
    patch_activations(model)
    mlp = model.model.layers[0].mlp
    assert mlp._sebp_act_rows is None
    model(**padded_batch("llama")).loss.backward()
    assert mlp._sebp_act_hint.offered == 0
    patch_model(model, SEBPConfig(backend=BACKEND))  # now gate/up too: patching again hands them the rows
    patch_activations(model)
    assert mlp._sebp_act_rows is mlp._sebp_act_hint is mlp.gate_proj._sebp_hint
