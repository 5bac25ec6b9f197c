"""PadRows (sebp_kernels.pad_rows): the padding rows from the attention mask, checked before they are used.

The host logic runs on the CPU directly; the whole path (a patched tiny model whose Triton backward takes the
rows) runs under the Triton interpreter in a subprocess (TRITON_INTERPRET must be set before the kernels are
decorated), and on a GPU where there is one.
"""
from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch

from sebp_kernels.pad_rows import CHECKING, OFF, ON, PadRows


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(autouse=True)
def _forward_rows_always(monkeypatch):
    """The forward over real rows on the tiny models too (sebp_kernels.forward_rows.pays keeps it to large
    batches), so the models' steps after the check go through it. The lines keep the product's types: a float
    against a symbolic size, asked inside the autograd Function's forward, once failed Dynamo (an int did not)."""
    from sebp_kernels import forward_rows

    assert isinstance(forward_rows.MIN_SKIPPED, float)  # the product's type, kept below
    monkeypatch.setattr(forward_rows, "MIN_ROWS", 0)
    monkeypatch.setattr(forward_rows, "MIN_SKIPPED", 0.0)
    real = forward_rows.linear_over_rows
    _FORWARD_ROWS.clear()
    monkeypatch.setattr(forward_rows, "linear_over_rows", lambda *a: _FORWARD_ROWS.append(1) or real(*a))


_FORWARD_ROWS: list = []  # calls of the forward over real rows in the current test


def _mask():
    return torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])


def test_rows_are_the_select_pass_form():
    """Real-token rows first in row order, then the padding rows; their count on the device, int32."""
    pad = PadRows()
    pad.set(_mask())
    perm, count, flat = pad.rows
    assert flat.numel() == 12 and count.tolist() == [9] and perm.dtype == count.dtype == torch.int32
    assert perm[:9].tolist() == [0, 1, 2, 4, 5, 8, 9, 10, 11]
    assert sorted(perm.tolist()) == list(range(12))


def test_left_or_inner_padding_names_no_rows():
    """Only right padding names padding rows (left padding can put a pooled position on the padding): any
    other mask gives every row, in order."""
    pad = PadRows()
    for mask in (_mask().flip(1), torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]])):
        pad.set(mask)
        perm, count, flat = pad.rows
        m = mask.numel()
        assert count.item() == m == flat.numel() and perm.tolist() == list(range(m)) and flat.all()


def test_checks_first_then_turns_on():
    """The first backward only checks (returns no rows, so the linear selects); the next forward reads the
    check: no padding row had gradient, so the rows are handed out from then on."""
    pad = PadRows()
    pad.set(_mask())
    dy = torch.randn(3, 4, 5) * _mask()[..., None]
    assert pad.bind(None, (3, 4, 8)).take(dy) is None and pad.checked == 1 and pad.state == CHECKING
    pad.set(_mask())
    assert pad.state == ON
    perm, count = pad.bind(None, (3, 4, 8)).take(dy)
    assert count.tolist() == [9] and pad.taken == 1


def test_a_checked_but_undecided_verdict_is_decided_when_asked():
    """verdict(): None before any check; after a checked backward (the decision would come at the next forward)
    it decides at once, as a checkpoint written right after that step needs."""
    pad = PadRows()
    assert pad.verdict() is None
    pad.set(_mask())
    assert pad.verdict() is None
    pad.bind(None, (3, 4, 8)).take(torch.randn(3, 4, 5) * _mask()[..., None])
    assert pad.state == CHECKING and pad.verdict() == ON and pad.state == ON and pad.checked == 0
    bad = PadRows()
    bad.set(_mask())
    bad.bind(None, (3, 4, 8)).take(torch.randn(3, 4, 5))  # gradient on the padding rows
    with pytest.warns(UserWarning, match="padding row"):
        assert bad.verdict() == OFF


def test_gradient_on_padding_turns_it_off_with_a_warning():
    pad = PadRows()
    pad.set(_mask())
    pad.bind(None, (3, 4, 8)).take(torch.randn(3, 4, 5))  # every row non-zero: the loss reaches the padding
    with pytest.warns(UserWarning, match="padding row"):
        pad.set(_mask())
    assert pad.state == OFF and pad.rows is None and pad.bind("hint", (3, 4, 8)) == "hint"


def test_a_linear_far_sparser_than_the_padding_selects_its_own_rows():
    """The check also counts each linear's non-zero rows: one with at most OWN_BELOW of the real-token rows
    (here 2 of 9) selects its own rows from the verdict on, eagerly and compiled; the others take the padding
    rows."""
    from sebp_kernels.pad_rows import bind_traced

    class Linear:
        pass

    pad = PadRows()
    pad.set(_mask())
    sparse, full, empty = Linear(), Linear(), Linear()
    dy = torch.randn(3, 4, 5) * _mask()[..., None]
    few = torch.zeros(3, 4, 5)
    few[0, 0], few[2, 1] = 1.0, -2.0
    assert pad.bind(None, (3, 4, 8), sparse).take(few) is None and pad.bind(None, (3, 4, 8), full).take(dy) is None
    pad.bind(None, (3, 4, 8), empty).take(torch.zeros(3, 4, 5))  # no row at all (a batch without a target)
    pad.set(_mask())
    assert pad.state == ON and sparse.sebp_own_rows and not hasattr(full, "sebp_own_rows")
    assert not hasattr(empty, "sebp_own_rows")  # no non-zero row says nothing about the layer
    assert pad.bind("hint", (3, 4, 8), sparse) == "hint"
    assert pad.bind(None, (3, 4, 8), full).take(dy)[1].tolist() == [9]
    perm, count, real = pad.traced()
    assert bind_traced(pad, "hint", (3, 4, 5), perm, count, real, sparse) == "hint"
    assert bind_traced(pad, None, (3, 4, 5), perm, count, real, full).take(dy)[1].tolist() == [9]
    assert pad.taken == 2


def test_own_rows_decided_before_an_unpatch_stay_with_the_model():
    """A check still awaiting its verdict when the model is unpatched (calibration times dense in between) is
    decided first, on the live SEBP linears; the mark passes to the plain linears and back at the next patch."""
    from sebp_kernels import SEBPConfig
    from sebp_probe import patch_model, unpatch_model
    from sebp_probe.model.patch import pad_rows_own
    from tests.tiny_models import tiny_model

    model = tiny_model("bert")
    patch_model(model, SEBPConfig("exact"))
    pad = model.base_model._sebp_pad_rows
    pad.set(_mask())
    name = "bert.encoder.layer.1.output.dense"
    few = torch.zeros(3, 4, 5)
    few[0, 0] = 1.0
    pad.bind(None, (3, 4, 8), model.get_submodule(name)).take(few)
    unpatch_model(model)
    assert pad.state == ON and model.get_submodule(name).sebp_own_rows  # the plain linear carries it
    assert pad_rows_own(model) == [name]  # and a summary written after the unpatch (a saved model) counts it
    patch_model(model, SEBPConfig("exact"))
    assert pad_rows_own(model) == [name] and model.base_model._sebp_pad_rows is pad


def test_other_row_counts_and_an_activation_hint_come_first():
    class Hint:
        def take(self, t):
            return "activation rows" if t.shape[-1] == 7 else None

    pad = PadRows()
    pad.state = ON
    pad.set(_mask())
    assert pad.bind("hint", (12, 8)) == "hint"  # an input of other leading dims (an expert's routed tokens)
    assert pad.bind("hint", (4, 3, 8)) == "hint"
    bound = pad.bind(Hint(), (3, 4, 8))
    assert bound.take(torch.zeros(3, 4, 7)) == "activation rows"
    assert bound.take(torch.zeros(2, 4, 5)) is None  # another row count: not this batch's rows
    assert bound.take(torch.zeros(12, 5))[1].tolist() == [9]  # the same rows flattened


def test_a_patch_without_forward_rows_keeps_every_forward_on_all_rows():
    """``patch_model(forward_rows=False)``: once the check is on, the backward still takes the padding rows,
    and the forward computes every row (no real-token rows handed to it); a later patch may turn it back on."""
    from sebp_kernels import SEBPConfig
    from sebp_probe import patch_model
    from tests.tiny_models import tiny_model

    model = tiny_model("bert")
    patch_model(model, SEBPConfig("exact"), forward_rows=False)
    pad = model.base_model._sebp_pad_rows
    pad.set(_mask())
    pad.state = ON
    assert pad.forward_rows((3, 4, 8)) is None and pad.bind(None, (3, 4, 8)) is not None
    patch_model(model, SEBPConfig("exact"))
    assert model.base_model._sebp_pad_rows is pad and pad.forward_rows((3, 4, 8))[1].tolist() == [9]


def test_patch_model_hooks_the_backbone_and_unpatch_removes_it(monkeypatch):
    from sebp_kernels import SEBPConfig
    from sebp_probe import patch_model, unpatch_model
    from tests.tiny_models import padded_batch, tiny_model

    from sebp_probe.model import patch as patch_module

    monkeypatch.setattr(patch_module, "_triton_backward_on", lambda device: False)
    model = tiny_model("bert")
    patch_model(model, SEBPConfig("exact"))
    batch = padded_batch("bert", lengths=(5, 3, 7))
    model(**batch)
    pad = model.base_model._sebp_pad_rows
    assert pad.rows is None  # a CPU batch: the torch backward selects its rows itself
    monkeypatch.setattr(patch_module, "_triton_backward_on", lambda device: True)  # as under the interpreter
    model(**batch)
    assert pad.rows[1].tolist() == [15] and pad.state == CHECKING
    with torch.no_grad():
        model(**batch)
    assert pad.rows is None  # no backward follows: nothing set
    twin = copy.deepcopy(model)
    twin(**batch)
    assert twin.base_model._sebp_pad_rows.rows is not None and pad.rows is None  # each copy its own
    from sebp_probe.model.patch import pad_rows_summary

    assert pad_rows_summary(model) is None  # never checked (no backward here)
    pad.state, pad.taken = ON, 7
    assert pad_rows_summary(model) == {"state": "on", "taken": 7, "own": 0}
    unpatch_model(model)
    assert not model.base_model._forward_pre_hooks
    model(**batch)
    assert pad.rows is None
    patch_model(model, SEBPConfig("exact"), pad_rows=False)
    assert not model.base_model._forward_pre_hooks


def _grads(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _dense_and_patched(arch, device, dtype, backend):
    """A tiny model and a copy with SEBP linears, norms and activations, and the copy's PadRows."""
    from sebp_kernels import SEBPConfig
    from sebp_probe import patch_activations, patch_model, patch_norms
    from tests.tiny_models import tiny_model

    torch.manual_seed(0)
    dense = tiny_model(arch).eval().to(device, dtype)
    model = copy.deepcopy(dense)
    patch_model(model, SEBPConfig("exact", backend=backend))
    patch_norms(model, SEBPConfig("exact", backend=backend))
    patch_activations(model)
    return dense, model, model.base_model._sebp_pad_rows


def _same_step(run, dense, batch, atol, rtol) -> None:
    """One step of ``run`` (a model, or its compiled wrapper, whose parameter names ``_orig_mod.`` leads) on
    ``batch``: the loss and gradients of ``dense``."""
    from tests.helpers import assert_close_report

    loss, got = _grads(run, batch)
    want_loss, want = _grads(dense, batch)
    assert_close_report(loss, want_loss, atol=atol, rtol=rtol, name="loss")
    prefix = "_orig_mod." if any(n.startswith("_orig_mod.") for n in got) else ""
    for n in want:
        assert_close_report(got[prefix + n], want[n], atol=atol, rtol=rtol, name=n)


def _check_model(arch, device, dtype, backend, atol, rtol):
    """SEBP with the padding rows against dense, over three steps (check, then the rows used twice), right and
    left padding; returns the PadRows."""
    from tests.tiny_models import padded_batch

    dense, model, pad = _dense_and_patched(arch, device, dtype, backend)
    for step, (lengths, side) in enumerate((((11, 4, 7), "right"), ((9, 3, 5), "right"), ((6, 2, 8), "left"))):
        _same_step(model, dense, {k: v.to(device) for k, v in padded_batch(arch, lengths, side, seed=step).items()},
                   atol, rtol)
    assert pad.state == ON and pad.taken == 2 * _taking(model, arch)
    assert _FORWARD_ROWS  # the step after the check computed its forward on the real rows
    return pad


def _taking(model, arch) -> int:
    """How many linears take the padding rows in a step after the check: every token-wise one (q, k, v, o and the
    MLP's output; the MLP's input linears take the activation's rows first), but for those whose dY is far
    sparser, which select their own (a [CLS] classifier's last layer past its attention: q, o and the MLP's
    output carry the CLS rows only)."""
    from sebp_probe.model.patch import pad_rows_own

    last = model.config.num_hidden_layers - 1
    own = [f"bert.encoder.layer.{last}.{n}" for n in ("attention.output.dense", "attention.self.query",
                                                       "output.dense")] if arch == "bert" else []
    assert pad_rows_own(model) == own
    return 5 * model.config.num_hidden_layers - len(own)


def _check_prompt_masked_lm(device, dtype, backend, atol, rtol):
    """A causal LM whose labels leave the prompt out (SFT), the LM head an SEBP linear too, its norms and
    activations SEBP's: the LM head and the last layer's q, o and MLP output get gradient on the answer rows
    only, far fewer than the real tokens; they select their own rows after the check, the others take the padding
    rows, and the gradients stay dense's."""
    from sebp_kernels import SEBPConfig
    from sebp_probe import patch_activations, patch_model, patch_norms
    from sebp_probe.families import FAMILIES
    from sebp_probe.model.patch import pad_rows_own, pad_rows_summary
    from tests.tiny_models import padded_batch, tiny_model

    torch.manual_seed(0)
    dense = tiny_model("llama").eval().to(device, dtype)
    model = copy.deepcopy(dense)
    patch_model(model, SEBPConfig("exact", backend=backend), FAMILIES["llama"].targets + ("lm_head",))
    patch_norms(model, SEBPConfig("exact", backend=backend))
    patch_activations(model)
    pad = model.base_model._sebp_pad_rows
    for step, lengths in enumerate(((11, 4, 7), (9, 6, 5), (12, 8, 10))):
        batch = padded_batch("llama", lengths, seed=step)
        for i, n in enumerate(lengths):  # the first three quarters of each sequence are its prompt
            batch["labels"][i, : n - max(1, n // 4)] = -100
        _same_step(model, dense, {k: v.to(device) for k, v in batch.items()}, atol, rtol)
    last = model.config.num_hidden_layers - 1
    own = ["lm_head"] + [f"model.layers.{last}.{n}" for n in ("mlp.down_proj", "self_attn.o_proj",
                                                              "self_attn.q_proj")]
    assert pad_rows_own(model) == own
    assert pad_rows_summary(model) == {"state": ON, "taken": 2 * (5 * (last + 1) - 3), "own": 4}


def _check_compiled_layers(arch, device, dtype, backend, atol, rtol, row_bound=None):
    """Each layer compiled (the pre-hook eager; ``row_bound`` given to :func:`compile_layers`): the linears'
    backward operators take the padding rows their forward passed on as graph inputs, checked first; the verdict
    "on" compiles nothing again, and a batch of another length (dynamic shapes) neither. The whole model compiled:
    the traced pre-hook names no rows (no earlier batch's rows are read), and the linears select theirs. The
    layers call the forward over rows (the autouse fixture lets every shape pay; shapes that never pay:
    test_interp_compiled_layers_not_told_the_most_rows_...)."""
    from sebp_kernels import functional

    calls = []
    real = functional.linear_maybe_over_rows  # what the forward operator runs
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(functional, "linear_maybe_over_rows", lambda *a: calls.append(1) or real(*a))
        _compiled_layers_steps(arch, device, dtype, backend, atol, rtol, row_bound)
    assert calls and _FORWARD_ROWS


def _compiled_layers_steps(arch, device, dtype, backend, atol, rtol, row_bound):
    """The steps of :func:`_check_compiled_layers`."""
    from sebp_probe.train.compiling import compile_layers, dynamo_counts
    from tests.tiny_models import padded_batch

    dense, model, pad = _dense_and_patched(arch, device, dtype, backend)
    dense.train(), model.train()  # compile_layers runs a layer eagerly in eval mode (no dropout here)
    batches = [{k: v.to(device) for k, v in padded_batch(arch, lengths, seed=i).items()}
               for i, lengths in enumerate(((11, 4, 7), (9, 3, 5), (6, 11, 10)))]
    torch._dynamo.reset()
    undo = compile_layers(model, backend="aot_eager", dynamic=True, row_bound=row_bound)
    try:
        assert pad.row_bound == row_bound
        _same_step(model, dense, batches[0], atol, rtol)
        assert pad.state == CHECKING and pad.checked > 0 and pad.taken == 0
        graphs = dynamo_counts()[0]
        assert graphs > 0  # the layers ran compiled
        _same_step(model, dense, batches[1], atol, rtol)  # another length, after the verdict
        assert pad.state == ON and pad.taken == _taking(model, arch)
        assert dynamo_counts()[0] == graphs  # neither the verdict nor the length compiled again
        _same_step(model, dense, batches[2], atol, rtol)  # the first batch's length again
        assert pad.taken == 2 * _taking(model, arch) and dynamo_counts()[0] == graphs
    finally:
        undo()
        assert pad.row_bound is None
        torch._dynamo.reset()
    taken = pad.taken
    whole = torch.compile(model, backend="aot_eager", dynamic=True)
    try:  # the eager pre-hook set the rows of batches[1] last: never read here (they are not batches[0]'s)
        _same_step(whole, dense, batches[0], atol, rtol)
        assert pad.taken == taken and pad.rows is None
    finally:
        torch._dynamo.reset()


def _check_labels_on_padding(device, backend):
    """A causal LM whose labels were left on the padding: the check turns the rows off, gradients stay
    right."""
    from sebp_kernels import SEBPConfig
    from sebp_probe import patch_model
    from tests.tiny_models import padded_batch, tiny_model

    model = tiny_model("llama").eval().to(device)
    patch_model(model, SEBPConfig("exact", backend=backend))
    pad = model.base_model._sebp_pad_rows
    batch = {k: v.to(device) for k, v in padded_batch("llama").items()}
    batch["labels"] = batch["input_ids"].clone()  # the padding's labels kept: the loss reaches those rows
    _grads(model, batch)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _grads(model, batch)
    assert pad.state == OFF and pad.taken == 0 and any("padding row" in str(w.message) for w in seen)


if not INTERPRET:

    @pytest.mark.gpu
    @pytest.mark.parametrize("arch", ["bert", "llama"])
    @pytest.mark.parametrize("check", [_check_model, _check_compiled_layers], ids=["eager", "compiled_layers"])
    def test_gpu_models_with_padding_rows_match_dense(arch, check):
        if not torch.cuda.is_available():
            pytest.skip("needs a GPU")
        check(arch, "cuda", torch.float32, "triton", 2e-5, 1e-4)

    @pytest.mark.gpu
    def test_gpu_linears_far_sparser_than_the_padding_select_their_own_rows():
        if not torch.cuda.is_available():
            pytest.skip("needs a GPU")
        _check_prompt_masked_lm("cuda", torch.float32, "triton", 2e-5, 1e-4)

    @pytest.mark.gpu
    def test_gpu_labels_on_padding_turn_the_rows_off():
        if not torch.cuda.is_available():
            pytest.skip("needs a GPU")
        _check_labels_on_padding("cuda", "triton")

else:

    def test_interp_models_with_padding_rows_match_dense():
        """Bert, with its own-rows layers, right and left padding; the Llama eagerly (its RMSNorm and SwiGLU
        taking the rows too) in test_interp_linears_far_sparser_than_the_padding_select_their_own_rows."""
        _check_model("bert", "cpu", torch.float32, "triton", 1e-5, 1e-4)

    def test_interp_labels_on_padding_turn_the_rows_off():
        _check_labels_on_padding("cpu", "triton")

    def test_interp_linears_far_sparser_than_the_padding_select_their_own_rows():
        _check_prompt_masked_lm("cpu", torch.float32, "triton", 1e-5, 1e-4)

    def test_interp_compiled_layers_take_the_padding_rows(monkeypatch):
        """The compiled path on one architecture: compiling does not depend on it (bert's own-rows layers, its
        LayerNorm and GELU take the rows eagerly in test_interp_models_with_padding_rows_match_dense[bert], and
        compiled on a GPU in test_gpu_models_with_padding_rows_match_dense[compiled_layers-bert]). The forward's
        line (MIN_ROWS) at 30 lies between the batches' 33 and 27 rows and the layers are told the run's most
        rows (33): they call the forward operator at every size (it decides per batch: the second batch's rows
        under the line, the third's over it) and compile once. Not told, or told a bound under the line:
        test_interp_compiled_layers_not_told_the_most_rows_..."""
        from sebp_kernels import forward_rows

        monkeypatch.setattr(forward_rows, "MIN_ROWS", 30)
        _check_compiled_layers("llama", "cpu", torch.float32, "triton", 1e-5, 1e-4, row_bound=33)

    def test_interp_compiled_layers_not_told_the_most_rows_compile_again_under_the_forward_line():
        """Batches on both sides of the row count at which the forward over real rows can pay (told the run's
        most rows, the layers compile once: test_interp_compiled_layers_take_the_padding_rows): not told, the
        batch under the line compiles them again (a guard on its row count); told a bound under the line, layers
        whose rows can never pay trace F.linear, with the dense gradients and the padding rows still taken in the
        backward."""
        first, last, _ = _graphs_over_min_rows(None)
        assert last > first
        first, last, calls = _graphs_over_min_rows(20)  # a bound under the line: F.linear traced, never the operator
        assert last == first and calls == 0


def _graphs_over_min_rows(row_bound) -> tuple[int, int, int]:
    """A tiny Llama's layers compiled (``row_bound`` given to :func:`compile_layers`), the padding rows checked on
    a batch of 33 rows, then a batch of 27 rows (taking them) with the forward's line (MIN_ROWS) at 30 between
    the two: (graphs after the first batch, graphs after the second, calls of the forward operator). Each step's
    gradients are dense's."""
    from sebp_kernels import forward_rows, functional
    from sebp_probe.train.compiling import compile_layers, dynamo_counts
    from tests.tiny_models import padded_batch

    dense, model, pad = _dense_and_patched("llama", "cpu", torch.float32, "triton")
    dense.train(), model.train()
    batches = [padded_batch("llama", lengths, seed=i) for i, lengths in enumerate(((11, 4, 7), (9, 3, 5)))]
    calls, real = [], functional.linear_maybe_over_rows
    torch._dynamo.reset()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(forward_rows, "MIN_ROWS", 30)
        mp.setattr(functional, "linear_maybe_over_rows", lambda *a: calls.append(1) or real(*a))
        undo = compile_layers(model, backend="aot_eager", dynamic=True, row_bound=row_bound)
        try:
            assert pad.row_bound == row_bound
            _same_step(model, dense, batches[0], 1e-5, 1e-4)
            first = dynamo_counts()[0]
            _same_step(model, dense, batches[1], 1e-5, 1e-4)
            assert pad.state == ON and pad.taken > 0  # the second batch's backward took the padding rows
            return first, dynamo_counts()[0], len(calls)
        finally:
            undo()
            assert pad.row_bound is None
            torch._dynamo.reset()


def test_a_verdict_is_read_for_a_checkpoint_and_restored_on_resume():
    """pad_rows_verdict / restore_pad_rows: on or off is kept (a resumed run does not check again, which would
    have its first backwards select rows themselves and sum in another order); checking is not a verdict. The
    linears that select their own rows (pad_rows_own) are kept by name."""
    from sebp_kernels import SEBPConfig
    from sebp_probe import patch_model
    from sebp_probe.model.patch import pad_rows_own, pad_rows_verdict, restore_pad_rows
    from tests.tiny_models import tiny_model

    model = tiny_model("bert")
    assert pad_rows_verdict(model) is None  # no SEBP linears: no padding rows
    patch_model(model, SEBPConfig("exact"))
    pad = model.base_model._sebp_pad_rows
    assert pad.state == CHECKING and pad_rows_verdict(model) is None
    for verdict in (ON, OFF):
        pad.state = verdict
        assert pad_rows_verdict(model) == verdict
        twin = tiny_model("bert")
        patch_model(twin, SEBPConfig("exact"))
        restore_pad_rows(twin, pad_rows_verdict(model))
        assert twin.base_model._sebp_pad_rows.state == verdict
    restore_pad_rows(twin, None)  # a checkpoint written before verdicts were kept, or while checking
    assert twin.base_model._sebp_pad_rows.state == OFF
    name = "bert.encoder.layer.1.output.dense"
    assert pad_rows_own(model) == []
    model.get_submodule(name).sebp_own_rows = True  # as the check sets it
    assert pad_rows_own(model) == [name]
    twin = tiny_model("bert")
    patch_model(twin, SEBPConfig("exact"))
    restore_pad_rows(twin, ON, pad_rows_own(model))
    assert pad_rows_own(twin) == [name] and twin.base_model._sebp_pad_rows.state == ON
    # names as a wrapper inserts them (FSDP1's flat-parameter modules) are the plain ones
    from sebp_probe.model.patch import _plain_name

    assert _plain_name("bert._fsdp_wrapped_module.encoder.layer.1._fsdp_wrapped_module.output.dense") == \
        "bert.encoder.layer.1.output.dense"
