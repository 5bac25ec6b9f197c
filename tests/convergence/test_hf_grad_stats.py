"""The gradient-statistics callback through the real trainers: transformers' Trainer (a tiny BERT classifier)
and TRL's SFTTrainer (a tiny Llama on prompt/completion data, completion-only loss), with and without
apply_sebp, logging to TensorBoard: the statistics are in the event file, at the probed steps, and equal the
callback's own records, which equal what analyze's collector finds on the same first batch."""
from __future__ import annotations

import pytest
import torch

from sebp_probe.integrations.hf import GradStatsCallback, add_grad_stats, apply_sebp
from tests.convergence.finetune_helpers import isolated_accelerate  # noqa: F401 (a fresh accelerate state per test)
from tests.convergence.test_hf_trainer import _Rows, _args, _completions
from tests.tiny_models import tiny_model, word_tokenizer

pytest.importorskip("tensorboard")
STEPS = 5
EVERY = 2  # steps 1, 3, 5 are probed


def _scalars(logdir) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of every scalar in the TensorBoard event files under ``logdir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for f in logdir.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(f.parent))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def _check(trainer, stats: GradStatsCallback, logdir, first_type: str):
    assert [r["step"] for r in stats.records] == [1, 3, 5]
    scalars = _scalars(logdir)
    tag = f"train/grad_stats/{first_type}/rows_90"
    assert set(scalars[tag]) == {1, 3, 5}
    for rec in stats.records:
        want = rec["types"][first_type]
        assert scalars[tag][rec["step"]] == pytest.approx(want["rows_90"], rel=1e-6)
        assert scalars[f"train/grad_stats/{first_type}/active"][rec["step"]] == pytest.approx(
            want["causes"]["active"], rel=1e-6)
        assert 0 < want["rows_90"] < want["rows_99"] <= 1
        assert scalars["train/grad_stats/record_ms"][rec["step"]] == pytest.approx(rec["record_ms"], rel=1e-6)
        assert rec["record_ms"] > 0
    assert vars(trainer).get("training_step") is stats.before  # the probed steps' wrapper is gone
    assert not any(m._forward_hooks for m in trainer.model.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.slow
@pytest.mark.parametrize("sebp", [False, True])
def test_trainer_logs_the_statistics_to_tensorboard(tmp_path, sebp):
    from transformers import Trainer

    logdir = tmp_path  # the TensorBoard callback writes under output_dir
    trainer = Trainer(model=tiny_model("bert"), args=_args(tmp_path, max_steps=STEPS, report_to=["tensorboard"]),
                      train_dataset=_Rows("bert"))
    handle = apply_sebp(trainer, calibrate=False) if sebp else None
    stats = add_grad_stats(trainer, every=EVERY)
    stats.before = vars(trainer).get("training_step")
    trainer.train()
    _check(trainer, stats, logdir, "attention.self.query")
    first = stats.records[0]
    layer0 = first["layers"]["bert.encoder.layer.0.attention.self.query"]
    assert layer0["rows"] == 4 * 11  # a batch of 4 rows of _Rows, padded to 11 tokens
    pads = layer0["causes"]["padding"] * 44  # 7, 4 or 2 pad tokens per row (lengths 4, 7, 9), 0 for 11
    assert pads == pytest.approx(round(pads)) and 0 < round(pads) <= 3 * 7 + 2
    if handle is not None:
        assert handle.applied
        handle.undo()


@pytest.mark.slow
@pytest.mark.parametrize("sebp", [False, True])
def test_sft_trainer_logs_the_statistics_to_tensorboard(tmp_path, sebp):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    logdir = tmp_path
    args = _args(tmp_path, trl.SFTConfig, max_length=None, max_steps=STEPS, report_to=["tensorboard"])
    trainer = trl.SFTTrainer(model=tiny_model("llama"), args=args, train_dataset=Dataset.from_list(_completions()),
                             processing_class=word_tokenizer())
    handle = apply_sebp(trainer, fallback_if_slower=False) if sebp else None
    stats = add_grad_stats(trainer, every=EVERY)
    stats.before = vars(trainer).get("training_step")
    trainer.train()
    _check(trainer, stats, logdir, "self_attn.q_proj")
    causes = stats.records[0]["types"]["self_attn.q_proj"]["causes"]
    assert causes["active"] < 1  # the prompt's rows are label-less in the last layer, padding in every layer
    if handle is not None:
        handle.undo()


def test_every_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="every must be an integer >= 1"):
        GradStatsCallback(None, every=0)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_trainer_torch_compile_probes_inside_the_graphs(tmp_path, monkeypatch, device):
    """Under ``torch_compile`` (on the CPU aot_eager standing in for Inductor; on a GPU Inductor with CUDA graphs,
    ``reduce-overhead``) the probed steps run compiled: the callback's taps are in the graphs, no graph break,
    and its records are the uncompiled trainer's (rows exact, the shares within the numerics of compiled code);
    the linears get their classes back when training ends."""
    import torch._dynamo as dynamo
    from transformers import Trainer

    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "no")  # TrainingArguments(torch_compile=True) sets these
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "default")
    records = {}
    for compiled in (False, True):
        kw = {"use_cpu": device == "cpu"}
        if compiled:
            kw.update(torch_compile=True, torch_compile_backend="aot_eager" if device == "cpu" else "inductor",
                      torch_compile_mode=None if device == "cpu" else "reduce-overhead")
        model = tiny_model("bert")
        classes = {n: type(m) for n, m in model.named_modules()}
        trainer = Trainer(model=model, args=_args(tmp_path / str(compiled), max_steps=STEPS, **kw),
                          train_dataset=_Rows("bert"))
        stats = add_grad_stats(trainer, every=EVERY)
        dynamo.reset()
        dynamo.utils.counters.clear()
        try:
            trainer.train()
            breaks = sum(dynamo.utils.counters["graph_break"].values())
            graphs = dynamo.utils.counters["stats"]["unique_graphs"]
        finally:
            dynamo.reset()
        assert {n: type(m) for n, m in model.named_modules()} == classes
        records[compiled] = stats.records
    assert breaks == 0 and graphs >= 2  # the probed graph beside the unprobed one
    assert [r["step"] for r in records[True]] == [r["step"] for r in records[False]] == [1, 3, 5]
    for got, want in zip(records[True], records[False]):
        for name, e in want["layers"].items():
            assert got["layers"][name]["rows"] == e["rows"] > 0
            assert got["layers"][name]["causes"] == pytest.approx(e["causes"], abs=0.02), name
