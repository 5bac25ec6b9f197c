"""A training step's loss (``Head.loss`` of :mod:`sebp_probe.model.losses`) under ``torch.compile``: Dynamo captures the
forward in one graph, with no graph break (so no host sync), and AOTAutograd the backward with it, on a tiny Llama's
packed batch (both attention layouts) and a tiny BERT classifier's ``longest`` batch, both through the labelled-rows
head, and the BERT's packed batch by varlen attention (in both directions, the model's own head); also with SEBP
patched (exact mode, linears, norms and activations: the ``sebp::`` custom ops). The compiled step gives the eager
loss and gradients. ``aot_eager`` runs the graphs Inductor would get without Inductor's C++ compile (minutes on two
CPU cores); ``finetune --compile default`` runs Inductor (tests/probe/test_finetune_compile.py).

A padded causal-LM batch traces without a break where its collator counted the labelled rows on the host
(``PadCollator(counts=True)``, what a compiled finetune run's loaders do: ``n_targets``, ``max_row_targets``, as
packed batches always carry). What still breaks, by design: without those counts (and on masked-LM batches) the
labelled-rows head counts its labelled rows on the device (``nonzero``, then the most in one sequence)."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo

from sebp_kernels import SEBPConfig, registry
from sebp_probe.model import packing
from sebp_probe.model.losses import head_for
from sebp_probe.model.patch import patch_sebp
from tests.probe.test_packing import _items, _packed, _padded
from tests.tiny_models import tiny_model


def traceable_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                     enable_gqa=False):
    """varlen_attn's contract on [T, heads, dim] tensors as one masked sdpa (the per-sequence stand-in of
    test_packing reads the offsets on the host, which Dynamo would break at)."""
    pos = torch.arange(q.shape[0], device=q.device)
    seq = torch.bucketize(pos, cu_seq_q[1:], right=True)
    mask = seq[:, None] == seq[None, :]
    if tuple(window_size) == (-1, 0):
        mask &= pos[None, :] <= pos[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                           attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out.transpose(0, 1)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    dynamo.reset()
    dynamo.utils.counters.clear()
    yield
    dynamo.reset()


def _case(name: str, monkeypatch) -> tuple[torch.nn.Module, object, dict]:
    """(model, the labelled-rows head's loss, one training batch); a packed BERT runs the model's own head (the
    [CLS]-rows layer takes padded batches only)."""
    arch, layout = name.split("-", 1)
    model, items = tiny_model(arch), _items(arch)
    head = "full" if arch == "bert" and layout != "longest" else "labelled"
    chosen, why = head_for(model, "classification" if arch == "bert" else "causal-lm", head)
    assert why is None
    if layout == "packed-varlen":
        monkeypatch.setattr(packing, "VARLEN_KERNEL", traceable_varlen)
        monkeypatch.setattr(packing, "attention_backend", lambda model: "varlen")
        packing.enable_varlen(model)  # a one-time switch of the model, made before compiling
    return model, chosen.loss, (_padded(arch, items, counts=True) if layout == "longest" else _packed(arch, items))


def _step(loss_fn, model, batch) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
@pytest.mark.parametrize("sebp", [False, True], ids=["dense", "sebp"])
@pytest.mark.parametrize("case", ["llama-packed-mask", "llama-packed-varlen", "llama-longest", "bert-longest",
                                  "bert-packed-varlen"])
def test_compiled_step_is_one_graph_and_equals_eager(case, sebp, monkeypatch):
    model, loss, batch = _case(case, monkeypatch)
    if sebp:
        patch_sebp(model, SEBPConfig(mode="exact"), norms=True, acts=True)
    want = _step(loss, model, batch)
    calls = []  # the compiled sebp:: ops look their layer up (eager SEBP does not)
    real = registry.lookup
    monkeypatch.setattr(registry, "lookup", lambda key: calls.append(key) or real(key))
    got = _step(torch.compile(loss, backend="aot_eager"), model, batch)
    breaks = dict(dynamo.utils.counters["graph_break"])
    assert not breaks, f"graph breaks: {breaks}"
    assert dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert bool(calls) == sebp
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0)
    assert got[1].keys() == want[1].keys()
    for k in want[1]:
        torch.testing.assert_close(got[1][k], want[1][k], rtol=1e-5, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")


def test_a_compiled_first_step_is_not_compiled_again_at_the_second():
    """The labelled-rows head's last-layer forward is installed when the head is chosen, not inside the first
    compiled call (there the second call would find the layer changed and compile again)."""
    model, items = tiny_model("llama"), _items("llama")
    head, _ = head_for(model, "causal-lm", "labelled")
    step = torch.compile(head.loss, backend="eager")
    batch = _packed("llama", items)
    for _ in range(2):
        step(model, batch).backward()
    assert dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.slow
def test_packed_labelled_head_traces_in_one_graph():
    """The fast check of the above (no backward, no compile): Dynamo's own account of the forward."""
    model, items = tiny_model("llama"), _items("llama")
    head, _ = head_for(model, "causal-lm", "labelled")
    ex = dynamo.explain(head.loss)(model, _packed("llama", items))
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), [r.reason for r in ex.break_reasons]


@pytest.mark.slow
def test_padded_causal_lm_labelled_head_breaks_at_its_row_count_without_the_counts():
    """The break that remains without the collator's counts (see the module docstring), named so that a change
    to it shows here."""
    model, items = tiny_model("llama"), _items("llama")
    head, _ = head_for(model, "causal-lm", "labelled")
    ex = dynamo.explain(head.loss)(model, _padded("llama", items))
    assert ex.graph_break_count >= 1
    reasons = " ".join(r.reason for r in ex.break_reasons)
    assert "aten.nonzero" in reasons, reasons


def test_code_of_compiled_steps_imports_no_name_from_transformers_top_level():
    """torch 2.11's Dynamo cannot trace ``from transformers import X`` (transformers' top-level module is lazy):
    on a GPU machine with torch 2.11 it broke the compiled step's graph in ``packing.unwrap``. Code that runs in
    a compiled step (sebp_probe.model, the families' hooks) imports from transformers' submodules instead."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "sebp_probe"
    found = []
    for path in [*sorted((root / "model").glob("*.py")), root / "families.py"]:
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found += [f"{path.name}:{n.lineno}" for n in ast.walk(fn)
                          if isinstance(n, ast.ImportFrom) and n.module == "transformers"]
    assert not found, f"function-level `from transformers import` in {found}"
