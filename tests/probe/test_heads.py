"""head_loss against the model's own loss: fp64 exact against the fp64 logits' cross-entropy, fp32 against
``model(**batch).loss`` (within 1e-6 relative plus twice the model's own fp32 error), bf16 autocast within twice
the dense path's error; tied and untied heads, left and right padding, LoRA, packed batches, masked LM."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

from sebp_probe.model.heads import HeadError, head_loss
from sebp_probe.data.mlm import mask_tokens
from tests.helpers import assert_within_torch_error
from tests.tiny_models import DECODERS, padded_batch, tiny_config

REL = 1e-6


def causal_model(arch: str, tied: bool = False, seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = tiny_config(arch)
    cfg.tie_word_embeddings = tied
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    return model.train()


def mlm_model(arch: str, seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    return AutoModelForMaskedLM.from_config(tiny_config(arch)).to(dtype).train()


def mlm_batch(arch: str, side: str = "right", seed: int = 0):
    b = padded_batch(arch, side=side, seed=seed)
    special = (0, 1, 2)  # the tiny batches draw real tokens from [3, 120)
    ids, labels = mask_tokens(b["input_ids"], mask_token_id=2, vocab_size=120, special_ids=special,
                              attention_mask=b["attention_mask"], generator=torch.Generator().manual_seed(seed),
                              probability=0.3)
    labels[0, 1] = ids[0, 1] = b["input_ids"][0, 1]  # at least one label
    return {**b, "input_ids": ids, "labels": labels}


def reference_loss(model, batch, task):
    """F.cross_entropy on the model's own logits in their dtype (HF's causal loss casts them to fp32)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    labels = batch["labels"]
    if task == "causal-lm":
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def loss_and_grads(model, fn):
    params = [p for p in model.parameters() if p.requires_grad]
    loss = fn(model)
    return loss.detach(), torch.autograd.grad(loss, params, allow_unused=True)


def assert_rel(got, want, rel, name, atol=0.0):
    """Max error at most ``rel`` of the largest magnitude (plus ``atol``: a key bias' gradient is zero in exact
    arithmetic, round-off in fp64)."""
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    assert err <= rel * scale + atol, f"{name}: max error {err:.3g} > {rel} x {scale:.3g} + {atol}"


def assert_like_model(got, model_fp32, ref64, name):
    """|got - ref64| <= 2 |model's fp32 - ref64| + 1e-6 |ref64| (max over elements)."""
    err = (got.double() - ref64).abs().max().item()
    own = (model_fp32.double() - ref64).abs().max().item()
    bound = 2 * own + REL * ref64.abs().max().item()
    assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g} (the model's own fp32 error {own:.3g})"


@pytest.mark.parametrize("arch", DECODERS)
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("side", ["right", "left"])
def test_causal_fp64_exact(arch, tied, side):
    model = causal_model(arch, tied, dtype=torch.float64)
    batch = padded_batch(arch, side=side)
    want, want_g = loss_and_grads(model, lambda m: reference_loss(m, batch, "causal-lm"))
    out = head_loss(model, batch, "causal-lm", chunk_rows=4)
    got_g = torch.autograd.grad(out.loss, [p for p in model.parameters() if p.requires_grad])
    assert out.labelled == int((batch["labels"][:, 1:] != -100).sum())
    assert_rel(out.loss, want, 1e-12, "loss")
    for (name, _), a, e in zip(model.named_parameters(), got_g, want_g):
        assert_rel(a, e, 1e-10, name, atol=1e-15)


@pytest.mark.parametrize("arch", DECODERS)
@pytest.mark.parametrize("tied", [False, True])
def test_causal_fp32_matches_model_loss(arch, tied):
    model = causal_model(arch, tied)
    batch = padded_batch(arch)
    ref64 = copy.deepcopy(model).double()
    want, want_g = loss_and_grads(ref64, lambda m: reference_loss(m, batch, "causal-lm"))
    hf, hf_g = loss_and_grads(model, lambda m: m(**batch).loss)
    got, got_g = loss_and_grads(model, lambda m: head_loss(m, batch, "causal-lm").loss)
    assert got.dtype == torch.float32
    assert_like_model(got, hf, want, "loss")
    for (name, _), a, t, e in zip(model.named_parameters(), got_g, hf_g, want_g):
        assert_like_model(a, t, e, name)


@pytest.mark.parametrize("arch", DECODERS)
def test_causal_bf16_autocast_within_dense_error(arch):
    model = causal_model(arch, tied=arch == "qwen2")
    batch = padded_batch(arch)
    want, want_g = loss_and_grads(copy.deepcopy(model).double(), lambda m: reference_loss(m, batch, "causal-lm"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hf, hf_g = loss_and_grads(model, lambda m: m(**batch).loss)
        got, got_g = loss_and_grads(model, lambda m: head_loss(m, batch, "causal-lm", chunk_rows=8).loss)
    assert_within_torch_error(got, want, hf, torch.bfloat16, "loss")
    for (name, _), a, t, e in zip(model.named_parameters(), got_g, hf_g, want_g):
        assert_within_torch_error(a, e, t, torch.bfloat16, name)


def test_lora_peft_model():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(causal_model("llama"), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM"))
    for n, p in model.named_parameters():  # LoRA's B starts at zero: give it values so every path is tested
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    batch = padded_batch("llama", side="left")
    hf, hf_g = loss_and_grads(model, lambda m: m(**batch).loss)
    got, got_g = loss_and_grads(model, lambda m: head_loss(m, batch, "causal-lm").loss)
    assert len(got_g) == sum(1 for n, _ in model.named_parameters() if "lora_" in n)
    assert_rel(got, hf, REL, "loss")
    for a, t in zip(got_g, hf_g):
        assert_rel(a, t, 2 * REL, "lora grad")


def test_packed_batch_with_position_ids():
    """Two sequences in one row, told apart by position_ids alone (no attention_mask): the loss of the two
    sequences run apart. (``model(**batch)`` with the config's use_cache=True builds no packed mask and lets the
    second sequence attend to the first; the head path passes use_cache=False, so the reference does too.)"""
    model = causal_model("qwen3")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 120, (1, 17), generator=g)
    position_ids = torch.cat([torch.arange(9), torch.arange(8)])[None]
    labels = ids.clone()
    labels[0, 9] = -100  # the second sequence's first token is not predicted from the first sequence
    labels[0, :3] = -100  # a prompt
    batch = {"input_ids": ids, "position_ids": position_ids, "labels": labels}
    hf, hf_g = loss_and_grads(model, lambda m: m(**batch, use_cache=False).loss)
    got, got_g = loss_and_grads(model, lambda m: head_loss(m, batch).loss)
    assert_rel(got, hf, REL, "loss")
    for a, t in zip(got_g, hf_g):
        assert_rel(a, t, 2 * REL, "grad")
    apart = [model(input_ids=ids[:, s], labels=labels[:, s], num_items_in_batch=13).loss
             for s in (slice(0, 9), slice(9, 17))]
    assert_rel(got, sum(apart), REL, "sequences apart")


def test_num_items_and_shift_labels():
    model = causal_model("llama")
    batch = padded_batch("llama")
    hf = model(**batch, num_items_in_batch=40).loss
    got = head_loss(model, batch, num_items_in_batch=40).loss
    assert_rel(got, hf, REL, "num_items_in_batch")
    shifted = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    got = head_loss(model, {**batch, "labels": None, "shift_labels": shifted}).loss
    assert_rel(got, model(**batch).loss, REL, "shift_labels")


def test_batch_without_labelled_token():
    model = causal_model("llama", tied=True)
    batch = padded_batch("llama")
    batch["labels"][:, 1:] = -100
    out = head_loss(model, batch)
    out.loss.backward()
    assert out.labelled == 0 and out.loss.item() == 0.0
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters() if p.grad is not None)


def test_refuses_heads_it_cannot_compute():
    model = causal_model("llama")
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(HeadError, match=r"^LlamaForCausalLM transforms its logits \(final_logit_softcapping"):
        head_loss(model, padded_batch("llama"))
    with pytest.raises(HeadError, match="^the linear head path takes task causal-lm or mlm, not 'seq2seq'$"):
        head_loss(causal_model("llama"), padded_batch("llama"), "seq2seq")
    with pytest.raises(HeadError, match="masked-LM heads of BERT, RoBERTa, ELECTRA, DistilBERT and ModernBERT only"):
        head_loss(causal_model("llama"), padded_batch("llama"), "mlm")
    peft = pytest.importorskip("peft")
    lora_head = peft.get_peft_model(causal_model("llama"), peft.LoraConfig(r=2, target_modules=["lm_head"]))
    with pytest.raises(HeadError, match="plain nn.Linear"):
        head_loss(lora_head, padded_batch("llama"))


@pytest.mark.parametrize("arch", ["bert", "roberta"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_mlm_fp64_exact(arch, side):
    model = mlm_model(arch, dtype=torch.float64)
    batch = mlm_batch(arch, side)
    want, want_g = loss_and_grads(model, lambda m: reference_loss(m, batch, "mlm"))
    got, got_g = loss_and_grads(model, lambda m: head_loss(m, batch, "mlm", chunk_rows=3).loss)
    assert_rel(got, want, 1e-12, "loss")
    for (name, _), a, e in zip(model.named_parameters(), got_g, want_g):
        assert_rel(a, e, 1e-10, name, atol=1e-15)


@pytest.mark.parametrize("arch", ["bert", "roberta"])
def test_mlm_fp32_matches_model_loss(arch):
    model = mlm_model(arch)
    batch = mlm_batch(arch)
    want, want_g = loss_and_grads(copy.deepcopy(model).double(), lambda m: reference_loss(m, batch, "mlm"))
    hf, hf_g = loss_and_grads(model, lambda m: m(**batch).loss)
    got, got_g = loss_and_grads(model, lambda m: head_loss(m, batch, "mlm").loss)
    assert_like_model(got, hf, want, "loss")
    for (name, _), a, t, e in zip(model.named_parameters(), got_g, hf_g, want_g):
        assert_like_model(a, t, e, name)


def test_training_and_held_out_losses_build_no_kv_cache():
    """A causal LM's training loss and held-out forward run without a KV cache (under torch.compile the cache's
    per-layer state would recompile the decoder layer's graph for every layer)."""
    from accelerate import Accelerator

    from sebp_probe.model.losses import FULL
    from sebp_probe.train.metrics import evaluate
    from tests.tiny_models import tiny_model

    model = tiny_model("llama")
    batch = padded_batch("llama")
    seen = []
    model.model.layers[0].register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs.get("cache", kwargs.get("past_key_values"))), with_kwargs=True)
    FULL.loss(model, batch).backward()
    evaluate(model, [batch], Accelerator(cpu=True), "causal-lm")
    assert len(seen) == 2 and seen == [None, None]


@pytest.mark.parametrize("arch, last_layer", [("llama", False), ("llama", True), ("gemma2", False)])
def test_a_bad_label_with_the_checks_held_raises_at_the_check_not_in_a_kernel(arch, last_layer):
    """Inside label_checks.deferred() (the training loop's step) a label past the vocabulary reaches no kernel:
    the head runs on the rows as counted, with that label as class 0, and the one-line error comes at the
    check; the same batch with good labels gives the eager head's loss. Gemma 2: the soft-capped head, whose
    cross-entropy is torch's, not linear_cross_entropy."""
    from sebp_kernels import label_checks
    from sebp_probe.data.batching import target_counts
    from tests.tiny_models import family_model

    model = causal_model(arch) if arch == "llama" else family_model(arch, "causal-lm")
    batch = padded_batch("llama")  # token ids below 120: in every tiny vocabulary
    counts = target_counts(batch["labels"])
    targets = (counts["n_targets"], counts["max_row_targets"])
    want = head_loss(model, batch, last_layer_rows_only=last_layer).loss
    with label_checks.deferred() as checks:
        got = head_loss(model, batch, last_layer_rows_only=last_layer, targets=targets).loss
        checks.check()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    bad = {**batch, "labels": batch["labels"].clone()}
    at = tuple((bad["labels"][:, 1:] != -100).nonzero()[0] + torch.tensor([0, 1]))
    vocab = model.get_output_embeddings().out_features
    bad["labels"][at] = vocab + 7
    with pytest.raises(ValueError, match=rf"^label {vocab + 7} is outside \[0, {vocab}\) \(and is not ignore_index -100\)$"):
        with label_checks.deferred():
            loss = head_loss(model, bad, last_layer_rows_only=last_layer, targets=targets).loss
            loss.backward()
            assert torch.isfinite(loss)


# ------------------------------------------------------------- several processes: through the model's own forward


@pytest.mark.parametrize("layout", ["longest", "packed"])
def test_through_the_models_forward_the_labelled_positions_give_its_loss(layout):
    """``forward_kept_loss`` (the labelled head of several processes, through the model's own forward with
    ``logits_to_keep``): the model's own loss and gradients on padded and packed batches, the output layer on
    the labelled positions only; a Trainer's accumulated step; a batch without a label gives 0."""
    from sebp_probe.bench import bench_cases, bench_model
    from sebp_probe.bench.bench_cases import MODEL_CASES
    from sebp_probe.model import losses
    from sebp_probe.model.heads import forward_kept_loss

    case = bench_cases.tiny(MODEL_CASES["llama-3.2-1b-sft"])
    model = bench_model.build_model(case, torch.float32, torch.device("cpu"))
    batches, _ = bench_model._pool(case, model.config, 1, 0, "mask", True)
    batch = batches[layout][0]
    def run(fn):
        model.zero_grad(set_to_none=True)
        loss = fn()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    rows = []
    hook = model.lm_head.register_forward_hook(lambda m, a, o: rows.append(a[0].shape[:-1].numel()))
    want, want_g = run(lambda: losses.FULL.loss(model, batch))
    got, got_g = run(lambda: forward_kept_loss(model, batch))
    hook.remove()
    assert rows[1] < rows[0]  # the output layer on fewer rows
    assert got.item() == pytest.approx(want.item(), rel=1e-6)  # fp32, as the model's own loss computes
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name], g, rtol=1e-4, atol=1e-6, msg=name)
    n = int((batch["labels"][..., 1:] != -100).sum()) if layout == "longest" else batch["n_targets"]
    summed = forward_kept_loss(model, {**batch, "num_items_in_batch": torch.tensor(3 * n)})
    assert summed.item() == pytest.approx(want.item() / 3, rel=1e-6)
    none = {k: v for k, v in batch.items() if k not in ("n_targets", "max_row_targets")}
    none["labels"] = torch.full_like(batch["labels"], -100)
    assert forward_kept_loss(model, none).item() == 0.0


def test_several_processes_take_the_labelled_head_through_the_forward():
    """``choose_head`` with several processes: a causal LM keeps the labelled head, through its own forward (soft-
    capped Gemma 2 too: the forward caps the kept logits itself); a classifier keeps its own loss, as before."""
    from sebp_probe.model import losses
    from sebp_probe.model.heads import forward_kept_loss
    from tests.tiny_models import family_config, tiny_model

    gemma = AutoModelForCausalLM.from_config(family_config("gemma2"))
    head, why = losses.choose_head(gemma, "causal-lm", "labelled", processes=2)
    assert (head.kind, head.through_forward, why) == ("labelled", True, None)
    batch = padded_batch("llama", lengths=(11, 4, 7))
    batch["labels"][:, :3] = -100
    assert head.loss(gemma, batch).item() == pytest.approx(gemma(**batch).loss.item(), rel=1e-6)
    assert forward_kept_loss(gemma, batch).item() == pytest.approx(gemma(**batch).loss.item(), rel=1e-6)
    assert losses.choose_head(gemma, "causal-lm", "labelled", processes=2, graphs=True)[0] == losses.FULL
    bert = tiny_model("bert")
    assert losses.choose_head(bert, "classification", "labelled", processes=2) == (
        losses.FULL, "it calls the backbone past DDP's forward: one process only")
