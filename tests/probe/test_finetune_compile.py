"""``finetune --compile``: the training model runs under torch.compile (the SEBP layers as ``sebp::`` custom
ops), trains as the eager run does, and the settings that cannot go together are refused."""
from __future__ import annotations

import json

import pytest
import torch
import torch._dynamo as dynamo

from sebp_kernels import registry
from sebp_probe.train import finetune as ft
from sebp_probe.train import compiling, loop, rundir
from sebp_probe.data.assets import LoadedModel
from sebp_probe.data.batching import COMPILE_MULTIPLE
from sebp_probe.config import DataConfig, FinetuneConfig
from tests.convergence.finetune_helpers import isolated_accelerate, synthetic_data  # noqa: F401
from tests.tiny_models import tiny_model


def _run(tmp_path, name, make_model=lambda: tiny_model("bert"), task_data=None, **kw):
    data = task_data or synthetic_data("classification", n=40, n_eval=8)
    load = lambda: LoadedModel(make_model(), None, data.task, "tiny", "config")  # noqa: E731
    settings = dict(model="tiny", data=DataConfig(max_length=24, batch_size=8), output_dir=str(tmp_path / name),
                    max_steps=3, lr=2e-3, warmup_ratio=0.0, dense_fallback=1.0, fallback_if_slower=False,
                    sebp_norms=True, sebp_acts=True, seed=0, eval_samples=8)
    settings.update(kw)
    return ft.finetune(FinetuneConfig(**settings), load_fn=load, data=data)


def _losses(path):
    return [r["loss"] for r in map(json.loads, path.read_text().splitlines()) if r["type"] == "train"]


def _compiled_run_matches_eager(tmp_path, monkeypatch, mode, tol, scope="model", **kw):
    eager = _run(tmp_path, "eager", **kw)
    calls = []  # the compiled sebp:: ops look their layer up (eager calibration does not)
    real = registry.lookup
    monkeypatch.setattr(registry, "lookup", lambda key: calls.append(key) or real(key))
    evals, real_evaluate = [], loop.evaluate

    def evaluate(*a, **k):
        before = compiling.dynamo_counts()
        out = real_evaluate(*a, **k)
        evals.append((before, compiling.dynamo_counts()))
        return out

    monkeypatch.setattr(loop, "evaluate", evaluate)
    dynamo.reset()
    dynamo.utils.counters.clear()
    try:
        compiled = _run(tmp_path, "compiled", compile=mode, compile_scope=scope, **kw)
        breaks = sum(dynamo.utils.counters["graph_break"].values())
        graphs = dynamo.utils.counters["stats"]["unique_graphs"]
    finally:
        dynamo.reset()
    assert eager["status"] == compiled["status"] == "completed"
    assert compiled["compile"]["mode"] == mode and compiled["compile"]["graph_breaks"] == 0
    # model scope: the labelled-rows head (here the [CLS]-rows last layer) runs compiled, inside the compiled
    # step; layers scope: each layer compiles, the last one eagerly while it computes the [CLS] rows
    assert compiled["head"] == eager["head"] == "labelled"
    assert compiled["compile"]["scope"] == {"model": "step", "layers": "layers"}[scope]
    assert compiled["compile"]["graphs"] >= 1 and "compile" not in eager
    # the held-out evaluation runs eagerly (no gradients, eval mode): it compiles nothing
    assert evals and all(after == before for before, after in evals)
    assert len(compiled["calibration"]["layers"]) == 12
    assert breaks == 0 and graphs >= 1
    # compiled ops ran for every SEBP linear, norm and activation that gets a gradient: with LoRA not the
    # embeddings' LayerNorm nor layer 0's query/key/value base layers (everything before them is frozen); in
    # layers scope for layer 0's only (6 linears, 2 norms, 1 activation: the embeddings' norm and the last layer
    # run eagerly)
    want_ops = 12 + 5 + 2 - (4 if kw.get("lora") else 0) if scope == "model" else 9 - (3 if kw.get("lora") else 0)
    assert len(set(calls)) == want_ops
    got, want = _losses(tmp_path / "compiled" / "metrics.jsonl"), _losses(tmp_path / "eager" / "metrics.jsonl")
    assert len(got) == 3 and got == pytest.approx(want, rel=tol, abs=tol)
    saved = (tmp_path / "compiled" / rundir.MODEL_DIR)
    assert saved.is_dir()  # the model is saved as uncompiled (same parameter names)
    assert json.loads((tmp_path / "compiled" / rundir.RUN_CONFIG).read_text())["config"]["compile"] == mode


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_compiled_finetune_trains_as_the_eager_one_on_the_cpu(tmp_path, monkeypatch, lora):
    _compiled_run_matches_eager(tmp_path, monkeypatch, "default", 1e-4, lora=lora)


@pytest.mark.parametrize("lora", [False, True])
def test_finetune_compiles_layer_by_layer_by_default(tmp_path, monkeypatch, lora):
    """The default --compile-scope: each layer of the stack compiled in place (aot_eager standing in for
    Inductor: the same graphs), inside peft's wrapper too, the run's losses those of the eager run, no graph
    break, the held-out evaluation eager."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **kw: real(fn, backend="aot_eager"))
    monkeypatch.setattr(compiling, "inductor_problem", lambda device: None)
    monkeypatch.setattr(loop, "compile_or_eager", lambda *a, **k: pytest.fail("compiled the whole model"))
    _compiled_run_matches_eager(tmp_path, monkeypatch, "default", 1e-4, scope="layers", lora=lora)


@pytest.mark.parametrize("padding,dynamic,graphs", [("longest", True, 1), ("max_length", None, 1)])
def test_layers_compile_once_for_batches_of_every_shape(tmp_path, monkeypatch, padding, dynamic, graphs):
    """Under a layout whose batch shapes change, the layers compile with dynamic shapes from the first batch:
    one graph for every batch, where Dynamo would otherwise compile the first shape and again at the second;
    under max_length (one shape) without."""
    real, seen, options = torch.compile, [], []

    def compile_(fn, mode=None, **kw):
        seen.append(kw.get("dynamic"))
        options.append(kw.pop("options", None))  # Inductor's; aot_eager stands in for it
        return real(fn, backend="aot_eager", **kw)

    monkeypatch.setattr(torch, "compile", compile_)
    monkeypatch.setattr(compiling, "inductor_problem", lambda device: None)
    data = synthetic_data("causal-lm", n=64, n_eval=8, prompt=0.5, max_len=44)
    dynamo.reset()
    try:
        run = _run(tmp_path, "run", lambda: tiny_model("llama"), task_data=data, method="dense", compile="default",
                   max_steps=6, data=DataConfig(max_length=48, batch_size=8, padding=padding))
    finally:
        dynamo.reset()
    assert run["compile"] == {"mode": "default", "graphs": graphs, "graph_breaks": 0, "scope": "layers"}
    assert seen and set(seen) == {dynamic}
    # with dynamic shapes no Inductor fusion guards on the batch's size (each crossing would compile again)
    assert all((o or {}).get("triton.mix_order_reduction", True) is not bool(dynamic) for o in options)
    slots = [r["rows"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if r["type"] == "train"]
    assert len(slots) == 6 and (len(set(slots)) > 1) == (padding == "longest")  # token slots a batch
    assert all(n % (8 * COMPILE_MULTIPLE) == 0 for n in slots)  # a compiled run's lengths: a multiple of 8


def test_a_model_without_a_layer_stack_compiles_whole_under_layers_scope(monkeypatch):
    """compile_layers_or_eager: "model" for a model with no stack sebp-probe knows (the run compiles the whole
    model), None with one line where Inductor cannot run, "layers" otherwise (DDP's wrapper looked through)."""
    from torch.nn.parallel import DistributedDataParallel

    assert compiling.compile_layers_or_eager(torch.nn.Linear(2, 2), "default", torch.device("cpu")) == "model"
    assert compiling.compiles_whole(torch.nn.Linear(2, 2), "layers") and compiling.compiles_whole(
        tiny_model("llama"), "model") and not compiling.compiles_whole(tiny_model("llama"), "layers")
    model = tiny_model("llama")
    monkeypatch.setattr(compiling, "inductor_problem", lambda device: "no compiler")
    assert compiling.compile_layers_or_eager(model, "default", torch.device("cpu")) is None
    wrapped = object.__new__(DistributedDataParallel)  # no process group needed: only .module is read
    torch.nn.Module.__init__(wrapped)
    wrapped.module = model
    assert compiling.training_layers(wrapped) is model
    import peft

    lora = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert compiling.training_layers(lora) is lora.get_base_model()  # peft passes the config through


@pytest.mark.slow
def test_compiled_packed_causal_lm_trains_with_the_labelled_head_as_the_eager_one(tmp_path, monkeypatch):
    """A tiny Llama on packed batches: the labelled-rows head (gathered rows, fused head, last layer on the
    labelled rows) compiled inside the step (model scope) or with each layer (layers scope), without a graph
    break, to the eager run's losses (one eager run for both). aot_eager stands in for Inductor (the same graphs;
    Inductor's C++ build of this model's recompiles took over four minutes on two CPU cores; the BERT run above
    compiles with Inductor)."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **kw: real(fn, backend="aot_eager"))
    monkeypatch.setattr(compiling, "inductor_problem", lambda device: None)
    data = synthetic_data("causal-lm", n=40, n_eval=8, prompt=0.5)
    runs = {}
    for name, mode, scope in (("eager", None, "model"), ("model", "default", "model"),
                              ("layers", "default", "layers")):
        dynamo.reset()
        runs[name] = _run(tmp_path, name, lambda: tiny_model("llama"), method="dense", compile=mode,
                          data=DataConfig(max_length=24, batch_size=8, padding="packed"), task_data=data,
                          compile_scope=scope)
    dynamo.reset()
    eager, want = runs["eager"], _losses(tmp_path / "eager" / "metrics.jsonl")
    assert eager["head"] == "labelled" and "compile" not in eager
    for scope in ("model", "layers"):
        compiled = runs[scope]
        assert compiled["head"] == "labelled" and "head_fallback_reason" not in compiled, scope
        assert compiled["compile"]["scope"] == {"model": "step", "layers": "layers"}[scope]
        assert compiled["compile"]["graph_breaks"] == 0 and compiled["compile"]["graphs"] >= 1, scope
        got = _losses(tmp_path / scope / "metrics.jsonl")
        assert len(got) == 3 and got == pytest.approx(want, rel=1e-4, abs=1e-4), scope


@pytest.mark.gpu
def test_compiled_finetune_with_cuda_graphs_trains_as_the_eager_one(tmp_path, monkeypatch):
    """reduce-overhead on a GPU: the Triton kernels recorded into Inductor's CUDA graphs, calibration timed as
    graph replays, and the losses of the eager run. Under bf16 autocast the same run failed on torch 2.11 (dense
    too, either scope, one micro-batch or two: an output of Inductor's graphs read after they had overwritten it),
    so the config refuses that pair (test_bad_compile_settings_are_refused)."""
    _compiled_run_matches_eager(tmp_path, monkeypatch, "reduce-overhead", 1e-4, grad_accum=2)


@pytest.mark.parametrize("kw,needle", [
    (dict(compile="fast"), "unknown compile mode 'fast'"),
    (dict(compile="default", compile_scope="step"), "unknown compile scope 'step'; choose one of layers, model"),
    (dict(compile="reduce-overhead", cuda_graphs=True, data=DataConfig(padding="bucket")),
     "--cuda-graphs replays the step with each layer compiled .* --compile reduce-overhead with --compile-scope "
     "layers does not go with it \\(it records CUDA graphs itself\\)"),
    (dict(compile="default", compile_scope="model", cuda_graphs=True, data=DataConfig(padding="bucket")),
     "--compile default with --compile-scope model does not go with it$"),
    (dict(compile="auto", cuda_graphs=True, data=DataConfig(padding="auto")),
     "--compile auto with --compile-scope layers does not go with it$"),
    (dict(compile="reduce-overhead", precision="bf16", data=DataConfig(padding="max_length")),
     "--compile reduce-overhead records CUDA graphs itself, and under autocast that failed .* with --bf16 use "
     "--compile default --cuda-graphs"),
    (dict(compile="max-autotune", precision="fp16", data=DataConfig(padding="max_length")),
     "--compile max-autotune records CUDA graphs itself.* with --fp16 use"),
])
def test_bad_compile_settings_are_refused(kw, needle):
    with pytest.raises(ValueError, match=needle):
        FinetuneConfig(**kw)


def test_cuda_graphs_take_each_layer_compiled():
    """--cuda-graphs with --compile default (or max-autotune-no-cudagraphs) and the layers scope: the step
    replayed with each layer compiled (run on a GPU in tests/probe/test_graphs_gpu.py)."""
    for mode in ("default", "max-autotune-no-cudagraphs"):
        cfg = FinetuneConfig(compile=mode, cuda_graphs=True, data=DataConfig(padding="bucket"))
        assert cfg.cuda_graphs and cfg.compile == mode and cfg.compile_scope == "layers"


def test_compile_may_change_on_resume():
    old = FinetuneConfig().to_dict()
    assert rundir.config_changes(old, {**old, "compile": "reduce-overhead"}) == []
    assert rundir.config_changes(old, {**old, "compile_scope": "model", "deterministic": True}) == []
    del old["compile"]  # a run written before the setting existed
    assert rundir.config_changes(old, FinetuneConfig().to_dict()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_graphed_compile_runs_on_the_cpu_without_graphs():
    """Inductor records CUDA graphs only on CUDA devices: on the CPU reduce-overhead is not refused."""
    from accelerate import Accelerator

    assert not loop.graphed_compile(FinetuneConfig(compile="reduce-overhead"), Accelerator(cpu=True))


def test_accelerates_own_compile_setting_is_refused(tmp_path, monkeypatch):
    """accelerate would compile the model itself from this variable (TrainingArguments(torch_compile=True) sets
    it for the whole process), around --compile's checks: one line, nothing written."""
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "inductor")
    with pytest.raises(ft.FinetuneError, match="ACCELERATE_DYNAMO_BACKEND=inductor is set.*--compile"):
        _run(tmp_path, "run")
    assert not (tmp_path / "run").exists()


def test_an_accelerate_state_that_compiles_is_refused(tmp_path):
    """An Accelerator made earlier in the process (a Trainer's, say) fixes the process's accelerate state, whose
    compile setting would wrap the model whatever finetune asks for: refused, nothing written."""
    from accelerate import Accelerator

    Accelerator(cpu=True, dynamo_backend="aot_eager")  # the fixture resets accelerate's state afterwards
    with pytest.raises(ft.FinetuneError, match="already compiles every model.*AOT_EAGER.*fresh process"):
        _run(tmp_path, "run")
    assert not (tmp_path / "run").exists()


def test_cuda_graphs_replay_eagerly_a_model_without_a_known_layer_stack(tmp_path):
    """--cuda-graphs --compile default replays each layer compiled; a model whose layer stack sebp-probe does
    not know would compile whole instead, which was never tried under the graphs: one note, eager replays."""
    from types import SimpleNamespace

    from sebp_probe.model.losses import FULL

    cfg = FinetuneConfig(compile="default", cuda_graphs=True, data=DataConfig(padding="bucket"))
    notes = []
    run = loop.Run(cfg, "sebp", tmp_path, SimpleNamespace(is_main_process=True, device=torch.device("cpu")),
                   None, None, None, None, lambda kind, payload: notes.append((kind, payload)))
    run.head = (FULL, None)
    assert run._step_loss(torch.nn.Sequential(torch.nn.Linear(4, 4))) == FULL.loss
    assert run.compile_scope == "eager"
    assert [k for k, _ in notes] == ["note"] and "has no layer stack sebp-probe knows" in notes[0][1]["text"]


@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs", None])
def test_dynamic_layers_take_their_modes_inductor_options_without_size_guarded_fusions(mode):
    """A layer compiled for many batch shapes gets ``mode``'s own Inductor options, with the mix-order reduction
    fusion off: Inductor decided it by guards on the row count, and a batch crossing one compiled the layer
    again (three times a run under FSDP2, stalling the other process 15-41 s). torch.compile takes the options
    as they are (it checks their names when the compiled function is made)."""
    from torch._inductor import list_mode_options

    got = compiling.layer_compile_options(mode, one_shape=False)
    assert got["dynamic"] is True and "mode" not in got
    assert {k: v for k, v in got["options"].items() if k != "triton.mix_order_reduction"} == \
        list_mode_options(mode or "default")
    assert got["options"]["triton.mix_order_reduction"] is False
    torch.compile(lambda x: x + 1, **got)  # an unknown option name would raise here
    assert compiling.layer_compile_options(mode, one_shape=True) == {"mode": mode}  # one shape: no guards to fear
