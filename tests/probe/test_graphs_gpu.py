"""CUDA-graph training steps (``sebp_probe.train.graphs``, ``finetune --cuda-graphs``) on a GPU: replays give the
eager step's loss and gradients, accumulate into the same ``.grad`` tensors, and a whole compared run
trains with them."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from sebp_kernels import SEBPConfig
from sebp_probe.train import finetune as ft
from sebp_probe.train import calibration
from sebp_probe.data.assets import LoadedModel
from sebp_probe.config import DataConfig, FinetuneConfig
from sebp_probe.train.graphs import StepGraphs
from sebp_probe.model.patch import patch_activations, patch_model, patch_norms
from tests.convergence.finetune_helpers import isolated_accelerate, synthetic_data  # noqa: F401
from tests.tiny_models import padded_batch, tiny_model

pytestmark = pytest.mark.gpu


def _model(arch, sebp: bool):
    model = tiny_model(arch).cuda()
    if sebp:
        patch_model(model, SEBPConfig("exact", backend="triton"))
        patch_norms(model)
        patch_activations(model)
    return model


def _batch(arch, seed, lengths=(11, 4, 7)):
    return {k: v.cuda() for k, v in padded_batch(arch, lengths, seed=seed).items()}


@pytest.mark.parametrize("arch", ["bert", "llama"])
@pytest.mark.parametrize("sebp", [False, True])
def test_replays_accumulate_the_eager_gradients(arch, sebp):
    """Two micro-batches replayed (the second copied into the static inputs) add into the same .grad tensors
    what two eager backward passes add: equal losses and gradients, same storage before and after."""
    model = _model(arch, sebp)
    ref = copy.deepcopy(model)
    b1, b2 = _batch(arch, 1), _batch(arch, 2)
    steps = StepGraphs(model, b1, scale=0.5)
    ptrs = {n: p.grad.data_ptr() for n, p in model.named_parameters()}
    assert all(p.grad.abs().sum() == 0 for p in model.parameters())  # warm-up's gradients are gone
    losses = []
    for b in (b1, b2):
        losses.append(steps.forward(b).item())
        steps.backward()
    ref_losses = []
    for b in (b1, b2):
        loss = ref(**b).loss
        ref_losses.append(loss.item())
        (loss * 0.5).backward()
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-6)
    assert losses[0] != losses[1]  # the second batch really was copied in
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad.data_ptr() == ptrs[n], n
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)
    assert steps.fits(b1) and not steps.fits(_batch(arch, 3, lengths=(5, 9)))  # another padded length
    steps.close()


def test_timing_graphs_leave_no_gradients():
    model = _model("bert", True)
    fwd, bwd = calibration.graphed_step_ms(model, _batch("bert", 1), lambda: torch.autocast("cuda", dtype=torch.bfloat16))
    assert fwd > 0 and bwd > 0
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.filterwarnings("error:The AccumulateGrad node's stream")  # captures and warm-ups on one stream
@pytest.mark.parametrize("precision,padding", [("fp32", "max_length"), ("bf16", "max_length"), ("fp32", "longest")])
def test_finetune_with_cuda_graphs_matches_dense(tmp_path, precision, padding):
    """--compare --cuda-graphs: both runs replay graphs, one pair per batch shape (the last batch of an epoch
    is smaller; with padding longest the lengths are rounded up to multiples of --graph-bucket), calibration
    times graphs, and exact SEBP follows dense."""
    data = synthetic_data("classification", n=60, n_eval=16)  # 60 = 7 batches of 8 and one of 4 per epoch
    load = lambda: LoadedModel(tiny_model("bert"), None, "classification", "tiny-bert", "config")  # noqa: E731
    cfg = FinetuneConfig(model="tiny", data=DataConfig(max_length=24, batch_size=8, padding=padding),
                         output_dir=str(tmp_path / "run"), compare=True, max_steps=6, grad_accum=2, lr=2e-3,
                         warmup_ratio=0.0, dense_fallback=1.0, fallback_if_slower=False, sebp_norms=True,
                         sebp_acts=True, precision=precision, cuda_graphs=True, graph_bucket=8, seed=0,
                         calib_budget=1.0)  # a 6-step run affords no timing within the default 5%
    s = ft.finetune(cfg, load_fn=load, data=data)
    dense, sebp = s["runs"]["dense"], s["runs"]["sebp"]
    assert dense["status"] == sebp["status"] == "completed"
    assert len(sebp["calibration"]["layers"]) == 12 and sebp["calibration"]["sebp_backward_ms"] > 0
    for m in ("dense", "sebp"):
        lines = (tmp_path / "run" / m / "metrics.jsonl").read_text().splitlines()
        recs = [r for r in map(json.loads, lines) if r["type"] == "train"]
        assert len(recs) == 6 and all(r["graph_replays"] == 2 for r in recs)
        graphs = [r["graphs"] for r in recs]
        assert graphs == sorted(graphs) and graphs[3] >= 2, graphs  # micro-batch 8 (step 4) is the short one
        if padding == "longest":  # the longest of each batch rounded up to 8, 16 or 24 tokens
            assert {r["rows"] % 8 for r in recs} == {0}, [r["rows"] for r in recs]
    assert s["comparison"]["max_abs_loss_gap"] < (1e-5 if precision == "fp32" else 2e-2)


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_finetune_with_cuda_graphs_and_compiled_layers_trains_as_the_eager_graphs(tmp_path, arch):
    """--cuda-graphs --compile default: each layer compiled in place (Inductor), then the step captured and
    replayed as CUDA graphs (a causal LM's forward without a KV cache, whose guards would compile each layer
    apart): the SEBP run's losses those of the same run replayed eagerly, every micro-step a replay, no graph
    break."""
    task = "classification" if arch == "bert" else "causal-lm"
    data = synthetic_data(task, n=48, n_eval=8, **({} if arch == "bert" else {"prompt": 0.5}))
    load = lambda: LoadedModel(tiny_model(arch), None, task, "tiny", "config")  # noqa: E731
    runs = {}
    for name, mode in (("eager", None), ("compiled", "default")):
        torch._dynamo.reset()
        cfg = FinetuneConfig(model="tiny", data=DataConfig(max_length=24, batch_size=8, padding="longest"),
                             output_dir=str(tmp_path / name), max_steps=4, grad_accum=2, lr=2e-3,
                             warmup_ratio=0.0, dense_fallback=1.0, fallback_if_slower=False, method="sebp",
                             cuda_graphs=True, graph_bucket=8, compile=mode, seed=0, eval_samples=8)
        runs[name] = ft.finetune(cfg, load_fn=load, data=data)
    torch._dynamo.reset()
    eager, compiled = runs["eager"], runs["compiled"]
    assert eager["status"] == compiled["status"] == "completed"
    assert compiled["compile"]["scope"] == "layers" and compiled["compile"]["graph_breaks"] == 0
    assert compiled["compile"]["graphs"] >= 1 and "compile" not in eager
    losses = {}
    for name in runs:
        recs = [r for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
                if r["type"] == "train"]
        assert len(recs) == 4 and all(r["graph_replays"] == 2 for r in recs)
        losses[name] = [r["loss"] for r in recs]
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-4, abs=1e-4)


def test_padding_auto_times_compiled_candidates_as_the_replays_the_run_takes(tmp_path, monkeypatch):
    """--padding auto --cuda-graphs --compile default: every layout the graphs can take is timed compiled and
    replayed (dense and SEBP), and the run then trains that way on the layout chosen."""
    from sebp_probe.train import strategy

    replays = []
    real = strategy.replay_ms
    spy = lambda *a, **k: replays.append(a[1]["input_ids"].shape) or real(*a, **k)  # noqa: E731
    monkeypatch.setattr(strategy, "replay_ms", spy)
    monkeypatch.setattr(strategy, "compiled_cost_ms", lambda *a, **k: 0.0)  # the budget's estimate: none
    data = synthetic_data("causal-lm", n=48, n_eval=8, prompt=0.5)
    load = lambda: LoadedModel(tiny_model("llama"), None, "causal-lm", "tiny", "config")  # noqa: E731
    torch._dynamo.reset()
    cfg = FinetuneConfig(model="tiny", data=DataConfig(max_length=24, batch_size=8, padding="auto"),
                         output_dir=str(tmp_path / "auto"), max_steps=3, lr=2e-3, warmup_ratio=0.0,
                         dense_fallback=1.0, fallback_if_slower=False, method="sebp", cuda_graphs=True,
                         graph_bucket=8, compile="default", seed=0, eval_samples=8, calib_budget=1.0)
    # a first pass of 1000 s: a 3-step run with a budget for every compiled candidate
    summary = ft.finetune(cfg, load_fn=load, data=data, padding_timer=lambda key, batch, run: 1e6)
    torch._dynamo.reset()
    assert summary["status"] == "completed"
    timed = [r for r in summary["padding_choice"]["table"] if "skipped" not in r]
    assert timed and all(r["dense_compiled_ms"] > 0 and r["sebp_compiled_ms"] > 0 for r in timed)
    assert all("dense_ms" not in r for r in timed)  # --compile MODE: only compiled candidates
    assert len(replays) >= 2 * len(timed)  # each timed layout's batches replayed, dense and SEBP
    recs = [r for r in map(json.loads, (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines())
            if r["type"] == "train"]
    assert len(recs) == 3 and all(r["graph_replays"] == 1 for r in recs)


def test_graphs_built_mid_accumulation_keep_the_gradients_so_far():
    """A second shape's graphs, captured while .grad holds the first micro-batch's share, in the same memory
    pool: the warm-up runs with the gradients set aside, and the first graphs still replay right after."""
    model = _model("bert", True)
    ref = copy.deepcopy(model)
    pool = torch.cuda.graph_pool_handle()
    b1, b2 = _batch("bert", 1), _batch("bert", 2, lengths=(5, 9, 3, 6))
    g1 = StepGraphs(model, b1, scale=0.5, pool=pool)
    g1.forward(b1)
    g1.backward()
    g2 = StepGraphs(model, b2, scale=0.5, pool=pool)
    for g, b in ((g2, b2), (g1, b1)):
        g.forward(b)
        g.backward()
    for b in (b1, b2, b1):
        (ref(**b).loss * 0.5).backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_repeated_captures_leave_no_memory_behind():
    """Every capture warms up on the same side stream: torch keeps a cuBLAS workspace per stream used, so a
    fresh stream per capture (the first version) left 65 MiB allocated each time on an H100."""
    import gc

    model = _model("bert", True)
    b = _batch("bert", 1)
    after = []
    for _ in range(3):
        StepGraphs(model, b, accumulate=False).close()
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.synchronize()
        after.append(torch.cuda.memory_allocated())
    assert after[1] == after[2], after


def _bert_loader(dropout: float = 0.0):
    from transformers import AutoModelForSequenceClassification

    from tests.tiny_models import tiny_config

    def load():
        torch.manual_seed(0)
        cfg = tiny_config("bert")
        cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = dropout
        return LoadedModel(AutoModelForSequenceClassification.from_config(cfg), None, "classification", "tiny",
                           "config")
    return load


def _graphs_cfg(out, **kw):
    base = dict(model="tiny", data=DataConfig(max_length=24, batch_size=8), output_dir=str(out), max_steps=8,
                grad_accum=2, eval_steps=4, lr=2e-3, warmup_ratio=0.0, dense_fallback=1.0,
                fallback_if_slower=False, cuda_graphs=True, seed=0)
    base.update(kw)
    return FinetuneConfig(**base)


def test_interrupted_graphed_run_resumes_to_the_uninterrupted_result(tmp_path):
    """Capture forks the RNG, so a resumed run's replays draw dropout masks from the restored generator as the
    uninterrupted run's did (up to the GPU's own run-to-run differences)."""
    import os
    import signal

    data = synthetic_data("classification", n=40)
    load = _bert_loader(dropout=0.1)
    full = ft.finetune(_graphs_cfg(tmp_path / "a"), load_fn=load, data=data)

    def kill_at_3(kind, p):
        if kind == "step" and p["step"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    cfg = _graphs_cfg(tmp_path / "b")
    assert ft.finetune(cfg, load_fn=load, data=data, on_event=kill_at_3)["status"] == "interrupted"
    resumed = ft.finetune(cfg, resume=True, load_fn=load, data=data)
    assert resumed["status"] == full["status"] == "completed"
    rec = lambda p: [json.loads(x) for x in open(p / "metrics.jsonl")]  # noqa: E731
    a, b = rec(tmp_path / "a"), rec(tmp_path / "b")
    assert [r["step"] for r in a] == [r["step"] for r in b]
    assert all(r["graph_replays"] == 2 for r in a + b if r["type"] == "train")
    for ra, rb in zip(a, b):
        for k in ("loss", "eval_loss"):
            if k in ra:
                assert rb[k] == pytest.approx(ra[k], rel=1e-5, abs=1e-6), (ra, rb)
    assert resumed["final_eval"]["eval_loss"] == pytest.approx(full["final_eval"]["eval_loss"], rel=1e-5)


def test_lora_trains_with_cuda_graphs(tmp_path):
    pytest.importorskip("peft")
    data = synthetic_data("classification", n=40)
    s = ft.finetune(_graphs_cfg(tmp_path / "run", lora=True, compare=True, max_steps=4), load_fn=_bert_loader(),
                    data=data)
    assert s["runs"]["sebp"]["status"] == "completed" and s["comparison"]["max_abs_loss_gap"] < 1e-5
    recs = [json.loads(x) for x in open(tmp_path / "run" / "sebp" / "metrics.jsonl")]
    assert [r["graph_replays"] for r in recs if r["type"] == "train"] == [2, 2, 2, 2]


@pytest.mark.parametrize("setting", [{"eps": 1e-4}, {"top_n": 96}])
def test_threshold_and_topk_train_with_cuda_graphs(tmp_path, setting):
    """The lossy modes select on the device too, so their steps are captured like exact mode's."""
    data = synthetic_data("classification", n=40)
    s = ft.finetune(_graphs_cfg(tmp_path / "run", max_steps=4, **setting), load_fn=_bert_loader(), data=data)
    assert s["status"] == "completed"
    assert {c["mode"] for c in s["calibration"]["layers"].values()} == {"threshold" if "eps" in setting else "topk"}
    recs = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["graph_replays"] for r in recs if r["type"] == "train"] == [2, 2, 2, 2]
