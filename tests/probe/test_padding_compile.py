"""``--padding auto`` with compiled candidates (``--compile MODE`` / ``--compile auto``): the whole-run cost
model, the choice among compiled and eager entries, the plan each run takes from it, the table, the head a
compiled run keeps, and the CLI's default."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo

from sebp_probe.train import compiling, strategy
from sebp_probe.train import finetune as ft
from sebp_probe.cli_finetune import _compile_setting
from sebp_probe.config import DataConfig, FinetuneConfig
from sebp_probe.model.losses import choose_head
from sebp_probe.train.strategy import PaddingChoice, choose_padding, pick, whole_run_s
from tests.convergence.finetune_helpers import isolated_accelerate, synthetic_data  # noqa: F401
from tests.tiny_models import tiny_config, tiny_model

# a layout whose compiled step is twice as fast, after a minute of compiling
_ROW = {"padding": "longest", "padding_share": 0.3, "dense_ms": 10.0, "dense_compiled_ms": 5.0,
        "dense_compiled_compile_s": 60.0}


def test_whole_run_cost_counts_steady_time_per_micro_batch_and_compile_once():
    assert whole_run_s(10.0, 100) == pytest.approx(1.0)
    assert whole_run_s(5.0, 100, compile_s=60.0) == pytest.approx(60.5)
    assert whole_run_s(5.0, 100_000, compile_s=60.0) == pytest.approx(560.0)


@pytest.mark.parametrize("micro,compiled", [(100, False), (100_000, True)])
def test_a_long_compile_pays_only_in_a_long_run(micro, compiled):
    choice = pick([dict(_ROW)], ("dense",), micro)
    assert (choice.padding, choice.method, choice.compiled, choice.micro_batches) == ("longest", "dense", compiled,
                                                                                        micro)
    assert choice.best_compiled == {"dense": compiled}
    row = choice.table[0]
    assert row["dense_run_s"] == pytest.approx(whole_run_s(10.0, micro))
    assert row["dense_compiled_run_s"] == pytest.approx(whole_run_s(5.0, micro, 60.0))


def test_each_method_takes_its_own_least_whole_run_cost():
    table = [dict(_ROW, sebp_ms=9.0, sebp_compiled_ms=4.0, sebp_compiled_compile_s=90.0),
             {"padding": "packed", "padding_share": 0.0, "dense_ms": 8.0, "sebp_ms": 8.5},
             {"padding": "max_length", "padding_share": 0.6, "skipped": "why"}]
    short, long = pick([dict(r) for r in table], ("dense", "sebp"), 1000), pick(table, ("dense", "sebp"), 10**6)
    assert (short.padding, short.method, short.compiled) == ("packed", "dense", False)
    assert short.best == {"dense": "packed", "sebp": "packed"} and short.best_compiled == {"dense": False,
                                                                                           "sebp": False}
    assert (long.padding, long.method, long.compiled) == ("longest", "sebp", True)
    assert long.best == {"dense": "longest", "sebp": "longest"} and long.best_compiled == {"dense": True,
                                                                                          "sebp": True}
    assert PaddingChoice.from_dict(long.to_dict()) == long


def test_an_older_stored_choice_reads_as_eager():
    old = {"padding": "bucket", "method": "sebp", "best": {"dense": "bucket", "sebp": "bucket"}}
    choice = PaddingChoice.from_dict(old)
    assert not choice.compiled and choice.best_compiled == {} and choice.micro_batches is None


def _cfg(**kw) -> FinetuneConfig:
    return FinetuneConfig(model="tiny", data=DataConfig(max_length=24, batch_size=8, padding="auto"), **kw)


@pytest.mark.parametrize("compiled", [False, True])
def test_both_runs_of_a_comparison_take_the_one_choice_compiled_or_not(compiled):
    """--compare under --padding auto: dense and SEBP on the chosen layout, head and compile setting, even where
    each method alone was fastest elsewhere (``best``): the same batches, so that the two runs compare."""
    choice = PaddingChoice("longest", "sebp", {"dense": "packed", "sebp": "longest"}, head="full",
                           best_head={"dense": "labelled", "sebp": "full"}, compiled=compiled,
                           best_compiled={"dense": not compiled, "sebp": compiled})
    plan = dict(ft._run_plan(_cfg(compile="auto", compare=True), choice))
    assert {(c.data.padding, c.head, c.compile) for c in plan.values()} == {
        ("longest", "full", "default" if compiled else None)}
    assert ft._same_batches(list(plan.items())) and ft._same_setup(list(plan.items()))
    fixed = dict(ft._run_plan(_cfg(compile="max-autotune-no-cudagraphs", compare=True), choice))
    assert {c.compile for c in fixed.values()} == {"max-autotune-no-cudagraphs"}


def test_compile_auto_needs_padding_auto():
    with pytest.raises(ValueError, match="--compile auto.*--padding auto"):
        FinetuneConfig(data=DataConfig(padding="longest"), compile="auto")
    assert _cfg(compile="auto").compile_mode == "default" and _cfg().compile_mode is None


def test_a_compiled_sebp_run_says_what_sebp_covers():
    line = ft._compiled_sebp_note([("sebp", _cfg(compile="default"))])
    assert line.startswith("--compile: SEBP runs on the linear layers only") and "\n" not in line
    forced = ft._compiled_sebp_note([("sebp", _cfg(compile="default", sebp_acts=True))])
    assert forced.startswith("--compile with --sebp-acts: those run as opaque sebp:: ops")
    assert ft._compiled_sebp_note([("dense", _cfg(method="dense", compile="default")), ("sebp", _cfg())]) is None


def test_the_cli_compiles_by_default_only_on_a_gpu_under_padding_auto(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _compile_setting(None, "auto", False) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _compile_setting(None, "auto", False) == "auto"
    assert _compile_setting(None, "longest", False) is None and _compile_setting(None, "auto", True) is None
    assert _compile_setting("off", "auto", False) is None and _compile_setting("default", "auto", False) == "default"


@pytest.mark.parametrize("arch,task,padding,head", [
    ("llama", "causal-lm", "packed", "labelled"),
    ("llama", "causal-lm", "longest", "labelled"),  # its loaders count the labelled rows on the host
    ("llama", "causal-lm", "auto", "labelled"),  # each layout judged when timed
    ("bert", "classification", "longest", "labelled"),
])
def test_a_compiled_run_keeps_the_labelled_head_where_its_step_compiles(arch, task, padding, head):
    used, why = choose_head(tiny_model(arch), task, "labelled", compiled=True, padding=padding)
    assert used.kind == head
    assert why is None


def _one_layer_llama():
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama")
    cfg.num_hidden_layers = 1
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).train()


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["layers", "model"])
def test_choose_padding_times_compiled_candidates_with_their_compile_seconds(monkeypatch, scope):
    """``--compile auto``: every layout eager and compiled as the run compiles (``scope``: each layer in place,
    undone after; or the whole step; a fresh compile each: Dynamo's caches reset), the first calls timed apart
    as compile seconds, and the least whole-run cost chosen. aot_eager stands in for Inductor (its C++ compile
    takes minutes on two CPU cores); the compiled callables are the same."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **kw: real(fn, backend="aot_eager"))
    monkeypatch.setattr(compiling, "inductor_problem", lambda device: None)
    monkeypatch.setattr(strategy, "inductor_problem", lambda device: None)  # (imported by name there)
    two = {name: strategy.LAYOUTS[name] for name in ("longest", "packed")}  # two layouts, two batches each
    monkeypatch.setattr(strategy, "LAYOUTS", two)
    monkeypatch.setattr(strategy, "SAMPLE_BATCHES", 2)
    dynamo.reset()
    dynamo.utils.counters.clear()
    # the whole step, four times afresh: one layer traces in about half the time (layers scope: two layers,
    # to count a graph per candidate)
    model = _one_layer_llama() if scope == "model" else tiny_model("llama")
    data = synthetic_data("causal-lm", n=48, prompt=0.5)
    cfg = _cfg(method="dense", compile="auto", max_steps=70, grad_accum=2, calib_batches=0, compile_scope=scope,
               calib_budget=1.0)
    head, _ = choose_head(model, "causal-lm", "labelled", compiled=True, padding="auto")
    choice = choose_padding(model, cfg, data, {}, torch.device("cpu"), reps=1, heads=("labelled", "full"), head=head,
                            timer=lambda key, batch, run: 1e4)  # eager: 10 s a pass, the budget affords them all
    rows = {(r["padding"], r["head"]): r for r in choice.table}
    assert list(rows) == [(p, h) for p in ("longest", "packed") for h in ("labelled", "full")]
    assert choice.micro_batches == 140
    for (padding, head), r in rows.items():
        assert r["dense_run_s"] == pytest.approx(whole_run_s(r["dense_ms"], 140))
        assert r["dense_compiled_compile_s"] > 0 and r["dense_compiled_ms"] > 0
        assert r["dense_compiled_run_s"] == pytest.approx(whole_run_s(r["dense_compiled_ms"], 140,
                                                                      r["dense_compiled_compile_s"]))
    # the least cost; a tie goes the prior's way: less padding, the run's own head first, eager
    costs = [(r[f"{name}_run_s"], r["padding_share"], ("labelled", "full").index(h), name.endswith("_compiled"),
              p, h) for (p, h), r in rows.items() for name in ("dense", "dense_compiled") if f"{name}_run_s" in r]
    assert (choice.compiled, choice.padding, choice.head) == (min(costs)[3], *min(costs)[4:])
    # four compiled candidates (padded batches carry their labelled rows' counts too), each compiled afresh:
    # at least one graph each, and no break
    assert dynamo.utils.counters["stats"]["unique_graphs"] >= 4
    assert not dynamo.utils.counters["graph_break"]
    # layers scope: the model is as it was after the timing (no layer left compiled)
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)


def test_under_cuda_graphs_the_compiled_candidates_are_timed_as_replays_of_the_compiled_layers(monkeypatch):
    """``--cuda-graphs --compile default --padding auto``: the run will replay its compiled layers as CUDA
    graphs, so each compiled candidate is timed that way (after the compiling call), not as compiled calls.
    The replays are a stand-in here (CUDA graphs need a GPU; the GPU test runs the real ones): it checks that
    the layers are compiled while it runs, that the causal LM runs without its cache, and times each batch at
    1 ms per 1000 token slots."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **kw: real(fn, backend="aot_eager"))
    monkeypatch.setattr(compiling, "inductor_problem", lambda device: None)
    monkeypatch.setattr(strategy, "inductor_problem", lambda device: None)  # (imported by name there)
    fixed = {name: lay for name, lay in strategy.LAYOUTS.items() if lay.fixed_shapes}
    monkeypatch.setattr(strategy, "SAMPLE_BATCHES", 2)
    model = tiny_model("llama")
    seen = []

    def replays(m, batch, reps, autocast, skip=0, call_kwargs=None):
        assert m is model and skip == 1 and call_kwargs == {"use_cache": False}
        assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
        seen.append(batch["input_ids"].numel())
        return 0.4e-3 * batch["input_ids"].numel(), 0.6e-3 * batch["input_ids"].numel()

    monkeypatch.setattr(strategy, "replay_ms", replays)
    dynamo.reset()
    data = synthetic_data("causal-lm", n=48, prompt=0.5)
    cfg = _cfg(method="dense", compile="default", cuda_graphs=True, max_steps=70, calib_batches=0, calib_budget=1.0)
    choice = choose_padding(model, cfg, data, {}, torch.device("cpu"), reps=1, graphs=True,
                            timer=lambda key, batch, run: 1e4)  # a first pass of 10 s: a budget for them all
    timed = {r["padding"]: r for r in choice.table if "skipped" not in r}
    assert set(timed) == set(fixed) and len(seen) == 2 * len(fixed)  # each layout's two batches, replayed
    for r in timed.values():
        assert "dense_ms" not in r  # --compile MODE: the run compiles, so only compiled candidates are timed
        slots = sum(min(len(it["input_ids"]), 24) for it in data.train) / (1 - r["padding_share"]) / (48 // 8)
        assert r["dense_compiled_ms"] == pytest.approx(1e-3 * slots, abs=1e-3)
        assert r["dense_compiled_compile_s"] > 0
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)  # undone after the timing
    assert choice.replays and PaddingChoice.from_dict(choice.to_dict()).replays  # said in the table, stored


def test_under_cuda_graphs_a_model_without_a_layer_stack_is_timed_as_the_eager_replays_it_runs(monkeypatch):
    """A model whose layer stack sebp-probe does not know is replayed eagerly by a --cuda-graphs --compile run
    (one note, :class:`~sebp_probe.train.loop.Run`), so ``auto`` times it that way: eager replays, nothing
    compiled."""
    monkeypatch.setattr(strategy, "compiles_whole", lambda model, scope: True)
    monkeypatch.setattr(strategy, "inductor_problem", lambda device: None)
    seen = []
    monkeypatch.setattr(strategy, "_layout_ms", lambda *a, **k: seen.append(a[5]) or {"dense": 1.0})
    monkeypatch.setattr(strategy, "_time_compiled", lambda *a, **k: pytest.fail("timed compiled"))
    model = tiny_model("llama")
    cfg = _cfg(method="dense", compile="default", cuda_graphs=True, max_steps=700, calib_batches=0)
    choice = choose_padding(model, cfg, synthetic_data("causal-lm", n=48, prompt=0.5), {}, torch.device("cpu"),
                            graphs=True, timer=lambda key, batch, run: 1.0)
    assert seen and all(seen) and not choice.compiled  # graphs=True on every layout timed



@pytest.mark.parametrize("compile_mode,cuda_graphs,replays", [("reduce-overhead", False, False),
                                                               ("default", False, False), ("default", True, True)])
def test_only_cuda_graphs_time_compiled_candidates_as_replays(monkeypatch, compile_mode, cuda_graphs, replays):
    """A compile mode that records CUDA graphs itself (``reduce-overhead``) is timed as its compiled calls,
    which replay Inductor's own graphs; only ``--cuda-graphs`` replays the compiled layers as the step's
    graphs."""
    monkeypatch.setattr(strategy, "inductor_problem", lambda device: None)
    got = []

    def time_compiled(row, *a, **k):  # records ``replays``, times the row's compiled dense at 1 ms
        got.append(a[-1])
        row.update(dense_compiled_ms=1.0, dense_compiled_compile_s=0.0)

    monkeypatch.setattr(strategy, "_time_compiled", time_compiled)
    model = tiny_model("llama")
    cfg = _cfg(method="dense", compile=compile_mode, cuda_graphs=cuda_graphs, max_steps=70000, calib_batches=0,
               calib_budget=1.0)
    graphs = cuda_graphs or compile_mode == "reduce-overhead"  # finetune's: --cuda-graphs or graphed_compile
    choice = choose_padding(model, cfg, synthetic_data("causal-lm", n=48, prompt=0.5), {}, torch.device("cpu"),
                            graphs=graphs, timer=lambda key, batch, run: 1.0)  # a run of 70 s or more
    assert got and set(got) == {replays} and choice.compiled and choice.replays == replays


def test_a_graph_recording_mode_that_cannot_compile_is_timed_as_the_plain_eager_steps_it_runs(monkeypatch):
    """``--compile reduce-overhead`` where Inductor cannot run: the run trains eagerly without CUDA graphs (the
    graphs were Inductor's), so ``auto`` times plain eager steps, not graph replays."""
    monkeypatch.setattr(strategy, "inductor_problem", lambda device: "no compiler here")
    monkeypatch.setattr(strategy, "_layout_ms", lambda *a, **k: pytest.fail("timed as graph replays"))
    seen = []
    cfg = _cfg(method="dense", compile="reduce-overhead", max_steps=700, calib_batches=0)
    choice = choose_padding(tiny_model("llama"), cfg, synthetic_data("causal-lm", n=48, prompt=0.5), {},
                            torch.device("cpu"), graphs=True, timer=lambda key, batch, run: seen.append(key) or 1.0)
    assert len(seen) > 1 and not choice.replays and not choice.compiled  # eager passes, timed
