"""sebp_probe.integrations.hf through the real trainers: transformers' Trainer (a tiny BERT classifier, a tiny
Llama on transformers' padding-free collator) and TRL's SFTTrainer (a tiny Llama on prompt/completion data with
completion-only loss, padded and padding-free, with gradient accumulation, label smoothing, bf16 autocast and
peft LoRA; the bundled SmolLM2 on the bundled tweets). Each run trains twice from the same start, plain and
with apply_sebp: the logged losses and the first step's gradients agree within the tolerances of the other
exactness tests."""
from __future__ import annotations

import random

import pytest
import torch

from sebp_kernels import SEBPLinear
from sebp_probe.integrations.hf import apply_sebp
from tests.convergence.finetune_helpers import isolated_accelerate  # noqa: F401 (a fresh accelerate state per test)
from tests.helpers import assert_within_torch_error
from tests.tiny_models import padded_batch, tiny_model, word_tokenizer

STEPS = 3
LOSS_REL = 1e-4  # the real MiniLM's: tests/convergence/test_finetune_minilm.py
GRAD_REL = 1e-5  # fp32: each parameter's max error against its largest gradient


class _Rows(torch.utils.data.Dataset):
    """Rows of a few padded tiny batches (right padding, different lengths)."""

    def __init__(self, arch: str, n: int = 4):
        self.items = []
        for seed in range(n):
            b = padded_batch(arch, lengths=(11, 4, 7, 9), seed=seed)
            self.items += [{k: v[i] for k, v in b.items()} for i in range(b["input_ids"].shape[0])]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _first_grads():
    from transformers import TrainerCallback

    class FirstGrads(TrainerCallback):
        """The gradients of the first optimizer step (after the trainer's clipping)."""

        grads = None

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if self.grads is None:
                self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    return FirstGrads()


def _args(tmp_path, cls=None, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-3,
                use_cpu=True, report_to=[], logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True,
                bf16=False, log_level="error")
    return (cls or TrainingArguments)(**{**base, **kw})


def _train(make, sebp: dict | None, watch: str | None = None):
    """Train ``make(callbacks)`` (with ``apply_sebp(**sebp)`` unless None): its losses, first gradients, the
    handle, the (shape, dtype) of what the module ``watch`` (a name in the model) returned in training, and
    the trainer."""
    grads = _first_grads()
    trainer = make([grads])
    handle = apply_sebp(trainer, **sebp) if sebp is not None else None
    shapes = []
    if watch:
        module = trainer.model.get_submodule(watch)
        def seen(m, args, out):
            out = out[0] if isinstance(out, tuple) else out
            if m.training:
                shapes.append((tuple(out.shape), out.dtype))

        module.register_forward_hook(seen)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == STEPS
    return losses, grads.grads, handle, shapes, trainer


def _assert_same(plain, ours, grad_rel=GRAD_REL):
    for i, (a, b) in enumerate(zip(plain[0], ours[0])):
        assert abs(a - b) <= LOSS_REL * max(1.0, abs(a)), f"step {i}: plain {a:.6f} vs sebp {b:.6f}"
    assert plain[1].keys() == ours[1].keys()
    for name, g in plain[1].items():
        err, scale = (ours[1][name] - g).abs().max().item(), g.abs().max().item()
        assert err <= grad_rel * scale + 1e-12, f"{name}: max error {err:.3g} > {grad_rel} x {scale:.3g}"


# ------------------------------------------------------------------------------------------------- Trainer


@pytest.mark.parametrize("smoothing,accum", [(0.0, 1), (0.1, 2)])
def test_trainer_bert_classifier(tmp_path, smoothing, accum):
    """The classifier's last layer computes its [CLS] rows only (shape (B, 1, d)), under the Trainer's own loss
    (label smoothing included); the SEBP linears get the same gradients."""
    from transformers import Trainer

    def make(callbacks):
        return Trainer(model=tiny_model("bert"), args=_args(tmp_path, label_smoothing_factor=smoothing,
                                                            gradient_accumulation_steps=accum),
                       train_dataset=_Rows("bert"), callbacks=callbacks)

    last = "bert.encoder.layer.1"
    plain = _train(make, None, watch=last)
    ours = _train(make, {"calibrate": False}, watch=last)
    _assert_same(plain, ours)
    handle, trainer = ours[2], ours[4]
    assert handle.applied and handle.head == "labelled" and handle.reason is None
    assert len(handle.layers) == 12  # 2 layers x (query, key, value, attention output, intermediate, output)
    assert all(isinstance(trainer.model.get_submodule(n), SEBPLinear) for n in handle.layers)
    assert {s[1] for s, _ in plain[3]} == {11} and {s[1] for s, _ in ours[3]} == {1}


def test_trainer_llama_on_the_flattening_collator(tmp_path):
    """transformers' DataCollatorWithFlattening (one row, position_ids restarting, cu_seq_lens): the head and the
    last layer on the labelled rows give the Trainer's own loss (num_items_in_batch: the model takes loss
    kwargs), with gradient accumulation."""
    from transformers import DataCollatorWithFlattening, Trainer

    rng = random.Random(0)
    rows = []
    for _ in range(24):
        ids = [rng.randint(3, 119) for _ in range(rng.randint(3, 12))]
        cut = len(ids) // 2
        rows.append({"input_ids": ids, "labels": [-100] * cut + ids[cut:]})

    def make(callbacks):
        return Trainer(model=tiny_model("llama"), args=_args(tmp_path, gradient_accumulation_steps=2),
                       train_dataset=rows, data_collator=DataCollatorWithFlattening(return_flash_attn_kwargs=True),
                       callbacks=callbacks)

    plain = _train(make, None, watch="lm_head")
    ours = _train(make, {"calibrate": False}, watch="lm_head")
    _assert_same(plain, ours)
    assert ours[2].head == "labelled" and plain[3] and not ours[3]  # the model's lm_head module never ran


def _compiled(monkeypatch, device: str = "cpu", **kw) -> dict:
    """TrainingArguments(torch_compile=True): on the CPU with aot_eager (no C++ build), on a GPU with Inductor. It
    sets accelerate's dynamo variables for the whole process: set to their defaults here, monkeypatch puts back
    what was there."""
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "no")
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "default")
    return dict(torch_compile=True, torch_compile_backend="aot_eager" if device == "cpu" else "inductor",
                use_cpu=device == "cpu", **kw)


def _dynamo_counts(run):
    """``run()``'s result and (graphs, graph breaks) Dynamo counted during it."""
    import torch._dynamo as dynamo

    dynamo.reset()
    dynamo.utils.counters.clear()
    try:
        got = run()
        c = dynamo.utils.counters
        return got, (c["stats"]["unique_graphs"], sum(c["graph_break"].values()))
    finally:
        dynamo.reset()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_trainer_torch_compile_compiles_the_labelled_rows_loss(tmp_path, monkeypatch, device):
    """torch_compile=True: each layer of the model compiled in place (``layers``: the layers share one graph, the
    last one runs eagerly on the labelled rows), or the labelled-rows loss (backbone, last layer on the labelled
    rows, head) compiled as one graph (``loss``: the labelled-row counts come as Python ints), with the trainer's
    backend, no graph break, and the losses and gradients of the plain Trainer compiled as torch_compile=True
    compiles it (on a GPU, where torch_compile=True turns TF32 on and Inductor compiles each run on its own: the
    losses, within 1e-3). Undo leaves no layer compiled. Both scopes against one plain run."""
    from transformers import Trainer

    def make(callbacks):
        return Trainer(model=tiny_model("llama"), args=_args(tmp_path, **_compiled(monkeypatch, device)),
                       train_dataset=_Rows("llama"), callbacks=callbacks)

    plain, _ = _dynamo_counts(lambda: _train(make, None))
    for scope in ("layers", "loss"):
        _check_compiled_labelled_rows_loss(make, plain, device, scope)


def _check_compiled_labelled_rows_loss(make, plain, device, scope):
    from sebp_probe.families import layer_stack

    ours, (graphs, breaks) = _dynamo_counts(lambda: _train(make, {"calibrate": False, "compile_scope": scope},
                                                           watch="lm_head"))
    handle, trainer = ours[2], ours[4]
    assert handle.compile_scope == scope
    if device == "cuda":
        assert ours[0] == pytest.approx(plain[0], rel=1e-3) and breaks == 0 and handle.head == "labelled"
        return
    _assert_same(plain, ours)
    assert handle.head == "labelled" and handle.reason is None and handle.layers
    assert not ours[3]  # the model's own lm_head never ran: the loss went through the compiled head path
    # the first graph with the sizes (and, compiled whole, the labelled-row counts) as constants, the second
    # with them symbolic (Dynamo's automatic dynamic: the second step's differ), none after that; no break
    assert 1 <= graphs <= 2 and breaks == 0
    layers = layer_stack(trainer.model)
    assert all(layer._compiled_call_impl is not None for layer in layers) == (scope == "layers")
    handle.undo()
    assert all(layer._compiled_call_impl is None for layer in layers)


def test_trainer_torch_compile_masked_lm(tmp_path, monkeypatch):
    """A masked LM (a tiny BERT, 15% of the tokens labelled) under torch_compile=True: its labelled rows counted on
    the host too, so the compiled labelled-rows loss has no graph break, with the plain compiled trainer's
    losses and gradients (each layer compiled, or the loss; both against one plain run)."""
    from transformers import AutoModelForMaskedLM, Trainer

    from tests.tiny_models import tiny_config

    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(12):
        ids = torch.randint(3, 120, (10,), generator=g)
        labels = torch.where(torch.rand(10, generator=g) < 0.15, ids, torch.full_like(ids, -100))
        labels[int(torch.randint(0, 10, (1,), generator=g))] = ids[0]  # at least one labelled token a row
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})

    def model():
        torch.manual_seed(0)
        return AutoModelForMaskedLM.from_config(tiny_config("bert"))

    def make(callbacks):
        return Trainer(model=model(), args=_args(tmp_path, **_compiled(monkeypatch)), train_dataset=rows,
                       callbacks=callbacks)

    plain, _ = _dynamo_counts(lambda: _train(make, None))
    for scope in ("layers", "loss"):
        ours, (graphs, breaks) = _dynamo_counts(lambda: _train(make, {"calibrate": False, "compile_scope": scope}))
        _assert_same(plain, ours)
        assert ours[2].head == "labelled" and ours[2].compile_scope == scope and 1 <= graphs <= 2 and breaks == 0, \
            scope


@pytest.mark.parametrize("scope,what", [("loss", "the labelled-rows loss"), ("layers", "a layer of the model")])
def test_a_compiled_loss_that_fails_says_so_and_trains_eagerly(tmp_path, monkeypatch, caplog, scope, what):
    """A labelled-rows loss or a layer that does not compile (here: a backend that raises): one line naming
    torch_compile=True, and the steps run eagerly, with the plain trainer's losses."""
    from transformers import Trainer

    def broken(gm, example_inputs):
        raise RuntimeError("no backend here")

    def make(callbacks, **kw):
        return Trainer(model=tiny_model("llama"), args=_args(tmp_path, **kw), train_dataset=_Rows("llama"),
                       callbacks=callbacks)

    plain = _train(make, None)
    args = _compiled(monkeypatch)
    monkeypatch.setattr("sebp_probe.integrations.hf._compile_kwargs", lambda trainer: {"backend": broken})
    ours, _ = _dynamo_counts(lambda: _train(lambda cb: make(cb, **args), {"calibrate": False,
                                                                          "compile_scope": scope}))
    _assert_same(plain, ours)
    lines = [r.getMessage() for r in caplog.records if "did not compile" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"torch_compile=True: {what} did not compile")
    failed = ours[2].to_dict()["compile_failed"]  # the handle says it ran eagerly, and why
    assert failed and failed.startswith("BackendCompilerFailed")


def test_trainer_torch_compile_keeps_a_classifiers_own_forward(tmp_path, monkeypatch, caplog):
    """A classifier under torch_compile=True: the [CLS]-rows last layer would change the compiled model's layer,
    so the trainer's own loss runs (one warning line) with the SEBP layers, and the plain losses."""
    from transformers import Trainer

    def make(callbacks):
        return Trainer(model=tiny_model("bert"), args=_args(tmp_path, **_compiled(monkeypatch)),
                       train_dataset=_Rows("bert"), callbacks=callbacks)

    plain, _ = _dynamo_counts(lambda: _train(make, None))
    ours, _ = _dynamo_counts(lambda: _train(make, {"calibrate": False}))
    _assert_same(plain, ours)
    assert ours[2].head == "full" and "torch_compile=True" in ours[2].reason and ours[2].layers
    warned = [r.getMessage() for r in caplog.records if r.name == "sebp_probe.integrations.hf"]
    assert len(warned) == 1 and "[CLS]-rows" in warned[0]


# ---------------------------------------------------------------------------------------------- SFTTrainer


def _completions(n: int = 24, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    words = lambda k: " ".join(f"w{rng.randint(0, 100)}" for _ in range(k))  # noqa: E731
    return [{"prompt": words(rng.randint(3, 9)), "completion": " " + words(rng.randint(1, 5))} for _ in range(n)]


def _sft(tmp_path, model_fn, rows, tokenizer, **kw):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    peft_config = kw.pop("peft_config", None)

    def make(callbacks):
        args = _args(tmp_path, trl.SFTConfig, max_length=None, **kw)
        return trl.SFTTrainer(model=model_fn(), args=args, train_dataset=Dataset.from_list(rows),
                              processing_class=tokenizer, callbacks=callbacks, peft_config=peft_config)

    return make


@pytest.mark.parametrize("padding_free,accum,smoothing", [(False, 2, 0.0), (True, 1, 0.0), (False, 1, 0.1)])
def test_sft_tiny_llama_completion_only(tmp_path, padding_free, accum, smoothing):
    """Prompt/completion data (completion-only loss), padded or padding-free, with gradient accumulation or
    label smoothing; calibrated (every layer whose share of active rows is small enough runs SEBP): the
    losses and gradients of the plain SFTTrainer, and TRL's token count."""
    make = _sft(tmp_path, lambda: tiny_model("llama"), _completions(), word_tokenizer(),
                padding_free=padding_free, gradient_accumulation_steps=accum, label_smoothing_factor=smoothing)
    last = "model.layers.1"
    plain = _train(make, None, watch=last)
    ours = _train(make, {"fallback_if_slower": False}, watch=last)
    _assert_same(plain, ours)
    handle, trainer = ours[2], ours[4]
    rows = [sum(s[0] * s[1] for s, _ in run[3]) for run in (plain, ours)]
    assert handle.head == "labelled" and 0 < rows[1] < rows[0] / 2  # the last layer: the labelled rows only
    density = handle.calibration.density
    assert set(handle.layers) == {n for n, d in density.items() if d <= 0.9} and handle.layers
    if not padding_free:  # the padding rows are inactive in every layer
        assert all(d < 0.9 for n, d in density.items() if ".layers.0." in n)
    logged = [[h["num_tokens"] for h in t.state.log_history if "loss" in h] for t in (plain[4], trainer)]
    assert logged[0] == logged[1]


def test_sft_padding_free_torch_compile(tmp_path, monkeypatch):
    """SFTTrainer with torch_compile=True on padding-free batches (one flattened row, position_ids): the layers or
    the labelled-rows loss compiled, no graph break, the plain compiled trainer's losses and gradients (both
    scopes against one plain run)."""
    make = _sft(tmp_path, lambda: tiny_model("llama"), _completions(), word_tokenizer(), padding_free=True,
                **_compiled(monkeypatch))
    plain, _ = _dynamo_counts(lambda: _train(make, None))
    for scope in ("layers", "loss"):
        ours, (graphs, breaks) = _dynamo_counts(lambda: _train(make, {"calibrate": False, "compile_scope": scope}))
        _assert_same(plain, ours)
        assert ours[2].head == "labelled" and ours[2].compile_scope == scope and 1 <= graphs <= 2 and breaks == 0, \
            scope  # as in the Trainer test above


@pytest.mark.parametrize("padding_free,accum,lora", [(False, 2, False), (True, 1, False), (False, 1, True)])
def test_sft_with_the_cut_cross_entropy_head(tmp_path, padding_free, accum, lora):
    """``head="cce"``: the backbone, then Cut-Cross-Entropy (its CPU implementation) on the labelled rows, padded
    or padding-free, with gradient accumulation, and under LoRA (a frozen head): the plain SFTTrainer's losses
    and gradients, its token count, and every step through CCE."""
    cce = pytest.importorskip("cut_cross_entropy")
    kw = {}
    if lora:
        pytest.importorskip("peft")
        from peft import LoraConfig

        kw["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    make = _sft(tmp_path, lambda: tiny_model("llama"), _completions(), word_tokenizer(),
                padding_free=padding_free, gradient_accumulation_steps=accum, **kw)
    plain = _train(make, None)
    calls, real = [], cce.linear_cross_entropy
    mp = pytest.MonkeyPatch()
    mp.setattr(cce, "linear_cross_entropy", lambda *a, **k: (calls.append(k.get("reduction")), real(*a, **k))[1])
    try:
        ours = _train(make, {"calibrate": False, "head": "cce"})
    finally:
        mp.undo()
    _assert_same(plain, ours, grad_rel=1e-4)
    assert ours[2].head == "cce" and ours[2].reason is None
    assert len(calls) == STEPS * accum and set(calls) == {"sum"}  # the trainer's num_items_in_batch divides
    logged = [[h["num_tokens"] for h in t.state.log_history if "loss" in h] for t in (plain[4], ours[4])]
    assert logged[0] == logged[1]


def test_the_cce_head_without_label_smoothing_only(tmp_path, caplog):
    """CCE has no label smoothing: with label_smoothing_factor > 0 the trainer's own loss runs, one warning."""
    pytest.importorskip("cut_cross_entropy")
    make = _sft(tmp_path, lambda: tiny_model("llama"), _completions(), word_tokenizer(), label_smoothing_factor=0.1)
    handle = apply_sebp(make([]), calibrate=False, head="cce")
    assert handle.head == "full" and "no label smoothing" in handle.reason
    warned = [r.getMessage() for r in caplog.records if r.name == "sebp_probe.integrations.hf"]
    assert len(warned) == 1 and "Cut-Cross-Entropy head is off" in warned[0]


def test_sft_bf16_autocast(tmp_path):
    """bf16 (SFTConfig's default): the labelled-rows loss runs under the trainer's autocast, its gradients as
    close to the fp32 ones as the plain bf16 trainer's (at most twice its error, plus the bf16 atol)."""
    make = lambda **kw: _sft(tmp_path, lambda: tiny_model("llama"), _completions(), word_tokenizer(),  # noqa: E731
                             **kw)
    ref = _train(make(bf16=False), None)
    plain = _train(make(bf16=True), None)
    ours = _train(make(bf16=True), {"calibrate": False}, watch="model.layers.1.mlp")
    assert ours[3] and {d for _, d in ours[3]} == {torch.bfloat16} and ours[2].head == "labelled"
    assert abs(ours[0][0] - plain[0][0]) <= LOSS_REL * plain[0][0]
    for name, g in ref[1].items():
        assert_within_torch_error(ours[1][name], g.double(), plain[1][name], torch.bfloat16, name)


def test_sft_peft_lora(tmp_path):
    """A peft LoRA model (SFTTrainer wraps it): SEBP on the frozen base layers, the same LoRA gradients."""
    pytest.importorskip("peft")
    from peft import LoraConfig

    make = _sft(tmp_path, lambda: tiny_model("llama"), _completions(), word_tokenizer(),
                peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                       lora_dropout=0.0))
    plain = _train(make, None)
    ours = _train(make, {"calibrate": False})
    _assert_same(plain, ours)
    assert ours[1] and all("lora_" in n for n in ours[1])
    assert ours[2].head == "labelled" and any(n.endswith("q_proj.base_layer") for n in ours[2].layers)


@pytest.mark.gpu
def test_sft_with_liger_kernels_on_a_gpu(tmp_path, monkeypatch):
    """use_liger_kernel=True: Liger's norm, SwiGLU and in-place rotary kernels, patched in when training starts,
    compose with the SEBP layers and the labelled-rows loss (the losses and gradients of SFTTrainer with Liger
    alone), and the training steps' sdpa runs without cuDNN's attention (SFTConfig checkpoints the layers, so
    their recomputation in the backward must run without it too)."""
    pytest.importorskip("liger_kernel")
    import transformers.models.llama.modeling_llama as llama

    for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):  # Liger replaces them for the process:
        monkeypatch.setattr(llama, name, getattr(llama, name))  # the next tests get them back
    monkeypatch.setattr(llama.LlamaForCausalLM, "forward", llama.LlamaForCausalLM.forward)
    make = _sft(tmp_path, lambda: tiny_model("llama"), _completions(), word_tokenizer(), use_cpu=False,
                use_liger_kernel=True)
    plain = _train(make, None)
    ours = _train(make, {"fallback_if_slower": False})
    _assert_same(plain, ours)
    handle, model = ours[2], ours[4].model
    assert handle.head == "labelled" and handle.layers and handle.cudnn_attention is False
    assert "Liger" in type(model.model.norm).__name__ or "liger" in type(model.model.norm.forward).__module__ \
        or "liger" in str(model.model.layers[0].mlp.forward)


@pytest.mark.slow
def test_sft_smollm2_on_tweets(tmp_path):
    """The bundled SmolLM2 on a few bundled tweets as prompt/completion (the sentiment word is the
    completion): the plain SFTTrainer's losses and gradient norms."""
    from sebp_probe.data.assets import load_model
    from sebp_probe.config import DataConfig
    from sebp_probe.data.textdata import load_text_data

    data = load_text_data(DataConfig(dataset="tweets-sft", max_samples=8), "causal-lm")
    rows = [{"prompt": e["prompt"], "completion": e["response"]} for e in data.examples]
    loaded = load_model("smollm2", "causal-lm")
    start = {k: v.clone() for k, v in loaded.model.state_dict().items()}

    def model_fn():
        loaded.model.load_state_dict(start)
        return loaded.model

    make = _sft(tmp_path, model_fn, rows, loaded.tokenizer, max_steps=2, per_device_train_batch_size=2,
                learning_rate=1e-5)
    plain = _train_steps(make, None)
    ours = _train_steps(make, {"calibrate": False})
    ours[2].undo()
    for key in ("loss", "grad_norm"):
        for a, b in zip(plain[0][key], ours[0][key]):
            assert abs(a - b) <= LOSS_REL * max(1.0, abs(a)), f"{key}: plain {a:.6f} vs sebp {b:.6f}"
    assert ours[2].head == "labelled" and len(ours[2].layers) == 30 * 7


def _train_steps(make, sebp):
    trainer = make([])
    handle = apply_sebp(trainer, **sebp) if sebp is not None else None
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {k: [h[k] for h in logs] for k in ("loss", "grad_norm")}, None, handle
