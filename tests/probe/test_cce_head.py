"""``--head cce``: a causal LM's backbone, then Cut-Cross-Entropy on the labelled rows (sebp_probe.model.cce_head).
Its loss and gradients against the model's own on padded and packed batches (CCE's kernel replaced by plain
cross-entropy on the rows it is given; and the real one, its CPU implementation), a Trainer's accumulated
step, a batch without a label, the models and runs it cannot take, and the heads ``--padding auto`` times."""
from __future__ import annotations

import pytest
import torch

from sebp_probe.bench import bench_cases, bench_model
from sebp_probe.bench.bench_cases import MODEL_CASES
from sebp_probe.config import DataConfig, FinetuneConfig
from sebp_probe.integrations.hf import apply_sebp
from sebp_probe.model import losses
from sebp_probe.model.cce_head import cce_problem
from tests.convergence.finetune_helpers import isolated_accelerate  # noqa: F401 - autouse: accelerate's state
from tests.tiny_models import family_config, tiny_model

LLAMA = bench_cases.tiny(MODEL_CASES["llama-3.2-1b-sft"])
cce = pytest.importorskip("cut_cross_entropy")


@pytest.fixture
def plain_ce(monkeypatch):
    """CCE's kernel replaced by cross-entropy over the rows it is given; records (rows, impl, reduction, and the
    dtypes of the hidden rows and the weight)."""
    given = []

    def reference(e, c, targets, impl, reduction="mean"):
        given.append((e.shape[0], impl, reduction, e.dtype, c.dtype))
        return torch.nn.functional.cross_entropy(e @ c.T, targets, reduction=reduction)

    monkeypatch.setattr(cce, "linear_cross_entropy", reference)
    return given


def _model_and_batch(layout):
    model = bench_model.build_model(LLAMA, torch.float32, torch.device("cpu"))
    batches, _ = bench_model._pool(LLAMA, model.config, 1, 0, "mask", True)
    return model, batches[layout][0]


def _loss_and_grads(model, batch, kind):
    head, why = losses.head_for(model, "causal-lm", kind)
    assert why is None and head.kind == kind
    model.zero_grad(set_to_none=True)
    loss = head.loss(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("layout", ["longest", "packed"])
def test_the_cce_head_gives_the_models_loss_and_gradients(layout, plain_ce):
    model, batch = _model_and_batch(layout)
    want, want_g = _loss_and_grads(model, batch, "full")
    got, got_g = _loss_and_grads(model, batch, "cce")
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    assert want_g.keys() == got_g.keys()
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name], g, rtol=1e-4, atol=1e-6, msg=name)
    labelled = int((batch["labels"][..., 1:] != -100).sum()) if layout == "longest" else batch["n_targets"]
    # the labelled rows only, in the model's dtype; CCE's CPU path
    assert plain_ce == [(labelled, "torch_compile", "mean", torch.float32, torch.float32)]


def test_under_autocast_the_rows_and_weight_reach_cce_in_autocasts_dtype_and_the_weight_gets_its_gradient(plain_ce):
    """As the output layer computes under autocast (``finetune --bf16``: fp32 weights, bf16 matmuls): CCE is
    given bf16 rows and weight (its GPU backward takes no fp32), the fp32 weight gets an fp32 gradient, and the
    loss is the model's own to bf16's rounding."""
    model, batch = _model_and_batch("longest")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, _ = _loss_and_grads(model, batch, "full")
        got, _ = _loss_and_grads(model, batch, "cce")
    assert plain_ce[-1][3:] == (torch.bfloat16, torch.bfloat16)
    grad = model.get_output_embeddings().weight.grad
    assert grad.dtype == torch.float32 and grad.abs().sum() > 0
    assert got.item() == pytest.approx(want.item(), rel=2e-2)


def test_an_accumulated_step_divides_the_sum_by_the_steps_labelled_tokens(plain_ce):
    model, batch = _model_and_batch("longest")
    cce, _ = losses.head_for(model, "causal-lm", "cce")
    mean = cce.loss(model, batch).item()
    n = int((batch["labels"][..., 1:] != -100).sum())
    got = cce.loss(model, {**batch, "num_items_in_batch": torch.tensor(4 * n)}).item()
    assert got == pytest.approx(mean / 4, rel=1e-5)
    assert plain_ce[-1][2] == "sum"


def test_a_batch_without_labels_gives_zero_and_no_nan(plain_ce):
    model, batch = _model_and_batch("longest")
    cce, _ = losses.head_for(model, "causal-lm", "cce")
    batch = {**batch, "labels": torch.full_like(batch["labels"], -100)}
    batch.pop("n_targets", None), batch.pop("max_row_targets", None)
    loss = cce.loss(model, batch)
    loss.backward()
    assert loss.item() == 0.0 and plain_ce == []
    assert all(torch.isfinite(p.grad).all() and not p.grad.any() for p in model.parameters() if p.grad is not None)


def test_models_and_runs_it_cannot_take_say_why():
    assert "a classifier has no LM head" in cce_problem(tiny_model("bert"), "classification")
    assert "not task 'mlm'" in cce_problem(None, "mlm")
    from transformers import AutoModelForCausalLM

    gemma = AutoModelForCausalLM.from_config(family_config("gemma2"))  # soft-capped logits
    assert "transforms its logits" in cce_problem(gemma, "causal-lm")
    llama = tiny_model("llama")
    assert cce_problem(llama, "causal-lm") is None
    assert losses.choose_head(llama, "causal-lm", "cce", processes=2)[0] == losses.FULL  # past DDP's forward
    assert losses.choose_head(llama, "causal-lm", "cce", graphs=True) == (
        losses.FULL, "CUDA graphs cannot hold its host-side row count")
    assert losses.choose_head(gemma, "causal-lm", "cce")[0] == losses.FULL
    assert losses.choose_head(llama, "causal-lm", "cce") == (losses.Head("cce", "causal-lm"), None)
    with pytest.raises(ValueError, match="choose labelled, full or cce"):
        FinetuneConfig(model="m", data=DataConfig(), head="middle")
    with pytest.raises(ValueError, match="unknown head 'middle'; choose one of labelled, full, cce"):
        apply_sebp(None, head="middle")


def test_padding_auto_times_cce_on_a_gpu_where_it_can_run():
    llama, cuda, cpu = tiny_model("llama"), torch.device("cuda"), torch.device("cpu")
    assert losses.auto_heads(llama, "causal-lm", "labelled", cuda) == ("labelled", "full", "cce")
    assert losses.auto_heads(llama, "causal-lm", "labelled", cpu) == ("labelled", "full")  # CCE compiles there
    assert losses.auto_heads(tiny_model("bert"), "classification", "labelled", cuda) == ("labelled", "full")
    assert losses.auto_heads(llama, "causal-lm", "cce", cpu) == ("cce", "full")
    assert losses.auto_heads(llama, "causal-lm", "full", cuda) == (None,)
    assert losses.auto_heads(llama, "causal-lm", "labelled", cuda, processes=2) == (None,)  # the run's head


def test_the_real_cut_cross_entropy_gives_the_models_loss_and_gradients():
    model, batch = _model_and_batch("longest")
    want, want_g = _loss_and_grads(model, batch, "full")
    got, got_g = _loss_and_grads(model, batch, "cce")
    assert got.item() == pytest.approx(want.item(), rel=1e-4)
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name], g, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["longest", "packed"])
@pytest.mark.parametrize("precision", ["bf16", "autocast", "fp32"])
def test_on_a_gpu_the_cce_kernels_give_the_models_loss(layout, precision):
    """CCE on a GPU, the model in bf16 or in fp32 under bf16 autocast (as ``finetune --bf16`` runs it: its Triton
    kernels, ``impl="cce"``), or in fp32 without autocast (its ``torch_compile`` implementation: the kernels'
    backward takes no fp32): the model's own loss to bf16's rounding, and the gradients close to the model's
    own (its backward filters the softmax entries below bf16's resolution)."""
    model, batch = _model_and_batch(layout)
    model = model.to("cuda", torch.bfloat16 if precision == "bf16" else torch.float32)
    batch = {k: v.to("cuda") if torch.is_tensor(v) else v for k, v in batch.items()}
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "autocast"):
        want, want_g = _loss_and_grads(model, batch, "full")
        got, got_g = _loss_and_grads(model, batch, "cce")
    assert got.item() == pytest.approx(want.item(), rel=2e-2)
    for name, g in want_g.items():
        assert (got_g[name].float() - g.float()).norm() <= 0.05 * g.float().norm() + 1e-6, name


@pytest.mark.gpu
def test_on_a_gpu_padding_auto_times_the_cce_head(tmp_path):
    """``--padding auto`` on a GPU times every layout with the ``cce`` head too; the run takes the head its
    table measured fastest, and trains."""
    from sebp_probe.train import finetune as ft
    from tests.convergence.finetune_helpers import synthetic_data
    from tests.convergence.test_finetune_convergence import _cfg, _loader

    cfg = _cfg(tmp_path, max_steps=2, data=DataConfig(max_length=24, batch_size=4, padding="auto"))
    s = ft.finetune(cfg, load_fn=_loader("llama"), data=synthetic_data("causal-lm", n=16))
    table = s["padding_choice"]["table"]
    assert {r.get("head") for r in table} >= {"labelled", "full", "cce"}, table
    assert s["status"] == "completed" and s["head"] in ("labelled", "full", "cce")


def test_a_frozen_head_as_under_lora_gets_no_gradient_and_the_rest_the_models():
    """The real Cut-Cross-Entropy (its CPU implementation) with the output layer frozen, as a LoRA run has it: no
    gradient for it, and the backbone's gradients the model's own."""
    model, batch = _model_and_batch("longest")
    model.get_output_embeddings().weight.requires_grad_(False)
    want, want_g = _loss_and_grads(model, batch, "full")
    got, got_g = _loss_and_grads(model, batch, "cce")
    assert model.get_output_embeddings().weight.grad is None and want_g.keys() == got_g.keys()
    assert got.item() == pytest.approx(want.item(), rel=1e-4)
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name], g, rtol=1e-3, atol=1e-5, msg=name)


def test_a_bad_label_with_held_checks_reaches_no_kernel_and_raises_at_the_check():
    """Inside the training loop's held label checks (``label_checks.deferred``), a label past the vocabulary in
    a batch that carries its counts: the real CCE computes a loss nobody uses (the label read as class 0), and
    the check raises the one-line error where the block reads it."""
    from sebp_kernels import label_checks

    model, batch = _model_and_batch("packed")
    cce, _ = losses.head_for(model, "causal-lm", "cce")
    labels = batch["labels"].clone()
    at = (labels[..., 1:] != -100).nonzero()[0]
    labels[..., 1:][tuple(at)] = model.config.vocab_size + 5
    with pytest.raises(ValueError, match=r"^label \d+ is outside \[0, \d+\) \(and is not ignore_index -100\)$"):
        with label_checks.deferred() as checks:
            loss = cce.loss(model, {**batch, "labels": labels})
            assert torch.isfinite(loss)
            checks.check()
