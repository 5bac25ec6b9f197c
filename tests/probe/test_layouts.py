"""The layout registry is the one place a layout is defined: every consumer serves each entry (a new entry
included), and no module redefines the list."""
from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest
import typer

from sebp_probe.bench import bench_cases
from sebp_probe.train import strategy
from sebp_probe.data.batching import padding_share
from sebp_probe.cli import app
from sebp_probe.config import DataConfig, FinetuneConfig, padding_help
from sebp_probe.layouts import LAYOUTS, Layout
from sebp_probe.data.train_data import TrainData, make_loaders
from tests.tiny_models import tiny_model

ROOT = Path(__file__).resolve().parents[2]
# A layout the code does not know by name: batches of similar lengths, each padded to --max-length.
NEW = Layout("grouped_max", "batches of similar lengths, each padded to --max-length", pad_to="max_length",
             grouped=True)


@pytest.fixture(params=[False, True], ids=["registry", "with a new entry"])
def layouts(request, monkeypatch) -> dict[str, Layout]:
    if request.param:
        monkeypatch.setitem(LAYOUTS, NEW.name, NEW)
    return LAYOUTS


def _data(task: str, n: int = 20) -> TrainData:
    rng = random.Random(0)
    items = []
    for _ in range(n):
        ids = [rng.randint(3, 99) for _ in range(rng.randint(2, 12))]
        items.append({"input_ids": ids, "label": ids[0] % 2} if task == "classification" else
                     {"input_ids": ids, "labels": ids})
    return TrainData(task, items, items[:6], pad_id=0)


def _cfg(padding: str) -> FinetuneConfig:
    return FinetuneConfig(model="tiny", data=DataConfig(padding=padding, max_length=16, batch_size=4))


def _slots(batch: dict) -> tuple[int, int]:
    """(real tokens, token slots) of a collated batch."""
    if "cu_seqlens" in batch:
        return int(batch["cu_seqlens"][-1]), batch["input_ids"].numel()
    return int(batch["attention_mask"].sum()), batch["input_ids"].numel()


def test_train_data_serves_every_layout_as_its_padding_share_counts(layouts):
    data = _data("causal-lm")
    for name, lay in layouts.items():
        train, ev, sampler = make_loaders(_cfg(name), data)
        sampler.set_epoch(0)
        batches = list(train)
        real, slots = map(sum, zip(*map(_slots, batches)))
        assert real == sum(len(it["input_ids"]) for it in data.train), name  # every sequence once
        share = padding_share([len(it["input_ids"]) for it in data.train], 4, 16, name)
        assert 1 - real / slots == pytest.approx(share), name
        if lay.pad_to == "max_length":
            assert all(b["input_ids"].shape[1] == 16 for b in batches), name
        assert all("attention_mask" in b for b in ev), name  # evaluation batches are always padded


def test_bench_cases_serve_every_layout(layouts):
    case = bench_cases.ModelCase("t", "bert", batch=4, max_length=32, lengths="short")
    lengths = bench_cases.sample_lengths(case.lengths, 12, case.max_length, seed=0)
    items = bench_cases.make_items(case, lengths, vocab=100, seed=0)
    batches = bench_cases.layout_batches(case, items, seed=0)
    assert list(batches) == list(layouts)
    for name, got in batches.items():  # every sequence once, in batches of the case's size
        assert sum(_slots(b)[0] for b in got) == sum(lengths), name
        assert len(got) == 3 and all(len(b["labels"]) == 4 for b in got), name
    assert list(bench_cases.layout_padding(lengths, case, 0, "sdpa")) == list(layouts)


def test_strategy_weighs_every_layout(layouts, monkeypatch):
    """Every layout is in the table: timed, or skipped with its reason (it cannot run here, or the prior: far
    more token slots than the fewest)."""
    monkeypatch.setattr(strategy, "_layout_ms", lambda *a, **k: {"dense": 1.0})
    model = tiny_model("llama")
    choice = strategy.choose_padding(model, _cfg("auto"), _data("causal-lm"), {}, model.device)
    assert [r["padding"] for r in choice.table] == list(layouts)
    graphed = strategy.choose_padding(model, _cfg("auto"), _data("causal-lm"), {}, model.device, graphs=True)
    skipped = {r["padding"]: r["skipped"] for r in graphed.table if "skipped" in r}
    cannot = {n for n, lay in layouts.items() if not lay.fixed_shapes}
    assert cannot <= set(skipped) and all("fixed batch shapes" in skipped[n] for n in cannot)
    assert all("not timed (prior)" in why for n, why in skipped.items() if n not in cannot)


def test_settings_take_every_layout_and_auto(layouts):
    for name in [*layouts, "auto"]:
        assert DataConfig(padding=name).padding == name
    with pytest.raises(ValueError, match="padding must be one of max_length, longest, bucket, packed"):
        DataConfig(padding="sorted")
    for name, lay in layouts.items():
        assert f"{name} ({lay.help})" in padding_help() and f"{name} ({lay.help})" in padding_help(auto=True)
    assert padding_help(auto=True).startswith("auto (") and "auto" not in padding_help().split(" (")[0]


def test_cli_help_of_padding_lists_every_layout():
    command = typer.main.get_command(app)
    for sub, auto in (("finetune", True), ("analyze", False)):
        opt = next(p for p in command.commands[sub].params if "--padding" in p.opts)
        assert opt.help == padding_help(auto=auto)
        assert all(f"{name} (" in opt.help for name in LAYOUTS)


def _layout_lists(tree: ast.AST) -> list[int]:
    """Lines of the literal tuples, lists, sets and dict keys that hold two or more layout names."""
    names = set(LAYOUTS)
    out = []
    for node in ast.walk(tree):
        elts = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None) \
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else None
        if elts is None:
            continue
        found = {e.value for e in elts if isinstance(e, ast.Constant) and e.value in names}
        if len(found) >= 2:
            out.append(node.lineno)
    return out


def test_no_module_redefines_the_layout_list():
    offenders = {}
    for folder in ("sebp_probe", "benchmarks", "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "sebp_probe" / "layouts.py":
                continue
            lines = _layout_lists(ast.parse(path.read_text()))
            if lines:
                offenders[str(path.relative_to(ROOT))] = lines
    assert not offenders, f"layout names listed outside sebp_probe/layouts.py: {offenders}"
    sample = 'A = ("max_length", "packed")\nB = {"longest": 1, "bucket": 2}\nC = ["max_length"]'
    assert _layout_lists(ast.parse(sample)) == [1, 2]  # the check finds such lists, and only them
