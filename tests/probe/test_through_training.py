"""Gradient statistics through training: the concentration from the histograms against the sorted rows, a
probed step's record against the gradients captured on the same backward, the sum over processes, and the
bad inputs."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sebp_probe.analysis.heatmap import capture_output_grads
from sebp_probe.analysis.knee import FINE_SHIFT, OCTAVE_SHIFT, fine_histogram, octave_histogram
from sebp_probe.analysis.through_training import (_ENERGY, StepCounts, concave_knees, concentrations,
                                                 series, step_record)
from sebp_probe.config import FinetuneConfig
from sebp_probe.train.probe_steps import StepProbe, probe_cost, probe_summary
from tests.tiny_models import padded_batch, tiny_model


def concentration(counts, shift: int = FINE_SHIFT, eps: float = 0.0) -> dict | None:
    """One histogram's concentration: its row of :func:`concentrations`."""
    return concentrations(np.asarray(counts)[None], shift, [eps])[0]


def concave_knee(x: np.ndarray, y: np.ndarray) -> float | None:
    """The reference knee: kneed itself (concave, increasing); None without one."""
    from kneed import KneeLocator

    if len(x) < 3 or np.ptp(y) <= 0 or np.ptp(x) <= 0:
        return None
    knee = KneeLocator(x, y, S=1.0, curve="concave", direction="increasing").knee
    return None if knee is None else float(knee)


def energy_curve(counts: np.ndarray, shift: int, eps: float):
    """The reference curve: (rows, energy) cumulated over the histogram's own finite non-zero buckets above
    ``eps``, the largest magnitudes first, both from 0; None without such rows."""
    finite, energy, edges = _ENERGY[shift]
    idx = np.flatnonzero(finite & (edges > eps) & (np.asarray(counts) > 0))[::-1]
    if not len(idx):
        return None
    c = np.asarray(counts, dtype=np.float64)[idx]
    return np.r_[0.0, np.cumsum(c)], np.r_[0.0, np.cumsum(c * energy[idx])]


def _exact(mags: np.ndarray) -> dict:
    """The reference: rows sorted by magnitude, largest first; the share of them holding q of sum(m**2), the
    cumulative energy interpolated between whole rows."""
    e = np.sort(np.asarray(mags, dtype=np.float64) ** 2)[::-1]
    cum = np.r_[0.0, np.cumsum(e) / e.sum()]
    rows = np.arange(len(e) + 1)
    out = {f"rows_{round(q * 100)}": np.interp(q, cum, rows) / len(e) for q in (0.5, 0.9, 0.99)}
    x = np.linspace(0, 1, 201)
    out["knee"] = concave_knee(x, np.interp(x * len(e), rows, cum))
    return out


@pytest.mark.parametrize("sigma", [0.3, 1.0, 2.5])
def test_concentration_from_the_histogram_matches_the_sorted_rows(sigma):
    mags = np.exp(np.random.default_rng(1).normal(-9, sigma, 4000)).astype(np.float32)
    got, want = concentration(fine_histogram(mags)), _exact(mags)
    for key in ("rows_50", "rows_90", "rows_99"):
        assert got[key] == pytest.approx(want[key], abs=0.01), key
    assert got["knee"] == pytest.approx(want["knee"], abs=0.03)
    assert got["knee_rows"] == math.ceil(got["knee"] * len(mags))


def test_concentration_leaves_out_rows_at_or_below_eps_and_zero_rows():
    big, small = np.full(10, 1.0, np.float32), np.full(990, 2.0 ** -20, np.float32)
    hist = fine_histogram(np.r_[big, small, np.zeros(50, np.float32)])
    assert concentration(hist, eps=2.0 ** -10)["rows_99"] == pytest.approx(0.99, abs=0.011)  # 10 equal rows
    assert concentration(hist)["rows_90"] == pytest.approx(9 / 1000, abs=1e-3)  # the 990 add ~1e-9 of the energy
    assert concentration(fine_histogram(np.zeros(5, np.float32))) is None


def _curves(n: int, seed: int) -> np.ndarray:
    """Increasing curves of every shape kneed meets here: smooth, cornered, stepped, noisy, flat."""
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 1, 201)
    shapes = [lambda: 1 - np.exp(-x * rng.uniform(0.1, 60)), lambda: np.minimum(1, x / rng.uniform(0.01, 1.5)),
              lambda: np.round((1 - np.exp(-x * rng.uniform(1, 30))) * rng.integers(1, 12)),
              lambda: np.cumsum(rng.exponential(1, 201) * np.exp(-x * rng.uniform(0, 20))),
              lambda: np.sqrt(x) ** rng.uniform(0.05, 3), lambda: np.full(201, 0.5),
              lambda: (x > rng.uniform()).astype(float),
              lambda: np.clip(x + rng.uniform(0.05, 0.5) * (x > rng.uniform()), 0, 1)]  # a run of y == x
    return x, np.stack([shapes[i % len(shapes)]() for i in range(n)])


def test_knees_of_many_curves_at_once_are_kneeds():
    x, ys = _curves(700, seed=2)
    got = concave_knees(x, ys)
    assert got == [concave_knee(x, y) for y in ys]
    assert sum(k is None for k in got) > 50 and sum(k is not None for k in got) > 400


def _concentration_by_rows(counts, shift, eps):
    """The reference: the row's own energy curve (its buckets only), np.interp and kneed on it."""
    curve = energy_curve(counts, shift, eps)
    if curve is None:
        return None
    rows, energy = curve
    total = rows[-1]
    out = {}
    for q in (0.5, 0.9, 0.99):
        k = min(max(int(np.searchsorted(energy, q * energy[-1], side="left")), 1), len(energy) - 1)
        frac = (q * energy[-1] - energy[k - 1]) / (energy[k] - energy[k - 1])
        out[f"rows_{round(q * 100)}"] = float((rows[k - 1] + frac * (rows[k] - rows[k - 1])) / total)
    x = np.linspace(0, 1, 201)
    out["knee"] = concave_knee(x, np.interp(x * total, rows, energy) / energy[-1])
    out["knee_rows"] = None if out["knee"] is None else math.ceil(out["knee"] * total)
    return out


@pytest.mark.parametrize("shift", [FINE_SHIFT, OCTAVE_SHIFT])
def test_concentrations_of_many_histograms_at_once_are_each_ones_alone(shift):
    rng = np.random.default_rng(4)
    hists = np.stack([fine_histogram(np.r_[np.exp(rng.normal(rng.uniform(-20, 0), rng.uniform(0.1, 3),
                                                             rng.integers(0, 3000))), np.zeros(7)].astype(np.float32))
                      for _ in range(60)])
    if shift == OCTAVE_SHIFT:
        hists = octave_histogram(hists)
    eps = [0.0 if i % 3 else 2.0 ** -rng.integers(0, 20) for i in range(len(hists))]
    got = concentrations(hists, shift, eps)
    assert got == [_concentration_by_rows(h, shift, e) for h, e in zip(hists, eps)]
    assert got == [concentration(h, shift, e) for h, e in zip(hists, eps)]
    assert sum(g is None for g in got) >= 1 and sum(g is not None for g in got) > 40


def _probe_step(model, batches, probe):
    with probe.step(1) as around:
        for b in batches:
            with around(b):
                model(**b).loss.backward()
    return probe.take(1)


def test_a_probed_step_records_what_its_own_backward_held():
    model = tiny_model("bert")
    batch = padded_batch("bert", lengths=(11, 4, 7, 9))
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layer." in n]
    probe = StepProbe(1, model, "classification", False, None)
    with capture_output_grads(model, names) as grads:
        rec = _probe_step(model, [batch], probe)
    assert rec["type"] == "grad_stats" and rec["step"] == 1 and set(rec["layers"]) == set(names)
    real = batch["attention_mask"].reshape(-1).bool()
    for name in names:
        g = grads[name].reshape(-1, grads[name].shape[-1])
        entry = rec["layers"][name]
        assert entry["rows"] == g.shape[0]
        row_max = g.abs().amax(dim=1)
        if g.shape[0] == real.numel():  # one row per token
            assert entry["causes"]["padding"] == pytest.approx((~real).sum().item() / g.shape[0])
            live = row_max[real & (row_max > entry["eps"])]
        else:
            live = row_max[row_max > entry["eps"]]
        assert entry["causes"]["active"] * g.shape[0] == pytest.approx(len(live))
        want = _exact(live.numpy())
        for key in ("rows_90", "rows_99"):
            assert entry[key] == pytest.approx(want[key], abs=0.03), (name, key)
    q = [e for n, e in rec["layers"].items() if n.endswith("query")]
    assert rec["types"]["attention.self.query"]["rows_90"] == pytest.approx(np.mean([e["rows_90"] for e in q]))
    assert not any(m._forward_hooks for m in model.modules())  # the hooks are gone after the step


def test_the_sum_over_processes_is_the_record_of_all_their_rows():
    """What the all-reduce computes: the packed counts of two processes' batches, summed, give the record of
    one step that ran both batches."""
    model = tiny_model("bert")
    a, b = padded_batch("bert", (11, 4, 7), seed=1), padded_batch("bert", (5, 12, 3), seed=2)
    counts = []

    class Keep(StepProbe):
        def take(self, step):
            counts.append(self._counts)
            return super().take(step)

    for batch in (a, b):
        model.zero_grad()
        _probe_step(model, [batch], Keep(1, model, "classification", False, None))
    both = _probe_step(model, [a, b], StepProbe(1, model, "classification", False, None))
    summed = StepCounts.unpack(counts[0].names, counts[0].pack() + counts[1].pack())
    assert step_record(summed, 1) == both
    reduced = StepProbe(1, model, "classification", False, lambda t: t * 2, torch.device("cpu"))
    doubled = _probe_step(model, [a], reduced)  # a "reduce" that doubles every count: shares unchanged
    assert doubled["types"]["attention.self.query"]["rows"] == 2 * step_record(counts[0], 1)["types"][
        "attention.self.query"]["rows"]


def test_one_collector_serves_every_probed_step_of_a_run(monkeypatch):
    """A run's probe makes its collector once; each probed step records only its own micro-batches (a fresh
    probe's record), a step that raised leaves nothing behind, and an unprobed step records nothing."""
    from sebp_probe.analysis import hooks

    model = tiny_model("bert")
    batches = [padded_batch("bert", (11, 4, 7), seed=s) for s in range(3)]
    made = []
    real_init = hooks.GradientStatsCollector.__init__
    monkeypatch.setattr(hooks.GradientStatsCollector, "__init__",
                        lambda self, *a, **k: (made.append(1), real_init(self, *a, **k))[1])
    probe = StepProbe(2, model, "classification", False, None)
    assert len(made) == 1
    with pytest.raises(RuntimeError, match="boom"):
        with probe.step(1) as around:
            with around(batches[2]):
                model(**batches[2]).loss.backward()
            raise RuntimeError("boom")  # between micro-batches: the step's counts are dropped
    assert probe.take(1) is None
    got = []
    for step, micro in ((1, batches[:2]), (2, []), (3, batches[2:])):
        model.zero_grad(set_to_none=True)
        with probe.step(step) as around:
            for b in micro if around else []:
                with around(b):
                    model(**b).loss.backward()
        got.append(probe.take(step))
    assert got[1] is None and len(made) == 1
    for rec, micro in ((got[0], batches[:2]), (got[2], batches[2:])):
        want = _probe_step(model, micro, StepProbe(1, model, "classification", False, None))
        assert {k: v for k, v in rec.items() if k != "step"} == {k: v for k, v in want.items() if k != "step"}


def test_non_finite_rows_are_recorded_as_such():
    model = tiny_model("bert")
    batch = padded_batch("bert")
    layer = model.bert.encoder.layer[0].attention.self.query

    def poison(module, args, out):
        out.register_hook(lambda g: g * float("nan"))

    layer.register_forward_hook(poison)
    rec = _probe_step(model, [batch], StepProbe(1, model, "classification", False, None))
    name = "bert.encoder.layer.0.attention.self.query"
    assert rec["layers"][name]["nonfinite_rows"] == rec["layers"][name]["rows"] and "rows_90" not in rec["layers"][name]
    assert rec["nonfinite_rows"] >= rec["layers"][name]["rows"]
    assert series([rec])["nonfinite_steps"] == [1]


def _run_records(steps: int, every: int, probed_ms: float, other_ms: float, untimed: dict | None = None):
    """metrics.jsonl of a run: a train line per step (its step_ms jittered by 1%), a grad_stats line after
    each probed one; ``untimed``: step -> the loop's mark."""
    rng = np.random.default_rng(0)
    out = []
    for step in range(1, steps + 1):
        probed = (step - 1) % every == 0
        rec = {"type": "train", "step": step, "step_ms": (probed_ms if probed else other_ms) * rng.uniform(0.99, 1.01)}
        if step in (untimed or {}):
            rec["untimed"] = untimed[step]
        out.append(rec)
        if probed:
            out.append({"type": "grad_stats", "step": step})
    return out


def test_a_runs_probed_steps_are_timed_against_its_other_steps():
    """summary.json's grad_stats.cost: the timed probed steps' median against the other timed steps' (the first
    steps and the compiling ones left out, as from the run's own times), their ratio, and whether it is noise."""
    cost = probe_cost(_run_records(60, 4, 12.0, 10.0, untimed={9: "compile", 13: "new shape"}))
    # timed: past the first 6 steps; 9 (compiled) and 13 (a new shape) left out: probed 17, 21, ..., 57
    assert cost["probed_steps"] == 11 and cost["other_steps"] == 41
    assert cost["ratio"] == pytest.approx(1.2, rel=0.02) and not cost["within_noise"]
    assert cost["probed_iqr"][0] <= cost["probed_ms"] <= cost["probed_iqr"][1]
    same = probe_cost(_run_records(60, 4, 10.0, 10.0))
    assert same["within_noise"] and same["ratio"] == pytest.approx(1.0, abs=0.02)
    assert probe_cost(_run_records(60, 15, 12.0, 10.0)) is None  # 3 probed steps timed: too few to say


def test_the_final_table_says_what_the_probed_steps_cost(capsys):
    from sebp_probe.tables import print_finetune_summary

    cost = probe_cost(_run_records(60, 4, 12.0, 10.0))
    run = {"status": "completed", "method": "dense", "steps": 60, "grad_stats": {"every": 4, "cost": cost}}
    print_finetune_summary({"output_dir": "runs/p", "runs": {"dense": run}})
    text = " ".join(capsys.readouterr().out.split())
    assert "dense: probed steps (--probe-every 4) x1.20 the others' step time: medians probed 12.0 ms (IQR" in text
    assert "13 steps), other 10.0 ms (IQR 10.0-10.0, 41 steps); not the same batches" in text
    run["grad_stats"]["record_ms"] = 3.46
    print_finetune_summary({"output_dir": "runs/p", "runs": {"dense": run}})
    text = " ".join(capsys.readouterr().out.split())
    assert "41 steps); the record after each probed step 3.5 ms more (host, in neither); not the same" in text


def test_the_summary_holds_the_records_median_host_time():
    records = [{"type": "grad_stats", "step": s, "types": {}, **({"record_ms": ms} if ms else {})}
               for s, ms in ((1, 2.0), (3, 9.0), (5, 3.0), (7, None))]
    assert probe_summary(records, 2)["record_ms"] == 3.0  # the median of those that timed it
    assert "record_ms" not in probe_summary([{"type": "grad_stats", "step": 1, "types": {}}], 2)


def test_only_every_nth_step_is_probed():
    probe = StepProbe(10, tiny_model("bert"), "classification", False, None)
    assert [s for s in range(1, 32) if probe.due(s)] == [1, 11, 21, 31]
    assert not StepProbe(None, None, None, False, None).due(1)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_probe_every_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="--probe-every must be an integer >= 1"):
        FinetuneConfig(probe_every=bad)


def test_probe_every_refuses_cuda_graphs():
    with pytest.raises(ValueError, match="CUDA-graph replays"):
        FinetuneConfig(probe_every=5, cuda_graphs=True)
