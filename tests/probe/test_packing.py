"""Packed batches (sebp_probe.model.packing) give the loss and gradients of the same sequences padded, on tiny BERT,
RoBERTa (classification), Llama, Qwen2 and Qwen3 (causal LM with prompt-masked labels); attention never
crosses a sequence; the varlen backend's plumbing runs with a per-sequence sdpa in place of flash attention."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from sebp_kernels import SEBPConfig
from sebp_probe.model import packing
from sebp_probe import patch_model
from sebp_probe.data.batching import PackedCollator, PackingError, PadCollator
from sebp_probe.model.packing import attention_backend, check_packable, packed_forward, packed_loss, varlen_blocker
from tests.tiny_models import ENCODERS, tiny_config, tiny_model

ARCHS = ("bert", "roberta", "llama", "qwen2", "qwen3")
LENGTHS = (11, 4, 7, 9, 3, 12, 1, 6)
BUDGET = 16


def _task(arch: str) -> str:
    return "classification" if arch in ENCODERS else "causal-lm"


def _pad(arch: str) -> int:
    return 1 if arch == "roberta" else 0


def _items(arch: str, lengths=LENGTHS, seed: int = 0) -> list[dict]:
    """Tokenized examples as ``tokenize`` gives them: causal LM labels -100 on a prompt prefix."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, 120, (n,), generator=g).tolist()
        if arch in ENCODERS:
            out.append({"input_ids": ids, "label": int(torch.randint(0, 3, (), generator=g))})
        else:
            prompt = n // 3
            out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def _padded(arch: str, items: list[dict], counts: bool = False) -> dict:
    return PadCollator(_pad(arch), _task(arch), "longest", BUDGET, "right", counts=counts)(items)


def _packed(arch: str, items: list[dict]) -> dict:
    return PackedCollator(_pad(arch), _task(arch), BUDGET)(items)


def _grads(model, loss_fn) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(ref: tuple, got: tuple) -> None:
    """Same loss and gradients to ~1e-5 relative. A gradient that is zero in exact arithmetic (attention's key
    bias: softmax ignores a shift shared by a row) is rounding noise, so the absolute floor is a small share of
    the largest gradient."""
    (loss_r, g_r), (loss_g, g_g) = ref, got
    torch.testing.assert_close(loss_g, loss_r, rtol=1e-5, atol=0)
    assert g_r.keys() == g_g.keys() and len(g_r) > 10
    scale = max(float(g.abs().max()) for g in g_r.values())
    for k in g_r:
        torch.testing.assert_close(g_g[k], g_r[k], rtol=1e-5, atol=1e-6 * scale, msg=lambda m, k=k: f"{k}: {m}")


def reference_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                     enable_gqa=False):
    """varlen_attn's contract in pure torch: sdpa on each sequence of [T, heads, dim] tensors."""
    outs = []
    for s, e in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist()):
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1),
                                           scale=scale, is_causal=window_size == (-1, 0), enable_gqa=enable_gqa)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def reference_varlen_causal_flag(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False):
    """The same with the first releases' signature: ``is_causal``, no scale, no grouped heads."""
    assert q.shape[1] == k.shape[1]
    return reference_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, window_size=(-1, 0) if is_causal else (-1, -1))



@pytest.fixture
def flash_stand_in(monkeypatch):
    monkeypatch.setattr(packing, "VARLEN_KERNEL", reference_varlen)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend", ["mask", "varlen"])
def test_packed_loss_and_gradients_equal_padded(arch, backend, flash_stand_in):
    model, items = tiny_model(arch), _items(arch)
    padded, packed = _padded(arch, items), _packed(arch, items)
    assert packed["input_ids"].shape[0] < len(items) and packed["input_ids"].shape[1] <= BUDGET
    ref = _grads(model, lambda: model(**padded).loss)
    _assert_same(ref, _grads(model, lambda: packed_forward(model, packed, backend=backend).loss))


@pytest.mark.parametrize("arch", ["bert", "roberta", "llama", "qwen2"])
def test_packed_loss_is_the_mean_over_sequences_or_label_tokens(arch):
    """The definition, from each sequence run alone without any padding."""
    model, items = tiny_model(arch), _items(arch)

    def unpadded():
        losses, weights = [], []
        for it in items:
            ids = torch.tensor([it["input_ids"]])
            if arch in ENCODERS:
                losses.append(model(input_ids=ids, labels=torch.tensor([it["label"]])).loss)
                weights.append(1)
            else:
                labels = torch.tensor([it["labels"]])
                k = int((labels[0, 1:] != -100).sum())
                if k:
                    losses.append(model(input_ids=ids, labels=labels).loss)
                    weights.append(k)
        w = torch.tensor(weights, dtype=torch.float32)
        return (torch.stack(losses) * w).sum() / w.sum()

    _assert_same(_grads(model, unpadded), _grads(model, lambda: packed_loss(model, _packed(arch, items), _task(arch))))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend", ["mask", "varlen"])
def test_changing_one_sequence_leaves_the_other_unchanged(arch, backend, flash_stand_in):
    """Two sequences share a row; new tokens in the second change nothing of the first, in any layer."""
    model = tiny_model(arch).eval()
    a, b = _items(arch, (7, 6), seed=1)
    b2 = dict(b, input_ids=[(t + 17) % 117 + 3 for t in b["input_ids"]])
    n = len(a["input_ids"])

    def run(items):
        batch = _packed(arch, items)
        assert batch["input_ids"].shape[0] == 1 and batch["order"].tolist() == [0, 1]  # one row, a first
        with torch.no_grad():
            out = packed_forward(model, batch, backend=backend, output_hidden_states=True)
        states = [h.reshape(-1, h.shape[-1]) for h in out.hidden_states]
        logits = out.logits if arch in ENCODERS else out.logits.reshape(-1, out.logits.shape[-1])
        return states, logits

    (s1, l1), (s2, l2) = run([a, b]), run([a, b2])
    for h1, h2 in zip(s1, s2):
        torch.testing.assert_close(h2[:n], h1[:n], rtol=1e-6, atol=1e-6)
    first, second = (slice(0, 1), slice(1, 2)) if arch in ENCODERS else (slice(0, n), slice(n, None))
    torch.testing.assert_close(l2[first], l1[first], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(l2[second], l1[second])  # the change did reach the second sequence


@pytest.mark.parametrize("arch", ["bert", "llama", "qwen2"])
def test_varlen_on_a_kernel_without_scale_or_grouped_heads(arch, monkeypatch):
    """Older varlen_attn: causality as a flag, key/value heads repeated for grouped-query attention."""
    monkeypatch.setattr(packing, "VARLEN_KERNEL", reference_varlen_causal_flag)
    model, items = tiny_model(arch), _items(arch)
    ref = _grads(model, lambda: model(**_padded(arch, items)).loss)
    _assert_same(ref, _grads(model, lambda: packed_forward(model, _packed(arch, items), backend="varlen").loss))


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_padded_batches_are_unchanged_once_varlen_is_enabled(arch, flash_stand_in):
    model, items = tiny_model(arch), _items(arch)
    for side in ("right", "left"):
        padded = PadCollator(_pad(arch), _task(arch), "longest", BUDGET, side)(items)
        before = model(**padded).loss
        packed_forward(model, _packed(arch, items), backend="varlen")
        assert model.config._attn_implementation == packing.VARLEN
        assert torch.equal(model(**padded).loss, before)


@pytest.mark.parametrize("arch", ["bert", "roberta", "llama"])
def test_packed_under_lora(arch):
    from peft import LoraConfig, get_peft_model

    targets = ["query", "value"] if arch in ENCODERS else ["q_proj", "v_proj"]
    lcfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False,
                      task_type="SEQ_CLS" if arch in ENCODERS else "CAUSAL_LM")
    model, items = get_peft_model(tiny_model(arch), lcfg), _items(arch)
    ref = _grads(model, lambda: model(**_padded(arch, items)).loss)
    got = _grads(model, lambda: packed_loss(model, _packed(arch, items), _task(arch)))
    assert len(ref[1]) < 20  # only the adapters (and the classifier) train
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=0)
    for k in ref[1]:
        torch.testing.assert_close(got[1][k], ref[1][k], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("arch", ["bert", "roberta", "llama"])
def test_packed_under_sebp_exact(arch):
    model, items = tiny_model(arch), _items(arch)
    patch_model(model, SEBPConfig("exact"))
    ref = _grads(model, lambda: model(**_padded(arch, items)).loss)
    _assert_same(ref, _grads(model, lambda: packed_loss(model, _packed(arch, items), _task(arch))))


@pytest.mark.parametrize("arch", ["bert", "roberta", "llama"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_under_autocast_and_eager_attention(arch, impl):
    model, items = tiny_model(arch), _items(arch)
    model.set_attn_implementation(impl)
    padded, packed = _padded(arch, items), _packed(arch, items)
    _assert_same(_grads(model, lambda: model(**padded).loss), _grads(model, lambda: packed_forward(model, packed).loss))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, got = model(**padded).loss, packed_forward(model, packed).loss
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("backend", ["mask", "varlen"])
def test_labelled_rows_head_on_packed_batches(arch, backend, flash_stand_in, monkeypatch):
    """labelled_loss on a packed batch: the head and the last layer on the labelled rows only
    (varlen: the kept queries masked to their own sequence), same loss and gradients as the padded model."""
    from sebp_probe.model.losses import labelled_loss

    monkeypatch.setattr(packing, "attention_backend", lambda model: backend)
    model, items = tiny_model(arch), _items(arch)
    ref = _grads(model, lambda: model(**_padded(arch, items)).loss)
    _assert_same(ref, _grads(model, lambda: labelled_loss(model, _packed(arch, items))))
    _assert_same(ref, _grads(model, lambda: labelled_loss(model, _padded(arch, items))))


def test_labelled_rows_head_refuses_packed_classifiers():
    from sebp_probe.model.heads import HeadError
    from sebp_probe.model.losses import labelled_loss

    with pytest.raises(HeadError, match="padded batches only"):
        labelled_loss(tiny_model("bert"), _packed("bert", _items("bert")))


def test_varlen_refuses_a_max_seqlen_on_the_device(flash_stand_in):
    """Reading it would wait for the device (and break a compiled graph): the collator's int is the contract."""
    batch = _packed("llama", _items("llama"))
    batch["max_seqlen"] = torch.tensor(batch["max_seqlen"])
    with pytest.raises(PackingError, match="^a packed batch's max_seqlen must be a Python int"):
        packed_forward(tiny_model("llama"), batch, backend="varlen")


def test_backend_is_the_mask_off_cuda():
    for arch in ("llama", "bert"):
        assert attention_backend(tiny_model(arch)) == "mask"
        assert varlen_blocker(tiny_model(arch).config, "cpu", torch.bfloat16, True) == (
            "flash attention's varlen kernel needs a CUDA GPU")


def _config(arch: str, **kw):
    cfg = tiny_config(arch)
    cfg._attn_implementation = "sdpa"
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


@pytest.mark.parametrize("arch", ARCHS)
def test_varlen_is_chosen_for_encoders_and_decoders_where_it_runs_exactly(arch):
    """The decision on a CUDA device (the kernel can run on these configs): varlen in bf16/fp16, the mask in
    fp32, with eager attention, or while attention dropout trains (varlen_attn has no dropout), in any
    family; in eval mode dropout is off and varlen runs again."""
    drop = "attention_probs_dropout_prob" if arch in ENCODERS else "attention_dropout"
    for dtype in (torch.bfloat16, torch.float16):
        assert varlen_blocker(_config(arch), "cuda", dtype, training=True) is None
    assert "bf16 or fp16, not float32" in varlen_blocker(_config(arch), "cuda", torch.float32, True)
    assert "not 'eager'" in varlen_blocker(_config(arch, _attn_implementation="eager"), "cuda", torch.bfloat16, True)
    assert varlen_blocker(_config(arch, **{drop: 0.1}), "cuda", torch.bfloat16, training=True) == (
        "varlen_attn has no attention dropout (the model trains with 0.1)")
    assert varlen_blocker(_config(arch, **{drop: 0.1}), "cuda", torch.bfloat16, training=False) is None


def test_varlen_is_not_chosen_without_the_kernel_or_with_a_sliding_window(monkeypatch):
    from transformers import MistralConfig

    mistral = MistralConfig(hidden_size=32, num_attention_heads=4, sliding_window=6)
    mistral._attn_implementation = "sdpa"
    assert varlen_blocker(mistral, "cuda", torch.bfloat16, False) == "varlen attention runs no sliding window"
    mistral.sliding_window = None
    assert varlen_blocker(mistral, "cuda", torch.bfloat16, False) is None
    monkeypatch.setattr(packing, "VARLEN_KERNEL", None)
    assert varlen_blocker(_config("bert"), "cuda", torch.bfloat16, False) == (
        "this torch has no torch.nn.attention.varlen")


@pytest.mark.parametrize("arch", ARCHS)
def test_varlen_runs_encoders_in_both_directions_and_decoders_causally(arch, monkeypatch):
    """What the kernel is asked for: full attention per sequence for BERT/RoBERTa (as their padded sdpa runs),
    causal for decoders, once per layer, and never an attention mask."""
    calls = []

    @functools.wraps(reference_varlen)  # the same signature: scale, window_size and grouped heads
    def spy(*args, **kw):
        calls.append(kw.get("window_size"))
        return reference_varlen(*args, **kw)

    monkeypatch.setattr(packing, "VARLEN_KERNEL", spy)
    model = tiny_model(arch)
    packed_forward(model, _packed(arch, _items(arch)), backend="varlen")
    want = (-1, -1) if arch in ENCODERS else (-1, 0)
    assert calls == [want] * model.config.num_hidden_layers


def test_unsupported_models_are_refused_in_one_line():
    from transformers import AutoModelForSequenceClassification, DistilBertConfig

    distil = AutoModelForSequenceClassification.from_config(DistilBertConfig(
        vocab_size=120, dim=32, n_layers=1, n_heads=4, hidden_dim=40, max_position_embeddings=64))
    for model, task in ((distil, "classification"), (tiny_model("bert"), "causal-lm")):
        with pytest.raises(PackingError) as e:
            check_packable(model, task)
        msg = str(e.value)
        assert "\n" not in msg and "--padding bucket, longest or max_length" in msg
    with pytest.raises(PackingError, match="DistilBertForSequenceClassification"):
        packed_loss(distil, {}, "classification")


def test_varlen_refuses_attention_dropout(flash_stand_in):
    cfg = tiny_config("bert")
    cfg.attention_probs_dropout_prob = 0.1
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_config(cfg).train()
    with pytest.raises(PackingError, match="dropout"):
        packed_forward(model, _packed("bert", _items("bert")), backend="varlen")


# ------------------------------------------------------------------------------------------------- GPU


def _cuda_pair(arch: str, dtype=torch.bfloat16):
    model = tiny_model(arch).to("cuda", dtype)
    items = _items(arch, (37, 5, 20, 64, 9, 50, 33, 2))
    pad = PadCollator(_pad(arch), _task(arch), "longest", 64, "right")(items)
    pack = PackedCollator(_pad(arch), _task(arch), 64)(items)
    to = lambda b: {k: v.cuda() if torch.is_tensor(v) else v for k, v in b.items()}  # noqa: E731
    return model, to(pad), to(pack)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["bert", "roberta", "llama", "qwen2", "qwen3"])
def test_flash_varlen_matches_padded_in_bf16(arch):
    """The real varlen_attn (flash attention) against the padded model (sdpa), both in bf16."""
    if packing.VARLEN_KERNEL is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    model, padded, packed = _cuda_pair(arch)
    assert attention_backend(model) == "varlen"
    loss_r, g_r = _grads(model, lambda: model(**padded).loss)
    loss_v, g_v = _grads(model, lambda: packed_forward(model, packed).loss)
    assert model.config._attn_implementation == packing.VARLEN
    torch.testing.assert_close(loss_v.float(), loss_r.float(), rtol=2e-2, atol=0)
    scale = max(float(g.float().abs().max()) for g in g_r.values())
    for k in g_r:
        diff = float((g_v[k].float() - g_r[k].float()).abs().max())
        assert diff <= 0.05 * scale, f"{k}: {diff} vs largest gradient {scale}"
    # padded batches after the switch still run sdpa with their masks
    torch.testing.assert_close(model(**padded).loss.float(), loss_r.float(), rtol=1e-3, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_flash_varlen_under_autocast(arch):
    model, padded, packed = _cuda_pair(arch, torch.float32)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert attention_backend(model) == "varlen"
        ref = model(**padded).loss
        got = packed_forward(model, packed).loss
    got.backward()
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_mask_backend_on_cuda_in_fp32(arch):
    model, padded, packed = _cuda_pair(arch, torch.float32)
    assert attention_backend(model) == "mask"
    _assert_same(_grads(model, lambda: model(**padded).loss), _grads(model, lambda: packed_forward(model, packed).loss))

