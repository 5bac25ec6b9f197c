"""``--calib-budget`` over the whole calibration (:mod:`sebp_probe.train.calibration_budget`): ``--padding
auto``'s timing and the run's SEBP calibration share one budget; what it cannot afford is cut and said. Timed
by fake timers (chosen ms per token slot) on tiny config-built models; every real pass is counted through the
embeddings, so that the cost checked is what ran, not what the plan said."""
from __future__ import annotations

import pytest
import torch

from sebp_kernels import SEBPConfig
from sebp_probe.config import DataConfig, FinetuneConfig
from sebp_probe.data.train_data import first_batches
from sebp_probe.notes import collect_notes
from sebp_probe.train import finetune as ft
from sebp_probe.train.calibration import calibrate, candidate_layers
from sebp_probe.train.calibration_budget import CalibBudget, plan_calibration, prior_layers
from tests.convergence.finetune_helpers import isolated_accelerate, synthetic_data  # noqa: F401
from tests.probe.test_padding_auto import RateTimer, _loader
from tests.tiny_models import tiny_model

RATE = 10.0  # ms per token slot, every pass


def _budget(left: float, total: float = 100.0) -> CalibBudget:
    return CalibBudget(0.05, 1000, budget_ms=total, left_ms=left, per_slot_ms=1.0)


def test_the_plan_takes_the_richest_calibration_the_budget_affords():
    slots = [10, 10]  # two batches of 10 ms a pass; none measured yet
    full = plan_calibration(_budget(120.0), slots, 0, 1, 2)  # 20 density + 20 x (1 + 4) timing = 120
    assert (full.density, full.timed, full.reps, full.cost_ms, full.cut) == (2, 2, 2, 120.0, None)
    one_round = plan_calibration(_budget(80.0), slots, 0, 1, 2)
    assert (one_round.timed, one_round.reps) == (2, 1) and "1 timed round on 2 batches, not 2 on 2" in one_round.cut
    one_batch = plan_calibration(_budget(50.0), slots, 0, 1, 2)
    assert (one_batch.timed, one_batch.reps, one_batch.cost_ms) == (1, 1, 50.0)
    assert plan_calibration(_budget(80.0), slots, 0, 2, 2).timed == 1  # two implementations to time: twice
    untimed = plan_calibration(_budget(15.0), slots, 0, 1, 2)
    assert (untimed.density, untimed.timed) == (1, 0) and "affords no timing of SEBP against dense" in untimed.cut
    assert plan_calibration(_budget(15.0), slots, 1, 1, 2).density == 2  # the first measured: the second fits
    nothing = plan_calibration(_budget(-5.0), slots, 0, 1, 2)
    assert (nothing.density, nothing.cost_ms) == (0, 0.0) and "0.00 s left of 0.10 s" in nothing.cut


def test_without_a_pass_the_padding_decides_for_exact_layers():
    exact, topk = SEBPConfig("exact"), SEBPConfig("topk", top_n=2)
    ids = torch.ones(2, 10, dtype=torch.long)
    padded = {"input_ids": ids, "attention_mask": torch.tensor([[1] * 4 + [0] * 6, [1] * 10])}  # 30% padding
    full = {"input_ids": ids, "attention_mask": torch.ones(2, 10, dtype=torch.long)}
    layers, said = prior_layers({"a": exact, "b": topk}, [padded], 0.9)
    assert set(layers) == {"a", "b"} and said.startswith("30% padding on the first batches: SEBP on 2 of 2")
    assert set(prior_layers({"a": exact, "b": topk}, [full], 0.9)[0]) == {"b"}  # the approximate one: asked for
    packed = {"input_ids": ids, "sequence_ids": torch.tensor([[0] * 5 + [-1] * 5, [1] * 10])}  # its tail: padding
    assert prior_layers({"a": exact}, [packed], 0.9)[1].startswith("25% padding")


def _counting(model) -> list[int]:
    """Token slots of every forward ``model`` runs from now on (through its embeddings)."""
    seen: list[int] = []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].numel()))
    return seen


def _calibrate(steps: int, share: float = 0.05):
    cfg = FinetuneConfig(model="tiny", data=DataConfig(max_length=24, batch_size=8, padding="longest"),
                         method="sebp", max_steps=steps, calib_budget=share)
    model, data = tiny_model("llama"), synthetic_data("causal-lm", prompt=0.5)
    batches = first_batches(cfg, data, torch.device("cpu"))
    seen = _counting(model)

    def timer(key, batch, run):  # runs the pass (its density counts), says it took RATE ms a token slot
        run()
        return RATE * batch["input_ids"].numel()

    budget = CalibBudget(share, steps, timer=timer)
    with collect_notes() as notes:
        c = calibrate(model, batches, candidate_layers(model, cfg, None), 1.0, torch.device("cpu"), budget=budget)
    return c, RATE * sum(seen), RATE * batches[0]["input_ids"].numel(), notes


@pytest.mark.parametrize("steps,timed", [(2, False), (30, False), (200, True), (400, True)])
def test_a_runs_calibration_stays_within_its_budget(steps, timed):
    """A run with its padding set (no --padding auto before it): its first pass estimates the run (the budget:
    5% of it); the passes that ran cost at most the budget, but for that first pass where the run is shorter
    than it. What the budget cut is said in one line."""
    c, cost, first, notes = _calibrate(steps)
    assert c.budget["budget_s"] * 1e3 == pytest.approx(0.05 * steps * first, abs=1e-3)
    assert cost <= max(c.budget["budget_s"] * 1e3, first) + 1e-6
    assert (c.dense_step_ms is not None) == timed
    cut = c.budget["cut"]
    assert [n[len("calibration: "):] for n in notes if n.startswith("calibration: ")] == ([cut] if cut else [])


def test_a_long_run_is_calibrated_as_before():
    c, cost, first, notes = _calibrate(2000)
    assert c.dense_step_ms is not None and c.sebp_step_ms is not None and c.budget["cut"] is None and not notes


def test_a_run_with_no_pass_to_spare_takes_the_paddings_answer():
    c, cost, first, notes = _calibrate(2)
    assert cost == pytest.approx(first)  # the first pass alone
    assert c.dense_step_ms is None and c.budget["cut"].endswith(", untimed")
    assert "affords no timing" in c.budget["cut"] or "affords no calibration pass" in c.budget["cut"]


@pytest.mark.slow
@pytest.mark.parametrize("steps,share,timed", [(30, 0.05, False), (60, 0.25, None), (200, 1.0, True)])
def test_a_runs_whole_calibration_stays_within_one_budget(tmp_path, steps, share, timed):
    """``--padding auto`` then the SEBP run's calibration: every pass of both (the fake timer's, and the real
    density and calibration passes counted at the same rate) costs at most the one budget (past the first
    pass); a run whose budget affords it (200 steps at 1.0: as 4000 at the default 0.05) times both."""
    seen: list[int] = []
    calibrating = [True]

    def count(module, args, out) -> None:
        if calibrating[0]:
            seen.append(args[0].numel())

    def load():
        loaded = _loader()()
        loaded.model.get_input_embeddings().register_forward_hook(count)
        return loaded

    def on_event(kind, payload):
        if kind == "start":
            calibrating[0] = False

    timer = RateTimer(lambda key: RATE * (0.5 if key[2] == "sebp" else 1.0))
    cfg = FinetuneConfig(model="tiny", data=DataConfig(max_length=24, batch_size=8, padding="auto"),
                         output_dir=str(tmp_path / "run"), method="sebp", max_steps=steps, calib_budget=share,
                         dense_fallback=1.0, fallback_if_slower=False, eval_steps=steps, eval_samples=8)
    s = ft.finetune(cfg, load_fn=load, data=synthetic_data("causal-lm", prompt=0.5), on_event=on_event,
                    padding_timer=timer)
    choice, calib = s["padding_choice"], s["calibration"]
    cost = timer.spent + RATE * sum(seen)
    first = timer.calls and RATE * 8 * 24
    assert cost <= max(choice["budget_s"] * 1e3, first) + 1e-6
    assert calib["budget"]["budget_s"] == pytest.approx(choice["budget_s"])
    if timed is not None:
        assert (choice["untimed"] is None) == timed and (calib["dense_step_ms"] is not None) == timed


@pytest.mark.parametrize("steps", [30, 2000, 20000])
def test_compiled_candidates_are_timed_only_where_the_budget_affords_them(monkeypatch, steps):
    """``--compile auto``: a compiled candidate costs its compile (5 s here, the fake's clock) and its passes;
    with the eager timing before it, within the budget: a short run times none, a long one every layout timed
    eager, and one between what fits, the rest named (in its row and one line)."""
    from sebp_probe.train import compiling, strategy
    from sebp_probe.train.strategy import choose_padding

    monkeypatch.setattr(strategy, "inductor_problem", lambda device: None)
    monkeypatch.setattr(compiling, "inductor_problem", lambda device: None)
    spent = []

    def compiled(model, batches, mean_slots, device, autocast, reps, *args, **kwargs):
        spent.append(5e3 + (1 + reps) * sum(RATE / 2 * b["input_ids"].numel() for b in batches))
        return RATE / 2 * mean_slots, 5.0  # twice as fast as eager, after a compile of 5 s

    monkeypatch.setattr(strategy, "_compiled_ms", compiled)
    timer, lines = RateTimer(lambda key: RATE), []
    cfg = FinetuneConfig(model="tiny", data=DataConfig(max_length=24, batch_size=8, padding="auto"), method="dense",
                         compile="auto", max_steps=steps, calib_batches=0)
    choice = choose_padding(tiny_model("llama"), cfg, synthetic_data("causal-lm", prompt=0.5), {},
                            torch.device("cpu"), heads=("labelled", "full"), timer=timer, say=lines.append)
    assert timer.spent + sum(spent) <= max(choice.budget_s * 1e3, timer.spent if len(timer.calls) == 1 else 0) + 1e-6
    eager = [r for r in choice.table if "dense_ms" in r]
    compiled_rows = [r for r in eager if "dense_compiled_ms" in r]
    over = [r for r in eager if r.get("compiled_skipped", "").startswith("not timed: compiling and timing it")]
    assert len(compiled_rows) + len(over) == len(eager) and len(spent) == len(compiled_rows)
    assert any("compiled candidates not timed (over the budget)" in line for line in lines) == bool(over)
    if steps == 30:
        assert not eager and not spent
    if steps == 20000:
        assert eager and not over
