"""``finetune --compile`` on the CPU: compiled (Inductor) exact SEBP trains as compiled dense does; and where
it cannot run (no C compiler, a Python/torch Dynamo does not support, a forward that does not trace) one
note in the summary says so and the run trains eagerly, to the eager run's losses."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo

from sebp_probe.train import compiling
from sebp_probe.config import DataConfig
from sebp_probe.data.batching import padded_length
from tests.convergence.finetune_helpers import isolated_accelerate, synthetic_data  # noqa: F401
from tests.probe.test_finetune_compile import _losses, _run
from tests.tiny_models import tiny_model

@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(compiling, "_PROBED", {})
    dynamo.reset()
    yield
    dynamo.reset()


def _goes_on_eagerly(tmp_path, needle: str, make_model=lambda: tiny_model("bert"), scope: str = "layers",
                     reported: str = "eager") -> None:
    """``reported``: the summary's compile scope (``eager`` where Inductor cannot run at all; a scope that set
    up its compile and fell back at the first step keeps its name)."""
    compiled = _run(tmp_path, "compiled", make_model, compile="default", compile_scope=scope)
    assert compiled["compile"]["scope"] == reported
    # a run this short also takes its SEBP calibration untimed within --calib-budget, and says so
    (line,) = [n for n in compiled["notes"] if not n.startswith("calibration: the budget")]
    assert line.startswith("--compile default: ") and needle in line and line.endswith("; training eagerly")
    assert "\n" not in line
    eager = _run(tmp_path, "eager", make_model)
    assert compiled["status"] == eager["status"] == "completed"
    assert compiled["compile"]["graphs"] == 0
    assert _losses(tmp_path / "compiled" / "metrics.jsonl") == _losses(tmp_path / "eager" / "metrics.jsonl")


def test_a_compiled_run_tells_its_layers_the_most_rows_of_a_batch(tmp_path, monkeypatch):
    """finetune --compile (by layers): the layers compile knowing a micro-batch's most rows, batch size x its
    longest example as padded (a multiple of 8 here, at most max length), with which the SEBP linears decide
    once whether their forward over the real rows could pay (sebp_kernels.functional._over_rows) instead of
    guarding on each batch's rows."""
    bounds = []
    monkeypatch.setattr(compiling, "cannot_compile", lambda mode, device: False)
    monkeypatch.setattr(compiling, "compile_layers",
                        lambda model, fallback=None, row_bound=None, **kw: bounds.append(row_bound) or (lambda: None))
    data = synthetic_data("classification", n=40, n_eval=8, max_len=13)  # examples up to 13 tokens
    out = _run(tmp_path, "bound", task_data=data, compile="default",
               data=DataConfig(max_length=64, batch_size=8, padding="longest"))
    longest = max(len(x["input_ids"]) for x in data.train)
    assert out["status"] == "completed" and bounds and set(bounds) == {8 * padded_length(longest, 64, 8)}


@pytest.mark.slow
def test_no_c_compiler_trains_eagerly(tmp_path, monkeypatch):
    # Inductor's own patch (monkeypatch's undo left its config without the key: later compiles in the process
    # failed with "config.cpp.cxx does not exist")
    with torch._inductor.config.patch({"cpp.cxx": (None, "/nonexistent/c++")}):
        _goes_on_eagerly(tmp_path, "torch.compile cannot run here (InductorError: InvalidCxxCompiler")
    assert torch._inductor.config.cpp.cxx != (None, "/nonexistent/c++")


@pytest.mark.slow
def test_compile_auto_without_a_c_compiler_times_and_trains_eagerly(tmp_path):
    """``--padding auto --compile auto``: the compiled candidates cannot run: one line, the eager candidates
    only, and an eager run."""
    with torch._inductor.config.patch({"cpp.cxx": (None, "/nonexistent/c++")}):
        out = _run(tmp_path, "auto", method="dense", compile="auto", max_steps=60, calib_budget=1.0,  # all timed
                   data=DataConfig(max_length=24, batch_size=8, padding="auto"))
    (line,) = out["notes"]
    assert line.startswith("--compile auto: torch.compile cannot run here (InductorError: InvalidCxxCompiler")
    assert line.endswith("; training eagerly") and "\n" not in line
    assert out["status"] == "completed" and "compile" not in out
    rows = [r for r in out["padding_choice"]["table"] if "skipped" not in r]
    assert rows and all("dense_ms" in r and not any("compiled" in k for k in r) for r in rows)
    assert not out["padding_choice"]["compiled"]


@pytest.mark.slow
def test_unsupported_python_or_torch_trains_eagerly(tmp_path, monkeypatch):
    def unsupported():
        raise RuntimeError("Python 3.99+ not yet supported for torch.compile")

    monkeypatch.setattr(torch._dynamo.eval_frame, "check_if_dynamo_supported", unsupported)
    _goes_on_eagerly(tmp_path, "cannot run here (RuntimeError: Python 3.99+ not yet supported")


@torch.library.custom_op("sebp_test::no_fake", mutates_args=())
def _no_fake(x: torch.Tensor) -> torch.Tensor:
    """An op without a shape-only implementation: Dynamo cannot trace a forward that calls it."""
    return x.clone()


_no_fake.register_autograd(lambda ctx, grad: grad)


@pytest.mark.slow
@pytest.mark.parametrize("scope,where,needle", [
    ("layers", "bert.encoder.layer.0.output", "a layer of the model did not compile (TorchRuntimeError"),
    ("model", "classifier", "the training step did not compile (TorchRuntimeError"),
])
def test_a_forward_that_does_not_trace_trains_eagerly(tmp_path, monkeypatch, scope, where, needle):
    """An op without a shape-only implementation in what the scope compiles (a layer; the whole step)."""
    def untraceable():
        model = tiny_model("bert")
        model.get_submodule(where).register_forward_hook(lambda module, args, out: _no_fake(out))
        return model

    monkeypatch.setattr(compiling, "inductor_problem", lambda device: None)  # Inductor's C++ build: not needed
    _goes_on_eagerly(tmp_path, needle, untraceable, scope, {"layers": "layers", "model": "step"}[scope])


@pytest.mark.slow
def test_compiled_exact_sebp_trains_as_compiled_dense(tmp_path):
    """Inductor on the CPU, a few steps of a tiny BERT: dense and exact SEBP (linears, norms, activations as
    ``sebp::`` ops) compiled, the same losses up to rounding, no graph break, no fallback line. The second run
    compiles afresh: with one compile allowed per frame, it still compiles (past the first run's graphs, it
    would have met Dynamo's recompile limit and run eagerly)."""
    with torch._dynamo.config.patch(recompile_limit=1):  # (pytest's monkeypatch would delete the setting)
        out = _run(tmp_path, "run", compile="default", compare=True)
    assert all(n.startswith("calibration: the budget") for n in out["notes"])  # only: too short to time
    dense, sebp = out["runs"]["dense"], out["runs"]["sebp"]
    for s in (dense, sebp):
        assert s["status"] == "completed" and s["compile"]["graphs"] >= 1 and s["compile"]["graph_breaks"] == 0
    assert len(sebp["calibration"]["layers"]) == 12
    assert out["comparison"]["max_abs_loss_gap"] <= 1e-4


def test_compiled_layers_run_eagerly_in_eval_mode_and_without_gradients():
    """compile_layers: a training step runs the compiled layers; an evaluation (eval mode, no gradients) runs
    them eagerly and compiles no graph of its own, with the same loss as the uncompiled model."""
    from sebp_probe.model.patch import patch_sebp
    from sebp_kernels import SEBPConfig

    model = tiny_model("llama")
    patch_sebp(model, SEBPConfig("exact"), norms=True, acts=True)
    ids = torch.randint(3, 100, (2, 12))
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids, labels=ids).loss
    dynamo.reset()
    model.train()
    undo = compiling.compile_layers(model, backend="aot_eager", dynamic=True)
    try:
        model(input_ids=ids, labels=ids).loss.backward()
        trained = compiling.dynamo_counts()[0]
        assert trained >= 1
        model.eval()
        with torch.no_grad():
            got = model(input_ids=ids, labels=ids).loss
        assert compiling.dynamo_counts()[0] == trained
    finally:
        undo()
        dynamo.reset()
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
