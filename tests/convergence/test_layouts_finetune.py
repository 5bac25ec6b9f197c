"""Fine-tuning across batch layouts and heads (Python API, tiny models, CPU): packed batches train exactly as
the same batches padded, the labelled-rows head exactly as the full head, --padding auto measures every
layout and trains with the fastest, ReSprop at reuse 0 is exact, and masked LM trains."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForMaskedLM

from sebp_probe.train import finetune as ft
from sebp_probe.data.assets import LoadedModel
from sebp_probe.config import DataConfig, FinetuneConfig
from sebp_probe.layouts import LAYOUTS
from tests.convergence.finetune_helpers import isolated_accelerate, synthetic_data  # noqa: F401
from tests.tiny_models import tiny_config, tiny_model


def _loader(arch: str):
    if arch == "bert-mlm":
        return lambda: LoadedModel(AutoModelForMaskedLM.from_config(tiny_config("bert")), None, "mlm", "tiny", "config")
    task = "causal-lm" if arch in ("llama", "qwen2") else "classification"
    return lambda: LoadedModel(tiny_model(arch), None, task, f"tiny-{arch}", "config")


def _cfg(tmp_path, name: str, padding: str, **kw) -> FinetuneConfig:
    base = dict(model="tiny", data=DataConfig(max_length=24, batch_size=8, padding=padding),
                output_dir=str(tmp_path / name), max_steps=6, lr=2e-3, warmup_ratio=0.0, eval_steps=3,
                dense_fallback=1.0, fallback_if_slower=False, seed=0)
    base.update(kw)
    return FinetuneConfig(**base)


def _losses(summary_dir) -> list[float]:
    return [json.loads(x)["loss"] for x in open(summary_dir / "metrics.jsonl") if '"train"' in x]


@pytest.mark.slow
@pytest.mark.parametrize("arch,task", [("bert", "classification"), ("llama", "causal-lm")])
def test_packed_trains_as_the_same_batches_padded(tmp_path, arch, task):
    torch.manual_seed(0)
    data = synthetic_data(task, prompt=0.5)
    for padding in ("longest", "packed"):
        ft.finetune(_cfg(tmp_path, padding, padding, method="dense"), load_fn=_loader(arch), data=data)
    longest, packed = _losses(tmp_path / "longest"), _losses(tmp_path / "packed")
    assert len(packed) == 6 and max(abs(a - b) for a, b in zip(longest, packed)) < 1e-5


@pytest.mark.slow
def test_bucket_trains_and_resumes_to_the_same_losses(tmp_path):
    data = synthetic_data("classification")
    full = ft.finetune(_cfg(tmp_path, "a", "bucket", method="dense"), load_fn=_loader("bert"), data=data)
    cfg = _cfg(tmp_path, "b", "bucket", method="dense")

    def stop_at_3(kind, p):
        if kind == "step" and p["step"] == 3:
            import os
            import signal
            os.kill(os.getpid(), signal.SIGINT)

    assert ft.finetune(cfg, load_fn=_loader("bert"), data=data, on_event=stop_at_3)["status"] == "interrupted"
    resumed = ft.finetune(cfg, resume=True, load_fn=_loader("bert"), data=data)
    assert full["padding"] == resumed["padding"] == "bucket"
    assert _losses(tmp_path / "a") == pytest.approx(_losses(tmp_path / "b"), abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("arch,task", [("llama", "causal-lm"), ("bert", "classification"), ("bert-mlm", "mlm")])
def test_labelled_head_trains_as_the_full_head(tmp_path, arch, task):
    data = synthetic_data(task, prompt=0.6)
    runs = {}
    for head in ("full", "labelled"):
        runs[head] = ft.finetune(_cfg(tmp_path, head, "longest", method="dense", head=head), load_fn=_loader(arch),
                                 data=data)
    assert runs["labelled"]["head"] == "labelled" and "head_fallback_reason" not in runs["labelled"]
    full, labelled = _losses(tmp_path / "full"), _losses(tmp_path / "labelled")
    assert max(abs(a - b) for a, b in zip(full, labelled)) < 1e-5
    if task != "classification":
        assert runs["labelled"]["final_eval"]["eval_perplexity"] > 1


@pytest.mark.slow
def test_auto_times_every_layout_and_trains_with_the_fastest(tmp_path):
    """Every layout the prior keeps is timed with both heads, dense and SEBP (a timer that returns chosen
    times: SEBP on packed the fastest); the choice is the least, and both halves of --compare train on it."""
    from tests.probe.test_padding_auto import RateTimer

    events = []
    data = synthetic_data("causal-lm", prompt=0.5)
    timer = RateTimer(lambda key: (0.5 if key[::2] == ("packed", "sebp") else 1.0) * (1.1 if key[1] == "full" else 1),
                      first_ms=1e4)
    cfg = _cfg(tmp_path, "auto", "auto", compare=True, max_steps=60, eval_steps=60, calib_budget=1.0)
    s = ft.finetune(cfg, load_fn=_loader("llama"), data=data, on_event=lambda k, p: events.append((k, p)),
                    padding_timer=timer)
    choice = s["padding_choice"]
    assert [r["padding"] for r in choice["table"] if "skipped" in r or r["head"] == "labelled"] == list(LAYOUTS)
    table = {(r["padding"], r["head"]): r for r in choice["table"] if "skipped" not in r}
    assert set(table) == {(p, h) for p, _ in table for h in ("labelled", "full")}  # the full head timed too
    assert all("dense_ms" in r and "sebp_ms" in r and "sebp_spread" in r for r in table.values())
    every = [(r[f"{m}_ms"], m, p, h) for (p, h), r in table.items() for m in ("dense", "sebp")]
    assert (choice["method"], choice["padding"], choice["head"]) == min(every)[1:] == ("sebp", "packed", "labelled")
    for m in ("dense", "sebp"):
        assert (s["runs"][m]["padding"], s["runs"][m]["head"]) == (choice["padding"], choice["head"])
    assert [k for k, _ in events].count("padding") == 1
    stored = json.loads((tmp_path / "auto" / "run_config.json").read_text())
    assert stored["config"]["data"]["padding"] == "auto" and stored["padding_choice"] == choice


@pytest.mark.slow
def test_auto_skips_packed_where_it_cannot_run_exactly(tmp_path):
    s = ft.finetune(_cfg(tmp_path, "mlm", "auto", method="dense", max_steps=2), load_fn=_loader("bert-mlm"),
                    data=synthetic_data("mlm"))
    packed = next(r for r in s["padding_choice"]["table"] if r["padding"] == "packed")
    assert "skipped" in packed and "padding 'packed'" in packed["skipped"]


@pytest.mark.slow
def test_resprop_at_reuse_zero_trains_as_dense(tmp_path):
    data = synthetic_data("classification")
    s = ft.finetune(_cfg(tmp_path, "r", "longest", method="resprop", reuse=0.0, compare=True),
                    load_fn=_loader("bert"), data=data)
    assert s["runs"]["resprop"]["status"] == "completed" and s["comparison"]["max_abs_loss_gap"] < 1e-5
    approx = ft.finetune(_cfg(tmp_path, "r9", "longest", method="resprop", reuse=0.9), load_fn=_loader("bert"),
                         data=data)
    assert approx["status"] == "completed" and approx["method"] == "resprop"


def test_packed_with_cuda_graphs_is_refused():
    with pytest.raises(ValueError, match="packed batches change from batch to batch"):
        FinetuneConfig(data=DataConfig(padding="packed"), cuda_graphs=True, precision="bf16")


def test_auto_table_says_chosen_skipped_and_where_no_layer_runs_sebp():
    from rich.console import Console

    from sebp_probe.tables import padding_table

    choice = {"padding": "packed", "method": "dense", "table": [
        {"padding": "longest", "padding_share": 0.387, "dense_ms": 576.4, "sebp_layers": 32, "sebp_ms": 516.4},
        {"padding": "bucket", "padding_share": 0.019, "dense_ms": 541.1, "sebp_layers": 0},
        {"padding": "packed", "padding_share": 0.137, "dense_ms": 476.0, "sebp_layers": 4, "sebp_ms": 558.0},
        {"padding": "max_length", "padding_share": 0.48, "skipped": "needs a fixed shape"}]}
    console = Console(width=100, record=True)
    console.print(padding_table(choice))
    lines = {line.split()[0]: line for line in console.export_text().splitlines()
             if line.strip() and line.split()[0] in ("longest", "bucket", "packed", "max_length")}
    assert "516.4" in lines["longest"] and "chosen" not in lines["longest"]
    assert lines["bucket"].split()[3] == "-" and "no layer sparse enough for SEBP" in lines["bucket"]
    assert "chosen: dense" in lines["packed"]
    assert "needs a fixed shape" in lines["max_length"]


def test_auto_table_with_both_heads_marks_the_chosen_pair():
    from rich.console import Console

    from sebp_probe.tables import padding_table

    choice = {"padding": "longest", "method": "sebp", "head": "full", "table": [
        {"padding": "longest", "head": "labelled", "padding_share": 0.3, "dense_ms": 50.0, "sebp_ms": 45.0},
        {"padding": "longest", "head": "full", "padding_share": 0.3, "dense_ms": 48.0, "sebp_ms": 40.0},
        {"padding": "packed", "padding_share": 0.0, "skipped": "an encoder"}]}
    console = Console(width=100, record=True)
    console.print(padding_table(choice))
    lines = [line.split() for line in console.export_text().splitlines() if line.strip()]
    rows = {tuple(w[:2]): w for w in lines if w[0] in ("longest", "packed")}
    assert "head" in next(w for w in lines if w[0] == "layout")
    assert "chosen:" not in rows[("longest", "labelled")] and rows[("longest", "full")][-2:] == ["chosen:", "SEBP"]
    assert rows[("packed", "-")][-2:] == ["an", "encoder"]


def test_auto_table_shows_compiled_candidates_their_compile_seconds_and_run_cost():
    from rich.console import Console

    from sebp_probe.train.strategy import PaddingChoice, pick
    from sebp_probe.tables import padding_table

    table = [{"padding": "longest", "padding_share": 0.3, "dense_ms": 10.0, "sebp_ms": 9.0, "dense_compiled_ms": 5.0,
              "dense_compiled_compile_s": 60.0, "sebp_compiled_ms": 4.0, "sebp_compiled_compile_s": 75.5},
             {"padding": "bucket", "padding_share": 0.05, "dense_ms": 8.0, "sebp_ms": 8.5,
              "compiled_skipped": "the labelled-rows head counts on the host"}]
    choice = pick(table, ("dense", "sebp"), 100_000).to_dict()
    console = Console(width=200, record=True)
    console.print(padding_table(choice))
    text = console.export_text()
    assert "100000 micro-batches" in text and "CUDA-graph replays" not in text
    assert "processes" not in text  # one process: the times are the run's own
    console = Console(width=200, record=True)
    console.print(padding_table({**choice, "replays": True}))
    assert "ms per batch (fwd+bwd, CUDA-graph replays)" in console.export_text()
    console = Console(width=200, record=True)  # FSDP or DDP: the main process timed the model before wrapping
    console.print(padding_table({**choice, "processes": 2}))
    assert "timed in one of the run's 2 processes, on the model before it is wrapped" in " ".join(
        console.export_text().split())
    assert PaddingChoice.from_dict({**choice, "processes": 2}).processes == 2
    assert PaddingChoice.from_dict({k: v for k, v in choice.items() if k != "processes"}).processes == 1
    lines = {line.split()[0]: line.split() for line in text.splitlines() if line.strip()}
    assert lines["longest"][4:8] == ["5.0", "4.0", "60.0/75.5", "475.5"]  # 4 ms x 100000 / 1000 + 75.5
    assert lines["longest"][-3:] == ["chosen:", "SEBP", "compiled"]
    assert lines["bucket"][4:8] == ["-", "-", "-/-", "800.0"] and lines["bucket"][8:10] == ["not", "compiled:"]
