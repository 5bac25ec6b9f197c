"""The SEBP experts of the mixture-of-experts families (sebp_kernels.experts, sebp_probe.model.experts): the grouped
linear's backward over the non-zero rows of dY against autograd's dense one, tiny Mixtral and Qwen3-MoE models
against transformers' own experts (its eager loop in fp64, its grouped_mm in fp32) with padding and the routers'
load-balancing loss, the patch round trip, and the labelled-rows head refused where that loss is on."""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from sebp_kernels.experts import grouped_mm, grouped_mm_loop, sebp_grouped_linear
from sebp_probe.families import family_of
from sebp_probe.model.experts import experts_layout_problem, patch_experts, patched_experts
from sebp_probe.model.losses import FULL, Head, choose_head
from sebp_probe.model.patch import patch_model, unpatch_model
from sebp_probe.notes import note
from tests.helpers import loss_and_grads
from tests.tiny_models import family_config

MOE = ("mixtral", "qwen3_moe")


def _groups(g: torch.Generator, experts: int, rows: int) -> torch.Tensor:
    """Sorted expert ids of ``rows`` rows, expert 1 left without any."""
    ids = torch.randint(0, experts, (rows,), generator=g)
    return torch.sort(ids.masked_fill(ids == 1, 0)).values


def _dense(x, weight, ids):
    """Each row through its expert's weight, one F.linear per row: the reference forward."""
    return torch.stack([x[i] @ weight[e].t() for i, e in enumerate(ids.tolist())])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_grouped_linear_backward_over_the_nonzero_rows_equals_dense(dtype):
    g = torch.Generator().manual_seed(0)
    experts, rows, d_in, d_out = 4, 40, 16, 24
    ids = _groups(g, experts, rows)
    offs = torch.bincount(ids, minlength=experts).cumsum(0)
    x = torch.randn(rows, d_in, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(experts, d_out, d_in, generator=g, dtype=dtype, requires_grad=True)
    dy = torch.randn(rows, d_out, generator=g, dtype=dtype)
    dy[::3] = 0  # zero rows, and one expert's rows all zero
    dy[ids == 2] = 0
    y = sebp_grouped_linear(x, w, offs, ids)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    want = _dense(x, w, ids)
    wdx, wdw = torch.autograd.grad(want, (x, w), dy)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, want, **tol)
    torch.testing.assert_close(dx, wdx, **tol)
    torch.testing.assert_close(dw, wdw, **tol)
    assert not dx[::3].any() and not dw[1].any() and not dw[2].any()


def test_grouped_gemm_equals_the_loop_and_a_nan_row_stays_active():
    g = torch.Generator().manual_seed(1)
    ids = _groups(g, 4, 32)
    offs = torch.bincount(ids, minlength=4).cumsum(0)
    a, b = torch.randn(32, 16, generator=g), torch.randn(4, 16, 8, generator=g)
    torch.testing.assert_close(grouped_mm(a, b, offs), grouped_mm_loop(a, b, offs))
    c = torch.randn(32, 8, generator=g)
    torch.testing.assert_close(grouped_mm(a.t(), c, offs), grouped_mm_loop(a.t(), c, offs))
    x = torch.randn(32, 16, generator=g, requires_grad=True)
    w = torch.randn(4, 8, 16, generator=g, requires_grad=True)
    dy = torch.zeros(32, 8)
    dy[5, 2] = float("nan")
    dx, dw = torch.autograd.grad(sebp_grouped_linear(x, w, offs, ids), (x, w), dy)
    assert dx[5].isnan().all() and not dx[6:].any() and dw[ids[5]].isnan().any()


def _model(model_type: str, dtype: torch.dtype, aux: bool, impl: str | None = None):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = family_config(model_type)
    cfg.output_router_logits = aux
    kw = {} if impl is None else {"experts_implementation": impl}
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype, **kw).train()


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 120, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    mask[2, 9:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@pytest.mark.parametrize("model_type", MOE)
@pytest.mark.parametrize("dtype,impl", [(torch.float64, "eager"), (torch.float32, None)])
@pytest.mark.parametrize("aux", [False, True])
def test_sebp_experts_give_the_models_loss_and_gradients(model_type, dtype, impl, aux):
    """fp64 against transformers' eager loop over the hit experts (another computation: to ~1e-12); fp32 against
    its default grouped_mm (the same products)."""
    dense = _model(model_type, dtype, aux, impl)
    batch = _batch()
    want_loss, want = loss_and_grads(dense, batch)
    sebp = copy.deepcopy(dense)
    names = patch_model(sebp)
    assert patched_experts(sebp) == [f"model.layers.{i}.mlp.experts" for i in ((0, 1) if model_type == "mixtral"
                                                                                else (1,))]
    assert all(".experts" not in n for n in names)  # the linears' names only
    loss, got = loss_and_grads(sebp, batch)
    rtol = 1e-6 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(loss, want_loss, rtol=rtol, atol=0)
    assert got.keys() == want.keys() and any(".experts." in k for k in got) and any(".gate." in k for k in got)
    for k in want:
        scale = float(want[k].abs().max())
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=rtol * max(scale, 1e-12), msg=lambda m, k=k: k)


@pytest.mark.parametrize("model_type", MOE)
def test_patch_and_unpatch_keep_the_parameters(model_type, caplog):
    model = _model(model_type, torch.float32, aux=False)
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    cls_forward = type(model.model.layers[1].mlp.experts).forward
    with caplog.at_level(logging.WARNING, logger="sebp_probe"):
        patch_model(model)
    name = "Mixtral" if model_type == "mixtral" else "Qwen3-MoE"
    assert [r.getMessage() for r in caplog.records] == [
        f"{name}: SEBP runs on the fused experts (mlp.experts: gate_up_proj and down_proj, backward over their "
        "routed rows whose dL/dY is not zero) beside the projections; the router (mlp.gate) stays dense"]
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before
    experts = model.model.layers[1].mlp.experts
    assert "forward" in vars(experts)
    assert patch_experts(model, family_of(model), note) == patched_experts(model)  # again: nothing changes
    unpatched = unpatch_model(model)
    assert "model.layers.1.mlp.experts" in unpatched and not patched_experts(model)
    assert "forward" not in vars(experts) and type(experts).forward is cls_forward
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before


def test_named_targets_leave_the_experts_dense():
    model = _model("mixtral", torch.float32, aux=False)
    patch_model(model, target_modules=["q_proj"])
    assert not patched_experts(model)


def test_experts_in_another_layout_stay_dense_said_in_one_line(caplog):
    model = _model("mixtral", torch.float32, aux=False)
    model.model.layers[0].mlp.experts.has_bias = True  # a layout the SEBP experts do not compute
    assert experts_layout_problem(model.model.layers[0].mlp.experts) == "has_bias is True"
    with caplog.at_level(logging.WARNING, logger="sebp_probe"):
        assert patch_experts(model, family_of(model), note) == ["model.layers.1.mlp.experts"]
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.endswith("; so do the experts model.layers.0.mlp.experts (has_bias is True): the SEBP experts take "
                         "the fused layout only")


@pytest.mark.parametrize("model_type", MOE)
def test_the_labelled_head_is_refused_where_the_routers_loss_is_on(model_type):
    assert choose_head(_model(model_type, torch.float32, aux=False), "causal-lm", "labelled") == (
        Head("labelled", "causal-lm"), None)
    head, why = choose_head(_model(model_type, torch.float32, aux=True), "causal-lm", "labelled")
    assert head == FULL and "load-balancing loss (output_router_logits)" in why
