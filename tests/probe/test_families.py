"""Every family of the registry (sebp_probe.families), on a tiny model of it: SEBP (default targets, norms and
activations, exact mode) gives dense's loss and gradients; the labelled-rows head (head and last layer on the
labelled or [CLS] rows) gives the model's own loss and gradients where the entry offers it, and says why not
where it does not; packed batches give the padded loss where the entry allows them. A family without an entry
gets every linear but its head and the model's own loss, each said in one line."""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from sebp_kernels import SEBPConfig, SEBPLinear, SEBPNorm
from sebp_probe.data.batching import PackedCollator, PadCollator
from sebp_probe.families import FAMILIES, family_of
from sebp_probe.model.losses import FULL, choose_head
from sebp_probe.model.packing import check_packable
from sebp_probe.model.experts import patched_experts
from sebp_probe.model.patch import patch_sebp, patched_activations
from tests.tiny_models import FAMILY_TASKS, family_model

CASES = [*FAMILY_TASKS.items(), *((t, "mlm") for t in ("bert", "roberta", "electra", "distilbert", "modernbert"))]
LENGTHS = (11, 4, 7, 9, 3, 12)
MAX_LENGTH = 16


def _pad(model_type: str) -> int:
    return 1 if model_type == "roberta" else 0


def _dtype(model_type: str) -> torch.dtype:
    """fp64, but fp32 for Gemma 2 (its eager attention adds the fp64 mask's minimum twice, -inf, and NaN) and the
    mixtures of experts (their experts' default grouped_mm takes fp32, bf16 and fp16 only)."""
    return torch.float32 if model_type == "gemma2" or FAMILIES[model_type].experts else torch.float64


def _rtol(model) -> float:
    return 1e-6 if next(model.parameters()).dtype == torch.float64 else 1e-5


def _items(task: str, seed: int = 0) -> list[dict]:
    """Examples as ``tokenize`` gives them: causal LM labels -100 on a prompt prefix, masked LM labels on about
    a third of the positions."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        ids = torch.randint(3, 120, (n,), generator=g).tolist()
        if task == "classification":
            out.append({"input_ids": ids, "label": int(torch.randint(0, 3, (), generator=g))})
        elif task == "causal-lm":
            out.append({"input_ids": ids, "labels": [-100] * (n // 3) + ids[n // 3:]})
        else:
            keep = torch.rand(n, generator=g) < 0.35
            keep[0] = True
            out.append({"input_ids": ids, "labels": [i if k else -100 for i, k in zip(ids, keep.tolist())]})
    return out


def _batch(model_type: str, task: str) -> dict:
    return PadCollator(_pad(model_type), "causal-lm" if task == "mlm" else task, "longest", MAX_LENGTH,
                       "right")(_items(task))


def _loss_and_grads(model, loss_fn) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(want: tuple, got: tuple, rtol: float) -> None:
    """Same loss and gradients, to ~1e-6 relative in fp64 (transformers' losses upcast the logits to fp32 only,
    and the fused head computes in fp32), ~1e-5 in fp32 (a gradient that is zero in exact arithmetic is
    rounding noise, so the absolute floor is a small share of the largest gradient)."""
    (loss_w, g_w), (loss_g, g_g) = want, got
    assert torch.isfinite(loss_w)
    torch.testing.assert_close(loss_g, loss_w, rtol=rtol, atol=0, check_dtype=False)
    assert g_w.keys() == g_g.keys() and len(g_w) > 10
    scale = max(float(g.abs().max()) for g in g_w.values())
    for k in g_w:
        torch.testing.assert_close(g_g[k], g_w[k], rtol=rtol, atol=rtol * scale, check_dtype=False,
                                   msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("model_type,task", CASES)
def test_sebp_with_norms_and_activations_equals_dense(model_type, task):
    dense = family_model(model_type, task, _dtype(model_type), pad=_pad(model_type))
    batch = _batch(model_type, task)
    want = _loss_and_grads(dense, lambda: dense(**batch).loss)
    sebp = copy.deepcopy(dense)
    names = patch_sebp(sebp, SEBPConfig("exact"), norms=True, acts=True)
    family = FAMILIES[model_type]
    linears = {n.rsplit(".", 1)[-1] for n in names["linears"]}
    assert linears == {t.rsplit(".", 1)[-1] for t in family.targets}  # the entry's projections, all found
    rms = [m for m in sebp.modules() if isinstance(m, SEBPNorm) and m.kind == "rms"]
    assert bool(rms) == bool(family.rms_norms)
    assert bool(patched_activations(sebp)) == bool(family.gated_mlps or family.gelu_mlps)
    assert bool(patched_experts(sebp)) == bool(family.experts)
    _assert_same(want, _loss_and_grads(sebp, lambda: sebp(**batch).loss), _rtol(sebp))


@pytest.mark.parametrize("model_type,task", CASES)
def test_labelled_head_equals_the_models_loss_where_offered(model_type, task, caplog):
    model = family_model(model_type, task, _dtype(model_type), pad=_pad(model_type))
    batch = _batch(model_type, task)
    want = _loss_and_grads(model, lambda: model(**batch).loss)
    with caplog.at_level(logging.WARNING, logger="sebp_probe"):
        head, why = choose_head(model, task, "labelled")
    family = family_of(model)
    if family.layer is None:  # no kept-rows layer: the model's own loss, said in one line naming --head
        assert head == FULL and f"the {family.name} entry has no kept-rows" in why
        assert [r.getMessage() for r in caplog.records] == [
            f"--head labelled runs as --head full (the model's own loss): {why}"]
        return
    assert (head.kind, why) == ("labelled", None) and not caplog.records
    _assert_same(want, _loss_and_grads(model, lambda: head.loss(model, batch)), _rtol(model))


@pytest.mark.parametrize("model_type,task", list(FAMILY_TASKS.items()))
def test_packed_equals_padded_where_the_entry_allows(model_type, task):
    model = family_model(model_type, task, _dtype(model_type), pad=_pad(model_type))
    family = family_of(model)
    if not family.packed:
        with pytest.raises(ValueError, match=f"not {type(model).__name__}; use --padding bucket"):
            check_packable(model, task)
        return
    check_packable(model, task)
    padded = _batch(model_type, task)
    packed = PackedCollator(_pad(model_type), task, MAX_LENGTH)(_items(task))
    want = _loss_and_grads(model, lambda: FULL.loss(model, padded))
    _assert_same(want, _loss_and_grads(model, lambda: FULL.loss(model, packed)), _rtol(model))
    if family.layer is not None and task == "causal-lm":  # the labelled-rows head on packed rows too
        head, _ = choose_head(model, task, "labelled")
        _assert_same(want, _loss_and_grads(model, lambda: head.loss(model, packed)), _rtol(model))


@pytest.mark.parametrize("model_type,task", [(t, k) for t, k in FAMILY_TASKS.items() if FAMILIES[t].packed])
def test_packed_by_varlen_equals_padded_where_the_kernel_can_run(model_type, task, monkeypatch):
    """Every packed family on one flattened row (a per-sequence sdpa in place of flash attention; encoders
    without causality), where the decision for a CUDA bf16 run picks varlen; the families it keeps on the mask
    (sliding windows, eager attention) refuse a forced varlen rather than attend past their window."""
    from sebp_probe.model import packing
    from tests.probe.test_packing import reference_varlen

    monkeypatch.setattr(packing, "VARLEN_KERNEL", reference_varlen)
    model = family_model(model_type, task, _dtype(model_type), pad=_pad(model_type))
    packed = PackedCollator(_pad(model_type), task, MAX_LENGTH)(_items(task))
    why = packing.varlen_blocker(model.config, "cuda", torch.bfloat16, training=True)
    if why is not None:  # Mistral's and Gemma 3's windows; Gemma 2 loads with eager attention (its softcap)
        assert why in ("varlen attention runs no sliding window",
                       "varlen replaces the 'sdpa' attention, not 'eager'")
        with pytest.raises(packing.PackingError, match="no sliding window|replaces the 'sdpa' attention"):
            packing.packed_forward(model, packed, backend="varlen")
        return
    want = _loss_and_grads(model, lambda: FULL.loss(model, _batch(model_type, task)))
    got = _loss_and_grads(model, lambda: packing.packed_forward(model, packed, backend="varlen").loss)
    _assert_same(want, got, _rtol(model))


def test_a_family_without_an_entry_falls_back_in_one_line_each(caplog):
    model = family_model("opt", "causal-lm", torch.float64)
    assert family_of(model) is None
    batch = _batch("opt", "causal-lm")
    want = _loss_and_grads(model, lambda: model(**batch).loss)
    sebp = copy.deepcopy(model)
    with caplog.at_level(logging.WARNING, logger="sebp_probe"):
        head, why = choose_head(sebp, "causal-lm", "labelled")
        names = patch_sebp(sebp, SEBPConfig("exact"), norms=True, acts=True)
    assert head == FULL and why == "model type 'opt' has no entry in sebp-probe's model families"
    # every linear but the output head; the LayerNorms (a plain nn.LayerNorm is exact for any family)
    assert len(names["linears"]) == 12 and "lm_head" not in names["linears"]
    assert all(isinstance(sebp.get_submodule(n), SEBPLinear) for n in names["linears"])
    assert names["norms"] and not names["acts"]
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"--head labelled runs as --head full (the model's own loss): {why}",
                     "model type 'opt' has no entry: SEBP targets every linear but the output head (fc1, fc2, "
                     "self_attn.k_proj, self_attn.out_proj, self_attn.q_proj, self_attn.v_proj); left dense: "
                     "lm_head (Linear); choose with --targets"]
    _assert_same(want, _loss_and_grads(sebp, lambda: head.loss(sebp, batch)), _rtol(sebp))


def test_the_fallback_note_names_every_matrix_left_dense(caplog):
    """A module SEBP cannot swap (here fused experts, a 3-D parameter) is named with its type beside the head."""
    from torch import nn

    from sebp_probe.model.patch import find_targets

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up = nn.Parameter(torch.zeros(4, 32, 80))

    model = family_model("opt", "causal-lm")
    for layer in model.model.decoder.layers:
        layer.experts = Experts()
    with caplog.at_level(logging.WARNING, logger="sebp_probe"):
        names = find_targets(model)
    assert len(names) == 12
    assert "left dense: experts (Experts), lm_head (Linear); choose with --targets" in caplog.records[0].getMessage()


def test_a_classifier_that_pools_every_row_keeps_its_own_loss():
    model = family_model("modernbert", "classification")
    model.config.classifier_pooling = "mean"
    assert choose_head(model, "classification", "labelled") == (
        FULL, "the classifier pools 'mean', every row; the [CLS]-rows layer needs 'cls'")
