"""The last layer on the kept rows only: loss and every gradient equal to the full model's (fp64 to round-off,
fp32 and bf16 within the model's own error), for decoders (causal LM), BERT/RoBERTa masked LM and [CLS]
classification, under sdpa and eager attention, padding on either side, packed batches, LoRA, checkpointing."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from sebp_probe.model.heads import HeadError, head_loss
from sebp_probe.model.last_layer import KeptRows, LastLayerError, last_layer, last_layer_on_rows
from tests.helpers import assert_within_torch_error
from tests.probe.test_heads import (assert_like_model, assert_rel, causal_model, loss_and_grads, mlm_batch,
                                   mlm_model, reference_loss)
from tests.tiny_models import DECODERS, padded_batch, tiny_model


@contextlib.contextmanager
def rows_through_mlp(layer):
    """Records the number of rows the layer's MLP (decoders) or intermediate (encoders) computes."""
    seen = []
    mlp = getattr(layer, "mlp", None) or layer.intermediate
    handle = mlp.register_forward_hook(lambda m, args, out: seen.append(args[0].reshape(-1, args[0].shape[-1])
                                                                         .shape[0]))
    try:
        yield seen
    finally:
        handle.remove()


def _exact(model, got_g, want_g):
    for (name, _), a, e in zip(model.named_parameters(), got_g, want_g):
        assert_rel(a, e, 1e-10, name, atol=1e-15)


@pytest.mark.parametrize("arch", DECODERS)
@pytest.mark.parametrize("side,impl", [("right", "sdpa"), ("left", "sdpa"), ("right", "eager")])
def test_decoder_fp64_exact(arch, side, impl):
    model = causal_model(arch, tied=arch == "qwen3", dtype=torch.float64)
    model.config._attn_implementation = impl
    batch = padded_batch(arch, side=side)
    want, want_g = loss_and_grads(model, lambda m: reference_loss(m, batch, "causal-lm"))
    labelled = int((batch["labels"][:, 1:] != -100).sum())
    with rows_through_mlp(last_layer(model.model)) as seen:
        got, got_g = loss_and_grads(model, lambda m: head_loss(m, batch, last_layer_rows_only=True).loss)
    assert seen == [labelled]
    assert_rel(got, want, 1e-12, "loss")
    _exact(model, got_g, want_g)


@pytest.mark.parametrize("arch", DECODERS)
def test_decoder_fp32_and_bf16_match_the_model(arch):
    model = causal_model(arch)
    batch = padded_batch(arch, side="left")
    want, want_g = loss_and_grads(copy.deepcopy(model).double(), lambda m: reference_loss(m, batch, "causal-lm"))
    hf, hf_g = loss_and_grads(model, lambda m: m(**batch).loss)
    got, got_g = loss_and_grads(model, lambda m: head_loss(m, batch, last_layer_rows_only=True).loss)
    assert_like_model(got, hf, want, "loss")
    for (name, _), a, t, e in zip(model.named_parameters(), got_g, hf_g, want_g):
        assert_like_model(a, t, e, name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hf, hf_g = loss_and_grads(model, lambda m: m(**batch).loss)
        got, got_g = loss_and_grads(model, lambda m: head_loss(m, batch, last_layer_rows_only=True).loss)
    assert_within_torch_error(got, want, hf, torch.bfloat16, "bf16 loss")
    for (name, _), a, t, e in zip(model.named_parameters(), got_g, hf_g, want_g):
        assert_within_torch_error(a, e, t, torch.bfloat16, name)


def test_unpadded_packed_and_checkpointed():
    """No padding (sdpa gets no mask: the causal mask is built), two sequences packed by position_ids, and
    gradient checkpointing."""
    model = causal_model("llama", dtype=torch.float64)
    batch = padded_batch("llama", lengths=(7, 7))
    want, want_g = loss_and_grads(model, lambda m: head_loss(m, batch).loss)
    got, got_g = loss_and_grads(model, lambda m: head_loss(m, batch, last_layer_rows_only=True).loss)
    assert_rel(got, want, 1e-12, "unpadded loss")
    _exact(model, got_g, want_g)
    ids = torch.randint(3, 120, (1, 15), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[0, :3] = labels[0, 8] = -100
    packed = {"input_ids": ids, "labels": labels, "position_ids": torch.cat([torch.arange(8), torch.arange(7)])[None]}
    want, want_g = loss_and_grads(model, lambda m: head_loss(m, packed).loss)
    model.gradient_checkpointing_enable()
    got, got_g = loss_and_grads(model, lambda m: head_loss(m, packed, last_layer_rows_only=True).loss)
    assert_rel(got, want, 1e-12, "packed loss")
    _exact(model, got_g, want_g)


def test_a_checkpointed_last_layer_runs_unchecked_on_kept_rows():
    """Gradient checkpointing (SFTConfig's default): the last layer is not checkpointed while it computes the
    kept rows (its recomputation would come after the block), and is again after it; the gradients are the
    model's."""
    model = causal_model("llama", dtype=torch.float64)
    batch = padded_batch("llama", side="right")
    want, want_g = loss_and_grads(model, lambda m: reference_loss(m, batch, "causal-lm"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layer = last_layer(model.model)
    seen = []
    layer.register_forward_pre_hook(lambda m, args: seen.append(m.gradient_checkpointing))
    got, got_g = loss_and_grads(model, lambda m: head_loss(m, batch, last_layer_rows_only=True).loss)
    assert seen == [False] and layer.gradient_checkpointing
    assert_rel(got, want, 1e-12, "loss")
    _exact(model, got_g, want_g)


def test_lora_in_the_last_layer():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(causal_model("qwen2"), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "o_proj", "gate_proj"], task_type="CAUSAL_LM"))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    batch = padded_batch("qwen2", side="left")
    hf, hf_g = loss_and_grads(model, lambda m: m(**batch).loss)
    got, got_g = loss_and_grads(model, lambda m: head_loss(m, batch, last_layer_rows_only=True).loss)
    assert_rel(got, hf, 1e-6, "loss")
    for a, t in zip(got_g, hf_g):
        assert_rel(a, t, 2e-6, "lora grad")


@pytest.mark.parametrize("arch", ["bert", "roberta"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_mlm_fp64_exact(arch, impl):
    model = mlm_model(arch, dtype=torch.float64)
    model.config._attn_implementation = impl
    batch = mlm_batch(arch, side="left")
    want, want_g = loss_and_grads(model, lambda m: reference_loss(m, batch, "mlm"))
    with rows_through_mlp(last_layer(model.base_model)) as seen:
        got, got_g = loss_and_grads(model, lambda m: head_loss(m, batch, "mlm", last_layer_rows_only=True).loss)
    assert seen == [int((batch["labels"] != -100).sum())]
    assert_rel(got, want, 1e-12, "loss")
    _exact(model, got_g, want_g)


@pytest.mark.parametrize("arch", ["bert", "roberta"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_classification_cls_rows_fp64_exact(arch, impl):
    model = tiny_model(arch).double()
    model.config._attn_implementation = impl
    batch = padded_batch(arch)
    want, want_g = loss_and_grads(model, lambda m: m(**batch).loss)
    with rows_through_mlp(last_layer(model.base_model)) as seen:
        out = head_loss(model, batch, "classification", last_layer_rows_only=True)
        got_g = torch.autograd.grad(out.loss, list(model.parameters()))
    assert seen == [3] and out.labelled == 3  # one [CLS] row per sequence
    assert_rel(out.loss, want, 1e-12, "loss")
    _exact(model, got_g, want_g)


def test_no_labelled_row():
    model = causal_model("qwen3", tied=True)
    batch = padded_batch("qwen3")
    batch["labels"][:] = -100
    out = head_loss(model, batch, last_layer_rows_only=True)
    out.loss.backward()
    assert out.labelled == 0 and out.loss.item() == 0.0
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters() if p.grad is not None)


def test_refusals_leave_the_layer_as_it_was():
    model = causal_model("llama")
    batch = padded_batch("llama")
    layer = last_layer(model.model)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(LastLayerError, match="^the kept-rows last layer needs attention 'sdpa', 'eager' or varlen"):
        head_loss(model, batch, last_layer_rows_only=True)
    model.config._attn_implementation = "sdpa"
    kept = KeptRows.from_rows(torch.tensor([1, 2]), 3, 11)
    assert "forward" not in vars(layer)  # the refusal installed nothing
    with torch.no_grad():
        want = model(**batch).logits
    with pytest.raises(RuntimeError, match="boom"), last_layer_on_rows(model.model, kept):
        assert layer._sebp_kept[1] is kept
        raise RuntimeError("boom")
    assert layer._sebp_kept is None
    with torch.no_grad():  # the layer's own forward again: every row
        torch.testing.assert_close(model(**batch).logits, want, rtol=0, atol=0)
    with pytest.raises(HeadError, match="the Llama entry has no kept-rows encoder layer"):
        head_loss(tiny_model("llama"), batch, "classification", last_layer_rows_only=True)


@pytest.mark.parametrize("most", [None, 3])
def test_kept_rows_layout(most):
    """``most`` given (the caller's count) or counted: the same layout."""
    kept = KeptRows.from_rows(torch.tensor([1, 2, 4, 13, 20]), batch=3, length=7, most=most)
    assert kept.pos.tolist() == [[1, 2, 4], [6, 0, 0], [6, 0, 0]]
    assert kept.valid.tolist() == [[True] * 3, [True, False, False], [True, False, False]]
    assert kept.slots.tolist() == [0, 1, 2, 3, 6]
    x = torch.arange(21.0).view(3, 7, 1)
    assert kept.from_slots(kept.queries(x)).flatten().tolist() == [1, 2, 4, 13, 20]
    assert kept.of(x).flatten().tolist() == [1, 2, 4, 13, 20]
    with pytest.raises(ValueError, match="^the most kept rows in one sequence are 3, not the 2 given$"):
        KeptRows.from_rows(torch.tensor([1, 2, 4, 13, 20]), batch=3, length=7, most=2)


def test_an_in_place_rotary_function_is_not_handed_one_tensor_twice(monkeypatch):
    """Liger-Kernel's rotary kernel rotates queries and keys in place; the kept-rows layer calls the model's
    rotary function once for its queries and once for the keys, and must not pass one tensor as both."""
    import transformers.models.llama.modeling_llama as llama

    own = llama.apply_rotary_pos_emb

    def in_place(q, k, cos, sin, *args, **kwargs):  # the queries, then the keys, each stored where it was read
        q.copy_(own(q, q, cos, sin, *args, **kwargs)[0])
        k.copy_(own(k, k, cos, sin, *args, **kwargs)[1])
        return q, k

    model = causal_model("llama", dtype=torch.float64)
    batch = padded_batch("llama", side="right")
    monkeypatch.setattr(llama, "apply_rotary_pos_emb", in_place)
    want, want_g = loss_and_grads(model, lambda m: reference_loss(m, batch, "causal-lm"))
    got, got_g = loss_and_grads(model, lambda m: head_loss(m, batch, last_layer_rows_only=True).loss)
    assert_rel(got, want, 1e-12, "loss")
    _exact(model, got_g, want_g)


def test_without_cudnn_attention_leaves_sdpa_the_other_kernels():
    from sebp_probe.model.sdpa import without_cudnn_attention

    before = torch.backends.cuda.cudnn_sdp_enabled()
    with without_cudnn_attention():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


@pytest.mark.gpu
@pytest.mark.parametrize("arch", DECODERS)
def test_cuda_head_path_within_the_model_error(arch):
    """On a GPU (its sdpa kernels, the fp32 dW sum of several chunks): fp32 and bf16 autocast within twice the
    model's own error against fp64, with and without the kept-rows last layer."""
    model = causal_model(arch, tied=arch != "llama").cuda()
    batch = {k: v.cuda() for k, v in padded_batch(arch, lengths=(40, 23, 31), side="left").items()}
    want, want_g = loss_and_grads(copy.deepcopy(model).double(), lambda m: reference_loss(m, batch, "causal-lm"))
    for autocast in (False, True):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            hf, hf_g = loss_and_grads(model, lambda m: m(**batch).loss)
            for rows_only in (False, True):
                got, got_g = loss_and_grads(model, lambda m: head_loss(m, batch, chunk_rows=16,
                                                                         last_layer_rows_only=rows_only).loss)
                check = ((lambda a, t, e, n: assert_within_torch_error(a, e, t, torch.bfloat16, n)) if autocast
                         else assert_like_model)
                check(got, hf, want, "loss")
                for (name, _), a, t, e in zip(model.named_parameters(), got_g, hf_g, want_g):
                    check(a, t, e, name)


@pytest.mark.parametrize("padding,cudnn", [("longest", False), ("auto", False), ("max_length", True)])
def test_finetune_runs_without_cudnn_attention(monkeypatch, padding, cudnn):
    """``finetune`` runs its whole run (calibration, --padding auto's timings, training) with sdpa off cuDNN's
    attention where batch shapes change, leaves sdpa its choice where they do not (``max_length``: cuDNN plans
    once), and gives the process its flags back."""
    import dataclasses

    import sebp_probe.train.finetune as ft
    from sebp_probe.config import FinetuneConfig

    seen = []
    monkeypatch.setattr(ft, "_finetune", lambda *a, **k: seen.append(torch.backends.cuda.cudnn_sdp_enabled()) or {})
    cfg = FinetuneConfig()
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, padding=padding))
    before = torch.backends.cuda.cudnn_sdp_enabled()
    assert ft.finetune(cfg) == {}
    assert seen == [cudnn and before] and torch.backends.cuda.cudnn_sdp_enabled() == before
