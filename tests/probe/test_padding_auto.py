"""``--padding auto``'s prior, budget and pick (:mod:`sebp_probe.train.layout_prior`, :mod:`~.strategy`): timed
by a timer that returns chosen times (with noise where it matters), on tiny config-built models. The pick stays
near the best candidate's true cost under noise, a short run times within its budget (or not at all), the
progress lines reach a log that is not a terminal, and ``--compare`` trains both halves on one choice."""
from __future__ import annotations

import random

import pytest
import torch

from sebp_probe.config import DataConfig, FinetuneConfig
from sebp_probe.train import finetune as ft
from sebp_probe.train.layout_prior import PRIOR_SLOTS, noise_aware, plan_timing, prior_skips, within_noise
from sebp_probe.train.metrics import compare_runs
from sebp_probe.train.strategy import choose_padding
from tests.convergence.finetune_helpers import isolated_accelerate, synthetic_data  # noqa: F401
from tests.tiny_models import tiny_model


class RateTimer:
    """A pass of candidate ``key`` takes ``rate(key)`` ms per token slot of its batch, times ``noise(rng)``; the
    first pass (the run's estimate) takes ``first_ms`` where given. ``spent``: the ms it returned."""

    def __init__(self, rate, noise=lambda rng: 1.0, seed: int = 0, first_ms: float | None = None):
        self.rate, self.noise, self.rng, self.first_ms = rate, noise, random.Random(seed), first_ms
        self.calls: list[tuple] = []
        self.spent = 0.0

    def __call__(self, key, batch, run) -> float:
        self.calls.append(key)
        if self.first_ms is not None and len(self.calls) == 1:
            ms = self.first_ms
        else:
            ms = self.rate(key) * batch["input_ids"].numel() * self.noise(self.rng)
        self.spent += ms
        return ms


def _cfg(**kw) -> FinetuneConfig:
    base = dict(model="tiny", data=DataConfig(max_length=24, batch_size=8, padding="auto"), method="dense",
                max_steps=100, calib_batches=0)
    base.update(kw)
    return FinetuneConfig(**base)


def _spiky(rng: random.Random) -> float:
    """A host with a CPU-bound neighbour: every pass up to 15% slower, one pass in twelve 1.5-2.5x slower."""
    return rng.uniform(1.0, 1.15) * (rng.uniform(1.5, 2.5) if rng.random() < 1 / 12 else 1.0)


def test_the_prior_skips_layouts_of_far_more_token_slots():
    skips = prior_skips({"max_length": 640.0, "longest": 300.0, "packed": 200.0})
    assert set(skips) == {"max_length"} and f"3.2x the token slots of packed (over {PRIOR_SLOTS}x)" in \
        skips["max_length"]
    assert prior_skips({"a": 100.0, "b": 150.0}) == {}


def test_the_plan_fits_the_budget_leaner_first_then_fewer_candidates():
    assert plan_timing([1.0] * 4, [0] * 4, 3.9, 3) is None  # not one pass of each: untimed
    rich = plan_timing([1.0] * 4, [0] * 4, 48.0, 3)
    assert (rich.batches, rich.rounds, rich.chosen) == (3, 3, [0, 1, 2, 3])
    lean = plan_timing([1.0] * 4, [1, 0, 1, 0], 8.0, 3)  # (1, 2): 4, 3, 4, 3 passes: the first two fit
    assert (lean.batches, lean.rounds, lean.chosen) == (1, 2, [0, 1])


def test_a_gain_within_the_spread_goes_the_priors_way():
    prior, other = ((100.0, 95.0, 110.0), (0,)), ((97.0, 90.0, 104.0), (1,))
    assert within_noise(prior[0], other[0]) and noise_aware([prior, other]) == 0
    clear = ((80.0, 79.0, 81.0), (1,))
    assert not within_noise(prior[0], clear[0]) and noise_aware([prior, clear]) == 1


@pytest.mark.slow
def test_under_noise_the_pick_stays_within_10_percent_of_the_best_true_cost():
    """Many noisy trials, each with other true costs (some where the least padding loses by far): the pick's
    true cost is never more than 10% above the best timed candidate's."""
    model, data = tiny_model("llama"), synthetic_data("causal-lm", n=96, prompt=0.5)
    cfg = _cfg(calib_budget=1.0)
    worst = 1.0
    for trial in range(40):
        rng = random.Random(trial)
        rates = {}
        timer = RateTimer(lambda key: rates.setdefault(key[:2], rng.uniform(1.0, 1.8)), _spiky, seed=trial,
                          first_ms=1e4)  # the first pass says a long run: every candidate afforded
        choice = choose_padding(model, cfg, data, {}, torch.device("cpu"), heads=("labelled", "full"), timer=timer)
        rows = [r for r in choice.table if "dense_ms" in r]
        assert len(rows) >= 4 and all("dense_spread" in r for r in rows)
        true = {(r["padding"], r["head"]): rates[(r["padding"], r["head"])] * r["slots"] for r in rows}
        worst = max(worst, true[(choice.padding, choice.head)] / min(true.values()))
    assert worst <= 1.10


def test_a_short_run_takes_the_priors_pick_untimed_and_says_so():
    lines = []
    timer = RateTimer(lambda key: 1.0)
    choice = choose_padding(tiny_model("llama"), _cfg(max_steps=2), synthetic_data("causal-lm", prompt=0.5), {},
                            torch.device("cpu"), heads=("labelled", "full"), timer=timer, say=lines.append)
    assert len(timer.calls) == 1  # the run's estimate, nothing else
    least = min((r for r in choice.table if "skipped" not in r), key=lambda r: r["padding_share"])
    assert (choice.padding, choice.head, choice.method) == (least["padding"], "labelled", "dense")
    assert choice.untimed.startswith("too short a run to time the layouts")
    assert sum("too short a run" in line for line in lines) == 1


@pytest.mark.parametrize("steps", [30, 200, 2000])
def test_the_timing_stays_within_its_budget(steps):
    timer = RateTimer(lambda key: 0.01 * (2.0 if key[1] == "full" else 1.0))
    choice = choose_padding(tiny_model("llama"), _cfg(max_steps=steps), synthetic_data("causal-lm", prompt=0.5),
                            {}, torch.device("cpu"), heads=("labelled", "full"), timer=timer)
    assert timer.spent <= choice.budget_s * 1e3 + 1e-9 and choice.spent_s == pytest.approx(timer.spent / 1e3,
                                                                                          abs=1e-3)
    timed = [r for r in choice.table if "dense_ms" in r]
    assert (choice.untimed is None) == bool(timed)
    for r in choice.table:  # each candidate timed, skipped with its reason, or named as not timed
        assert "dense_ms" in r or "skipped" in r or r.get("not_timed") == ["dense"]


def test_a_comparison_that_ran_on_two_setups_never_says_same_computation():
    recs = [{"type": "train", "step": s, "loss": 1.0, "backward_ms": 10.0, "step_ms": 20.0} for s in range(1, 30)]
    dense = {"method": "dense"}
    sebp = {"method": "sebp", "calibration": {"layers": {}, "fallback_reason": "SEBP measured slower"}}
    assert compare_runs(dense, sebp, recs, recs)["verdict"] == "same computation"
    assert compare_runs(dense, sebp, recs, recs, paired=False)["verdict"] != "same computation"
    assert compare_runs(dense, sebp, recs, recs, same_setup=False)["verdict"] != "same computation"


def test_calib_budget_is_a_share_of_the_run():
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"--calib-budget must be a share of the run's time in \(0, 1\]"):
            _cfg(calib_budget=bad)
    assert _cfg(calib_budget=1).calib_budget == 1


def _loader():
    from sebp_probe.data.assets import LoadedModel

    return lambda: LoadedModel(tiny_model("llama"), None, "causal-lm", "tiny-llama", "config")


@pytest.mark.slow
def test_compare_under_auto_trains_both_halves_on_one_choice(tmp_path):
    """A timer under which dense alone is fastest on one layout and SEBP on another (as the old plan trained
    them: the halves on different batches, and a headline of "same computation" with a loss gap), its times
    wobbling from one call to the next: both halves train on the one layout and head chosen before either run,
    on the same batches (paired; the same losses, SEBP being exact)."""
    def rate(key):
        padding, head, method = key
        fast = {"dense": "longest", "sebp": "bucket"}[method]
        return 0.5 if padding == fast else 1.3

    flips = iter(range(10**6))
    timer = RateTimer(rate, noise=lambda rng: 1.0 + 0.02 * (next(flips) % 3), first_ms=1e4)
    events = []
    cfg = FinetuneConfig(model="tiny", data=DataConfig(max_length=24, batch_size=8, padding="auto"),
                         output_dir=str(tmp_path / "run"), method="sebp", compare=True, max_steps=60, lr=2e-3,
                         warmup_ratio=0.0, dense_fallback=1.0, fallback_if_slower=False, calib_budget=1.0,
                         eval_steps=60, eval_samples=8, seed=0)  # 60 steps: a budget for every candidate
    s = ft.finetune(cfg, load_fn=_loader(), data=synthetic_data("causal-lm", prompt=0.5),
                    on_event=lambda k, p: events.append((k, p)), padding_timer=timer)
    choice = s["padding_choice"]
    assert choice["best"]["dense"] != choice["best"]["sebp"]  # each method alone would train elsewhere
    runs = s["runs"]
    assert runs["dense"]["padding"] == runs["sebp"]["padding"] == choice["padding"]
    assert runs["dense"]["head"] == runs["sebp"]["head"]
    assert [k for k, _ in events].count("padding") == 1
    assert s["comparison"]["timing"]["paired"] and s["comparison"]["max_abs_loss_gap"] <= 1e-5


@pytest.mark.slow
def test_without_a_terminal_the_log_says_each_phase_in_plain_lines(tmp_path):
    """typer's CliRunner is not a terminal (as a run redirected to a file): --padding auto's phases and the
    training's progress come as plain lines, and the final table says an SEBP run that patched nothing."""
    from typer.testing import CliRunner

    from sebp_probe.cli import app
    from tests.cli.test_finetune_cli import _tiny_bert

    model = _tiny_bert(tmp_path / "bert")
    r = CliRunner().invoke(app, ["finetune", model, "tweets", "--max-steps", "2", "--max-samples", "64",
                                 "--batch-size", "8", "--max-length", "32", "--eval-samples", "16",
                                 "-o", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    out = r.output
    assert "--padding auto: prior, mean token slots per batch:" in out and "--padding auto: first pass" in out
    assert "--padding auto: too short a run to time the layouts" in out and "--padding auto: chose" in out
    assert "sebp: training from step 0 to 2" in out and "sebp step 2/2: loss" in out


def test_the_final_table_says_where_an_approximate_run_kept_every_layer_dense(tmp_path, capsys):
    from sebp_probe.tables import print_finetune_summary

    cfg = FinetuneConfig(model="tiny", data=DataConfig(padding="longest"), mode="topk", top_n=4,
                         output_dir=str(tmp_path))
    run = {"status": "completed", "method": "sebp", "steps": 2,
           "calibration": {"layers": {}, "fallback_reason": "SEBP measured slower than dense"}}
    summary = ft._overall_summary(cfg, [("sebp", cfg)], None, {"sebp": run}, {"sebp": []}, tmp_path, [])
    assert summary["kept_dense"].endswith("; the approximate --mode topk was not applied")
    print_finetune_summary(summary)
    text = " ".join(capsys.readouterr().out.split())
    assert ("sebp: SEBP ran on 0 layers (SEBP measured slower than dense); the approximate --mode topk was not "
            "applied: it trained exactly as dense") in text


class FlipTimer(RateTimer):
    """Which of ``layouts`` is fastest (10x) flips at each new choice (:meth:`flip`); within one, noise of 2%.
    Each choice's first pass says a long run, so every candidate is afforded."""

    def __init__(self, layouts: tuple[str, str]):
        super().__init__(lambda key: 0.2 if key[0] == layouts[self.choices % 2] else 2.0,
                         noise=lambda rng: rng.uniform(1.0, 1.02), first_ms=1e4)
        self.choices = 0

    def flip(self) -> None:
        self.choices += 1
        self.calls = []  # the next call is the next choice's first pass


FLIP_LAYOUTS = ("longest", "bucket")


def test_the_flip_timer_flips_the_choice_between_two_choices():
    """The instrument of the test below: two choices in a row under it pick different layouts, as any code that
    chose once per half would."""
    model, data, timer = tiny_model("llama"), synthetic_data("causal-lm", prompt=0.5), FlipTimer(FLIP_LAYOUTS)
    picks = []
    for _ in range(2):
        timer.flip()
        picks.append(choose_padding(model, _cfg(calib_budget=1.0), data, {}, torch.device("cpu"), timer=timer).padding)
    assert picks == [FLIP_LAYOUTS[1], FLIP_LAYOUTS[0]]


def _metrics(run_dir) -> list[dict]:
    import json

    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]


@pytest.mark.slow
@pytest.mark.parametrize("fallback", [1.0, 1e-6])
def test_compare_halves_share_one_choice_under_a_timer_that_flips_between_choices(tmp_path, monkeypatch, fallback):
    """A timer that flips the fastest layout at every choice: both halves still train on one layout and head,
    on the same batches step by step (tokens and rows), so one choice was made; "same computation" is said
    exactly when the SEBP half patched nothing (``fallback`` 1e-6: no layer qualifies; then the losses are
    dense's to the bit), and never where SEBP ran on its layers."""
    timer, picks, real = FlipTimer(FLIP_LAYOUTS), [], ft.choose_padding

    def choosing(*args, **kwargs):
        timer.flip()
        picks.append(real(*args, **kwargs))  # finetune passes its padding_timer: this one
        return picks[-1]

    monkeypatch.setattr(ft, "choose_padding", choosing)
    cfg = FinetuneConfig(model="tiny", data=DataConfig(max_length=24, batch_size=8, padding="auto"),
                         output_dir=str(tmp_path / "run"), method="sebp", compare=True, max_steps=12, lr=2e-3,
                         warmup_ratio=0.0, dense_fallback=fallback, fallback_if_slower=False, calib_budget=1.0,
                         eval_steps=12, eval_samples=8, seed=0)
    s = ft.finetune(cfg, load_fn=_loader(), data=synthetic_data("causal-lm", prompt=0.5), padding_timer=timer)
    runs = s["runs"]
    assert len(picks) == 1 and runs["dense"]["padding"] == runs["sebp"]["padding"] == picks[0].padding
    assert runs["dense"]["head"] == runs["sebp"]["head"]
    dense, sebp = _metrics(tmp_path / "run" / "dense"), _metrics(tmp_path / "run" / "sebp")
    assert [(r["tokens"], r["rows"]) for r in dense] == [(r["tokens"], r["rows"]) for r in sebp] and len(dense) == 12
    comparison = s["comparison"]
    assert comparison["timing"]["paired"]
    patched = bool(runs["sebp"]["calibration"]["layers"])
    assert patched == (fallback == 1.0)
    assert (comparison["verdict"] == "same computation") == (not patched)
    assert comparison["max_abs_loss_gap"] <= (1e-5 if patched else 0.0)


def test_padding_auto_times_every_sampled_layer_whatever_its_density():
    """``--padding auto``'s SEBP candidate keeps a sampled layer on dense rows, as the run's calibration does
    (the user asked for the approximation); an exact layer there is left dense (the classifier's last layer
    has few rows that carry gradient, and keeps SEBP)."""
    import contextlib

    from sebp_probe.train.calibration import candidate_layers
    from sebp_probe.train.strategy import _sebp_patch

    model = tiny_model("bert")
    ids = torch.randint(3, 100, (4, 12))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 1, 0, 1])}
    got = {}
    for mode in ("sampled", "exact"):
        extra = {"budget": 0.5} if mode == "sampled" else {}
        cfg = FinetuneConfig(model="tiny", data=DataConfig(max_length=12, batch_size=4, padding="auto"),
                             mode=mode, **extra)
        candidates = candidate_layers(model, cfg, None)
        row: dict = {}
        _sebp_patch(model, cfg, row, [batch], candidates, torch.device("cpu"), contextlib.nullcontext)
        got[mode] = row["sebp_layers"]
    assert got["sampled"] == len(candidates) and 0 < got["exact"] < len(candidates), got
