"""The whole-model benchmark's compiled timing and its Cut-Cross-Entropy peer, off the GPU: the plan lists the
compiled entries and why some cannot run, the summary's bar over every timing, the CLI's selections, the docs
table with compiled rows, and (slow: Inductor compiles on two CPU cores take a minute each) tiny runs whose
compiled and CCE entries give dense's loss, with compile seconds and recompiles on their rows."""
from __future__ import annotations

import json
import sys

import pytest
import torch
import torch._dynamo as dynamo

from sebp_probe.bench import bench_cases, bench_model, bench_peers, bench_steps

from sebp_probe.model import packing
from sebp_probe.bench.bench_cases import MODEL_CASES
from tests.helpers import load_benchmark
from tests.probe.test_compile_graphs import traceable_varlen

LLAMA = bench_cases.tiny(MODEL_CASES["llama-3.2-1b-sft"])
BERT = bench_cases.tiny(MODEL_CASES["bert-base"])


def test_plan_lists_compiled_entries_and_skip_reasons():
    p = bench_model.plan(LLAMA, n_batches=2, graphs=True, device="cpu", compile="default")
    timings = {(e["layout"], e["method"], e["head"], e["timing"]): e["reason"] for e in p["entries"]}
    assert p["compile"] == "default"
    assert timings[("packed", "dense", "full", "compiled")] is None
    assert timings[("longest", "sebp", "labelled", "compiled")] is None
    assert "need a CUDA GPU" in timings[("longest", "liger", "full", "compiled")]
    assert timings[("longest", "cce", "labelled", "graphs")] == "CUDA graphs need a GPU"
    assert timings[("longest", "dense", "full", "compiled_graphs")] == "CUDA graphs need a GPU"
    cuda_plan = bench_model.plan(LLAMA, n_batches=2, graphs=True, device="cuda", compile="reduce-overhead",
                                 layouts=("longest",), methods=("dense",), compile_scope="step")
    assert {e["reason"] for e in cuda_plan["entries"] if e["timing"] == "compiled_graphs" and e["head"] == "full"} \
        == {"each layer compiled only (--compile-scope layers)"}
    if bench_peers.cce_reason("causal-lm") is None:  # installed with the bench extra
        assert timings[("packed", "cce", "labelled", "compiled")] is None
    bert = bench_model.plan(BERT, n_batches=2, device="cpu", compile="default", layouts=("longest",),
                            methods=("dense", "cce"))
    assert {(e["method"], e["timing"]) for e in bert["entries"]} == {(m, t) for m in ("dense", "cce")
                                                                    for t in ("eager", "compiled")}
    assert all("a classifier has no LM head" in e["reason"] for e in bert["entries"] if e["method"] == "cce")
    plain = bench_model.plan(LLAMA, n_batches=2, device="cpu")  # no --compile: no compiled entries
    assert {e["timing"] for e in plain["entries"]} == {"eager"}
    with pytest.raises(ValueError, match="unknown layout 'padded'"):
        bench_model.plan(LLAMA, device="cpu", layouts=("padded",))


def test_compiled_graphs_entries_where_graphs_and_layers_scope_apply():
    """``--graphs --compile``: a ``compiled_graphs`` entry beside each compiled one, run where the eager graphs
    run (a padded batch, the model's own head, a GPU) and under the layers scope only."""
    def reasons(device, scope="layers"):
        entries = bench_model.plan_entries(LLAMA, True, torch.device(device), {"liger": None, "cce": None}, True,
                                           None, ("longest", "packed"), ("dense", "sebp"), scope)
        return {(e["layout"], e["method"], e["head"]): e["reason"] for e in entries
                if e["timing"] == "compiled_graphs"}

    gpu = reasons("cuda")
    assert gpu[("longest", "dense", "full")] is None and gpu[("longest", "sebp", "full")] is None
    assert "found on the host" in gpu[("longest", "sebp", "labelled")]
    assert "change shape" in gpu[("packed", "dense", "full")]
    assert set(reasons("cpu").values()) == {"CUDA graphs need a GPU"}
    assert "--compile-scope layers" in reasons("cuda", "step")[("longest", "dense", "full")]
    own = bench_model.plan_entries(LLAMA, True, torch.device("cuda"), {}, True, None, ("longest",), ("dense",),
                                   "layers", "reduce-overhead")
    assert {e["reason"] for e in own if e["timing"] == "compiled_graphs" and e["head"] == "full"} == {
        "--compile reduce-overhead records CUDA graphs itself"}
    no_graphs = bench_model.plan_entries(LLAMA, False, torch.device("cuda"), {}, True, None, ("longest",))
    assert "compiled_graphs" not in {e["timing"] for e in no_graphs}


@pytest.mark.parametrize("error", ["capture", "warm-up"])
def test_a_failed_capture_leaves_the_compiled_timing_and_skips_the_rest(monkeypatch, error):
    """A capture that fails, or anything else in the replayed timing (its eager warm-up steps): that timing is
    out, once, and the rest of its batches are not tried."""
    from sebp_probe.train.graphs import CaptureError

    calls, failed = [], []

    def time_graphs(model, batch, repeats, warmup, no_cache=False):
        calls.append(no_cache)
        if len(calls) == 2:
            raise (CaptureError("the training step could not be captured as a CUDA graph: no") if error == "capture"
                   else RuntimeError("a warm-up step failed"))
        return {"step_ms": 1.0}

    monkeypatch.setattr(bench_steps, "time_graphs", time_graphs)
    replay = bench_steps.replay_or_fail(("longest", "sebp", "full", "compiled_graphs"), 3, 1,
                                        lambda key, e, m: failed.append((key[3], str(e))))
    assert [replay(None, {}) for _ in range(4)] == [{"step_ms": 1.0}, None, None, None]
    assert calls == [True, True] and [key for key, _ in failed] == ["compiled_graphs"]
    assert ("could not be captured" if error == "capture" else "warm-up step failed") in failed[0][1]


def test_cce_reason_when_it_does_not_import(monkeypatch):
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", None)  # import raises ImportError
    why = bench_peers.cce_reason("causal-lm")
    assert why.startswith("cut_cross_entropy does not import (ModuleNotFoundError") and "sebp-probe[cce]" in why


@pytest.mark.parametrize("layout", ["longest", "packed"])
def test_cce_loss_reads_the_labelled_rows(layout, monkeypatch):
    """The CCE entry's rows and targets (its kernel replaced by plain cross-entropy on the rows it is given: the
    real one compiles on a CPU, the slow test below): the model's own loss on padded and packed batches."""
    cce = pytest.importorskip("cut_cross_entropy")
    given = []

    def reference(e, c, targets, impl, reduction="mean"):
        given.append((e.shape[0], impl))
        return torch.nn.functional.cross_entropy(e @ c.T, targets, reduction=reduction)

    monkeypatch.setattr(cce, "linear_cross_entropy", reference)
    model = bench_model.build_model(LLAMA, torch.float32, torch.device("cpu"))
    batches, _ = bench_model._pool(LLAMA, model.config, 1, 0, "mask", True)
    batch = batches[layout][0]
    want = bench_model.FULL.loss(model, batch)
    assert bench_peers.cce_loss(model, batch).item() == pytest.approx(want.item(), rel=1e-5)
    labelled = int((batch["labels"][..., 1:] != -100).sum()) if layout == "longest" else batch["n_targets"]
    assert given == [(labelled, "torch_compile")]  # the labelled rows only; CCE's CPU path


def test_summary_bar_is_over_every_timing():
    rows = [dict(layout=lay, method=m, head=h, timing=t, ms=ms) for lay, m, h, t, ms in
            (("packed", "dense", "full", "eager", 30.0), ("packed", "sebp", "full", "eager", 25.0),
             ("packed", "dense", "full", "compiled", 20.0), ("packed", "cce", "labelled", "compiled", 16.0),
             ("packed", "sebp", "full", "compiled", 18.0), ("longest", "liger", "full", "graphs", 17.0))]
    s = bench_cases.summarize(rows)
    assert set(s) == {"eager", "graphs", "compiled", "all"}
    assert s["all"]["fastest_baseline"] == {"layout": "packed", "method": "cce", "head": "labelled", "ms": 16.0,
                                            "timing": "compiled"}
    assert s["all"]["auto_pick"]["method"] == "sebp" and s["all"]["auto_pick"]["timing"] == "compiled"
    copy = [dict(r) for r in rows]  # (summarize writes each row's ratios)
    gpu = bench_cases.summarize(copy, bench_model.AUTO_METHODS_GPU)  # --padding auto times the CCE head there
    assert gpu["all"]["auto_pick"] == gpu["all"]["fastest_baseline"]
    graphs = [dict(layout="bucket", method="cce", head="labelled", timing="compiled_graphs", ms=1.0)]
    assert bench_cases.summarize(copy + graphs, bench_model.AUTO_METHODS_GPU)["all"]["auto_pick"]["ms"] == 16.0
    assert s["compiled"]["fastest_dense"]["ms"] == 20.0 and s["eager"]["fastest_baseline"]["method"] == "dense"
    assert rows[4]["vs_dense_same_layout"] == round(20 / 18, 3)  # against dense of its own timing
    assert rows[1]["vs_fastest_baseline"] == round(16 / 25, 3)  # the bar of every timing


def test_cli_selections_and_compile_mode(tmp_path):
    from typer.testing import CliRunner

    from sebp_probe.cli import app

    run = lambda *a: CliRunner().invoke(app, ["bench", "llama-3.2-1b-sft", "--scope", "model", "--tiny", *a])  # noqa
    bad = run("--compile", "fast")
    assert bad.exit_code == 1 and "--compile must be one of default" in bad.output
    bad = run("--compile", "default", "--compile-scope", "model")
    assert bad.exit_code == 1 and "--compile-scope must be one of layers, step" in bad.output
    bad = run("--methods", "dense,flash")
    assert bad.exit_code == 1 and "--layouts/--methods: unknown method 'flash'" in bad.output
    bad = CliRunner().invoke(app, ["bench", "bert-base", "--compile", "default"])
    assert bad.exit_code == 1 and "are for the whole-model run" in bad.output
    ok = run("--compile", "default", "--layouts", "packed", "--methods", "dense,cce", "--dry-run")
    assert ok.exit_code == 0, ok.output
    (plan,) = json.loads(ok.output)["models"]
    assert {(e["method"], e["timing"]) for e in plan["entries"]} == {
        ("dense", "eager"), ("dense", "compiled"), ("cce", "eager"), ("cce", "compiled")}


def test_tables_show_compiled_rows_in_80_columns(capsys, monkeypatch):
    from sebp_probe import tables
    from tests.cli.test_bench_cli import _model_result

    m = _model_result()
    m["rows"] += [dict(r, timing="compiled", ms=r["ms"] * 0.7, compile_s=61.25, recompiles=2 if r["head"] == "labelled"
                       else 0, graph_breaks=0) for r in m["rows"] if r["timing"] == "eager" and r["method"] != "liger"]
    m["rows"].append(dict(m["rows"][-1], method="cce", head="labelled", ms=50.0, recompiles=0))
    m["summary"] = bench_cases.summarize(m["rows"])
    monkeypatch.setattr(tables.console, "width", 80)
    tables.bench_tables({"models": [m]})
    raw = capsys.readouterr().out
    out = " ".join(raw.split())
    assert "comp s: its first step" in out and "packed cce labelled - - 50.00 61" in out
    assert "recompiled after the first step: max_length dense labelled (2)" in out
    assert "llama-3.2-1b-sft, all: fastest dense packed dense labelled compiled 63.00 ms" in out
    assert "fastest non-SEBP packed cce labelled compiled 50.00 ms" in out
    prose = ("llama-3.2-1b-sft, ", "not run (", "loss check", "recompiled after")
    assert "…" not in raw and max(len(line) for line in raw.splitlines() if not line.startswith(prose)) <= 80


@pytest.mark.parametrize("sebp", ["dense", "linears", "fused"])
def test_layers_scope_compiles_one_layer_for_the_stack_and_keeps_shapes_apart(sebp):
    """``--compile-scope layers``: the stack's layers share one compile (fewer graphs than layers), a sequence
    as long as the hidden size does not pin the graphs to it (no recompile at the next length), the losses are
    eager's, and the model is eager again afterwards (Dynamo and AOTAutograd; Inductor: the slow tests).
    ``fused``: SEBP norms and activations too, whose row hints name themselves to the graph by an input as well
    (as a constant each layer compiled its own graph)."""
    import dataclasses

    from sebp_probe.bench import bench_compile
    from sebp_probe.families import layer_stack

    from sebp_kernels import SEBPConfig, SEBPLinear
    from sebp_probe import patch_model

    case = dataclasses.replace(LLAMA, config={**LLAMA.config, "num_hidden_layers": 4})
    model = bench_model.build_model(case, torch.float32, torch.device("cpu"))
    if sebp == "linears":  # each SEBP layer names itself to the graph: as an input here, or every layer
        patch_model(model, SEBPConfig("exact"))  # compiles its own
    elif sebp == "fused":
        from sebp_probe.model.patch import patch_sebp

        names = patch_sebp(model, SEBPConfig("exact"), norms=True, acts=True)
        assert names["acts"] and names["norms"]
    hidden = model.config.hidden_size
    batches = [{"input_ids": (ids := torch.randint(1, 500, (2, t))), "labels": ids.clone(),
                "attention_mask": torch.ones_like(ids)} for t in (hidden, 18, hidden + 9)]
    step = bench_model.FULL.loss
    want = [step(model, b).item() for b in batches]
    timer = lambda m, fn: {"loss": fn().item()}  # noqa: E731
    compiled_then = []  # the compiled_graphs timer runs while every layer is still compiled

    def graphs(m, b):
        compiled_then.append(all(layer._compiled_call_impl is not None for layer in layer_stack(m)))
        return {"loss": step(m, b).item()}

    dynamo.reset()
    try:
        runs, stats = bench_compile.compiled_steps(model, step, batches, timer, None, "aot_eager", scope="layers",
                                                   graphs=graphs)
    finally:
        dynamo.reset()
    assert [r["loss"] for r in runs] == pytest.approx(want, rel=1e-5)
    assert [r["loss"] for r in stats.pop("graph_runs")] == pytest.approx(want, rel=1e-5)
    assert compiled_then == [True] * len(batches) and stats.pop("graph_recompiles") == 0
    assert stats["compile_scope"] == "layers" and stats["recompiles"] == 0 and stats["graph_breaks"] == 0
    assert 1 <= stats["compiled_graphs"] < len(layer_stack(model))
    assert all(layer._compiled_call_impl is None for layer in layer_stack(model))
    assert not any(m._sebp_key_input for m in model.modules() if isinstance(m, SEBPLinear))  # constants again
    assert not any(m._sebp_act_rows._sebp_key_input for m in model.modules() if getattr(m, "_sebp_act_rows", None))
    with pytest.raises(ValueError, match="compile scope must be one of layers, step"):
        bench_compile.compiled_steps(model, step, batches, timer, None, "aot_eager", scope="model")


# ------------------------------------------------------------------------------------ runs (slow: compiles)


@pytest.fixture(scope="module")
def packed_run() -> dict:
    """The tiny Llama's packed layout, dense and CCE, eager and compiled by Inductor, 3 batches; packed rows
    as a GPU runs them (one flattened row, varlen attention by a traceable stand-in)."""
    if bench_peers.cce_reason("causal-lm") is not None:
        pytest.skip(bench_peers.cce_reason("causal-lm"))
    dynamo.reset()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(packing, "VARLEN_KERNEL", traceable_varlen)
        mp.setattr(packing, "attention_backend", lambda model: "varlen")
        yield bench_model.bench_model(LLAMA, torch.float32, repeats=1, n_batches=3, device="cpu", warmup=0,
                                      compile="default", layouts=("packed",), methods=("dense", "cce"))
    dynamo.reset()


@pytest.mark.slow
def test_compiled_and_cce_entries_give_dense_loss(packed_run):
    rows = {(r["method"], r["head"], r["timing"]): r for r in packed_run["rows"]}
    assert set(rows) == {(m, h, t) for m, h in (("dense", "full"), ("dense", "labelled"), ("cce", "labelled"))
                         for t in ("eager", "compiled")}
    assert all(r["loss_gap"] < 1e-5 for r in rows.values())  # fp32: the same loss as eager dense
    for key, r in rows.items():
        if key[2] == "compiled":
            assert r["compile_s"] > 0 and r["recompiles"] >= 0 and r["graph_breaks"] >= 0 and r["ms"] > 0
        else:
            assert "compile_s" not in r
    # dynamic shapes: the packed batches' other token counts reuse the first batch's graphs
    assert rows[("dense", "full", "compiled")]["recompiles"] == 0
    assert rows[("dense", "full", "compiled")]["graph_breaks"] == 0
    assert packed_run["summary"]["all"]["fastest_baseline"]["method"] in ("dense", "cce")


@pytest.mark.slow
def test_compiled_sebp_patches_the_linears_only():
    """SEBP under compile (Dynamo and AOTAutograd; Inductor's own compile is the test above) patches the
    linears only by default, and gives dense's loss (the full head: each entry compiles on its own, and the
    labelled head's compiled entries are test_probe_in_the_whole_bench_eager_and_compiled's)."""
    dynamo.reset()
    try:
        r = bench_model.bench_model(LLAMA, torch.float32, repeats=1, n_batches=2, device="cpu", warmup=0,
                                    compile="default", compile_backend="aot_eager", layouts=("longest",),
                                    methods=("dense:full", "sebp:full"))
    finally:
        dynamo.reset()
    rows = {(r["method"], r["head"], r["timing"]): r for r in r["rows"]}
    assert set(rows) == {(m, "full", t) for m in ("dense", "sebp") for t in ("eager", "compiled")}
    sebp = rows[("sebp", "full", "compiled")]
    assert sebp["sebp_layers"]["linears"] > 0 and sebp["sebp_layers"]["norms"] == sebp["sebp_layers"]["acts"] == 0
    assert sebp["loss_gap"] < 1e-5 and sebp["recompiles"] == 0 and sebp["graph_breaks"] == 0
    assert {li["timing"] for li in r["limits"]} == {"eager", "compiled"}


def _fails_inside(x):
    # a data-dependent branch fails a fullgraph compile under every torch (an ``assert`` here would be pytest's
    # rewritten one, whose helpers torch 2.11's Dynamo traces into and reports as the innermost frame)
    if x.sum() > 0:
        return x + 1
    return x


def test_a_compile_failure_names_where_it_failed():
    """A compiled entry that fails is listed with one line naming the innermost frame Dynamo reports (the peer's
    own code, not the model's forward that called it)."""
    def outer(x):
        return _fails_inside(x) * 2

    with pytest.raises(Exception) as info:
        torch.compile(outer, backend="eager", fullgraph=True)(torch.ones(3))
    reason = bench_model.failure_reason(info.value)
    assert "\n" not in reason and reason.startswith(type(info.value).__name__ + ": ")
    assert "test_bench_compile.py:" in reason and "in _fails_inside" in reason, reason
    plain = bench_model.failure_reason(RuntimeError("a warm-up\n step failed"))
    assert plain == "RuntimeError: a warm-up step failed"
