"""How `finetune --compare` times its runs (issue: a --compare pair that computed the same thing printed x4.98):
warm-up and compile steps apart, medians with their interquartile range over the steps timed in both runs, no
speedup where the runs computed the same thing or the difference is within noise."""
from __future__ import annotations

import pytest

from sebp_probe.train.metrics import MIN_TIMED_STEPS, compare_runs, summarize_records, timed_steps
from sebp_probe.tables import comparison_line


def _records(step_ms: list[float], untimed: dict[int, str] | None = None, bwd_share: float = 0.5) -> list[dict]:
    out = []
    for i, ms in enumerate(step_ms, 1):
        r = {"type": "train", "step": i, "loss": 1.0, "step_ms": ms, "backward_ms": ms * bwd_share,
             "peak_mem_mb": 10.0}
        if untimed and i in untimed:
            r["untimed"] = untimed[i]
        out.append(r)
    return out


def _summary(recs, method="dense", calibration=None):
    return {"method": method, "status": "completed", "calibration": calibration, **summarize_records(recs)}


SEBP_ON_LAYERS = {"layers": {"l0": {"mode": "exact"}}, "norms": [], "activations": []}


def test_first_and_marked_steps_are_left_out_and_reported_apart():
    recs = _records([900.0, 500.0] + [100.0] * 18, untimed={2: "compile", 7: "new shape"})
    s = summarize_records(recs)
    assert sorted(timed_steps(recs)) == [3, 4, 5, 6] + list(range(8, 21))  # first 2 of 20 steps, and the marked
    assert s["timed_steps"] == 17 and s["untimed_steps"] == 3
    assert s["median_step_ms"] == 100.0 and s["iqr_step_ms"] == [100.0, 100.0]
    assert s["untimed_s"] == pytest.approx((900 + 500 + 100) / 1e3)
    assert s["compile_steps"] == 1 and s["compile_s"] == pytest.approx(0.5)
    assert "mean_step_ms" not in s  # a mean carries the warm-up tail: never a headline


def test_a_step_left_out_of_one_run_is_left_out_of_the_other():
    """Dense ran first and paid a new shape's first run at steps 5 and 9; the second run found them warm. Paired
    by step, the same batches are compared, so the first run's cold steps cost it nothing."""
    n = 30
    dense = [100.0 + (i % 3) for i in range(n)]
    dense[4], dense[8] = 400.0, 300.0
    other = [100.0 + (i % 3) for i in range(n)]
    d_recs = _records(dense, untimed={5: "new shape", 9: "new shape"})
    o_recs = _records(other)
    cmp = compare_runs(_summary(d_recs), _summary(o_recs, "sebp", SEBP_ON_LAYERS), d_recs, o_recs)
    assert cmp["timing"]["timed_steps"] == n - 3 - 2
    assert cmp["timing"]["step"]["ratio"] == pytest.approx(1.0)
    assert cmp["verdict"] == "within noise" and "speedup_step" not in cmp
    line = comparison_line(cmp, {"dense": {}, "sebp": {}})
    assert line.startswith("within noise") and "step x" not in line


def test_same_computation_prints_no_speedup_in_either_order():
    """SEBP on 0 layers: both runs compute dense. Whatever the clocks say (here the first run is twice as slow),
    the verdict is 'same computation' and the ratio is shown as the timing's noise, not as a speedup."""
    calib = {"layers": {}, "norms": [], "activations": [], "fallback_reason": None}
    slow, fast = _records([200.0] * 20), _records([100.0] * 20)
    for d_recs, o_recs in ((slow, fast), (fast, slow)):
        cmp = compare_runs(_summary(d_recs), _summary(o_recs, "sebp", calib), d_recs, o_recs)
        assert cmp["verdict"] == "same computation" and "SEBP ran on 0 layers" in cmp["same_computation"]
        assert "speedup_step" not in cmp and "speedup_backward" not in cmp
        line = comparison_line(cmp, {"dense": {}, "sebp": {}})
        assert "computed the same thing" in line and "no speedup" in line and "step x" not in line


def test_a_real_difference_is_reported_with_its_spread():
    d_recs = _records([129.0 + (i % 5) for i in range(40)])
    o_recs = _records([99.0 + (i % 5) for i in range(40)])
    cmp = compare_runs(_summary(d_recs), _summary(o_recs, "sebp", SEBP_ON_LAYERS), d_recs, o_recs)
    assert cmp["verdict"] == "faster"
    assert cmp["speedup_step"] == pytest.approx(131.0 / 101.0)
    assert cmp["timing"]["step"]["dense_iqr"] == [130.0, 132.0]
    line = comparison_line(cmp, {"dense": {}, "sebp": {}})
    assert line.startswith("step x1.30") and "dense 131.0 ms (IQR 130.0-132.0)" in line and "SEBP 101.0 ms" in line
    cmp = compare_runs(_summary(o_recs), _summary(d_recs, "sebp", SEBP_ON_LAYERS), o_recs, d_recs)
    assert cmp["verdict"] == "slower" and cmp["speedup_step"] == pytest.approx(101.0 / 131.0)


def test_too_few_steps_timed_in_both_runs_give_no_ratio():
    d_recs = _records([100.0] * (MIN_TIMED_STEPS + 1), untimed={3: "new shape"})
    o_recs = _records([50.0] * (MIN_TIMED_STEPS + 1))
    cmp = compare_runs(_summary(d_recs), _summary(o_recs, "sebp", SEBP_ON_LAYERS), d_recs, o_recs)
    assert cmp["timing"]["timed_steps"] == MIN_TIMED_STEPS - 1
    assert cmp["verdict"] == "too few steps" and "speedup_step" not in cmp
    assert "too few to compare" in comparison_line(cmp, {"dense": {}, "sebp": {}})


def test_runs_on_different_layouts_compare_their_own_timed_steps():
    """--padding auto with --compare may train dense and SEBP on different layouts: steps then hold different
    batches, and each run's own timed steps give its median."""
    d_recs = _records([100.0] * 20, untimed={5: "new shape"})
    o_recs = _records([50.0] * 20)
    cmp = compare_runs(_summary(d_recs), _summary(o_recs, "sebp", SEBP_ON_LAYERS), d_recs, o_recs, paired=False)
    assert cmp["timing"]["paired"] is False and cmp["timing"]["timed_steps"] == 17
    assert cmp["verdict"] == "faster" and cmp["speedup_step"] == pytest.approx(2.0)
    assert "over each run's" in comparison_line(cmp, {"dense": {}, "sebp": {}})


def test_where_nearly_every_batch_is_a_new_shape_those_steps_are_timed_and_the_line_says_so():
    """``longest`` padding of varied lengths (SFT data): nearly every batch a shape the GPU has not run. Left out,
    nothing would be timed (the verdict was "too few steps" on every SFT run); a first shape's cost recurs in
    every step of such a run, so those steps count, compiles still do not, and the headline says so."""
    n = 3 * MIN_TIMED_STEPS
    shapes = {s: "new shape" for s in range(2, n + 1)} | {2: "compile"}
    d_recs, o_recs = _records([100.0] * n, untimed=shapes), _records([90.0] * n, untimed=shapes)
    cmp = compare_runs(_summary(d_recs), _summary(o_recs, "sebp", SEBP_ON_LAYERS), d_recs, o_recs)
    assert cmp["timing"]["first_shapes_timed"] is True and cmp["timing"]["timed_steps"] == n - 2
    assert cmp["verdict"] == "faster" and cmp["speedup_step"] == pytest.approx(100 / 90)
    assert cmp["timing"]["new_shape_steps"] == n - 2
    line = comparison_line(cmp, {"dense": {}, "sebp": {}})
    assert line.startswith("step x1.11") and "a batch shape's first step included" in line
    s = summarize_records(d_recs)
    assert s["timed_steps"] == n - 2 and s["first_shape_steps_timed"] == n - 2 and s["median_step_ms"] == 100.0
    assert sorted(timed_steps(d_recs, first_shapes=False)) == []  # the rule alone leaves them out


def test_a_few_new_shapes_among_settled_ones_stay_out_and_a_short_run_asks_for_more_steps():
    recs = _records([100.0] * 20, untimed={s: "new shape" for s in (4, 6, 8)})
    assert sorted(timed_steps(recs)) == [3, 5, 7] + list(range(9, 21))
    assert summarize_records(recs)["first_shape_steps_timed"] == 0
    short = _records([100.0] * 4, untimed={s: "new shape" for s in (2, 3, 4)})  # 3 steps past warm-up: too few
    cmp = compare_runs(_summary(short), _summary(short, "sebp", SEBP_ON_LAYERS), short, short)
    assert cmp["verdict"] == "too few steps" and cmp["timing"]["first_shapes_timed"] is False
    assert "train more --max-steps" in comparison_line(cmp, {"dense": {}, "sebp": {}})


def test_paired_runs_on_batches_of_varied_size_are_judged_by_each_steps_own_ratio():
    """The same batches in both runs, their sizes spread the step times 100-400 ms: the runs' ranges overlap
    whatever the methods do, so a pair is judged by each step's own ratio; 10% faster on every step is faster,
    and a pair faster on half its steps and slower on the other half is within noise."""
    sizes = [100.0 + 300.0 * ((7 * i) % 20) / 19 for i in range(30)]
    d_recs, o_recs = _records(sizes), _records([t / 1.1 for t in sizes])
    cmp = compare_runs(_summary(d_recs), _summary(o_recs, "sebp", SEBP_ON_LAYERS), d_recs, o_recs)
    t = cmp["timing"]["step"]
    assert t["dense_iqr"][0] <= t["other_ms"] <= t["dense_iqr"][1]  # the medians alone would say "within noise"
    assert cmp["verdict"] == "faster" and cmp["speedup_step"] == pytest.approx(1.1)
    assert t["ratio_iqr"] == pytest.approx([1.1, 1.1])
    assert "the steps' own ratios IQR 1.10-1.10" in comparison_line(cmp, {"dense": {}, "sebp": {}})
    mixed = _records([t / (1.2 if i % 2 else 0.85) for i, t in enumerate(sizes)])
    cmp = compare_runs(_summary(d_recs), _summary(mixed, "sebp", SEBP_ON_LAYERS), d_recs, mixed)
    assert cmp["verdict"] == "within noise" and "speedup_step" not in cmp
    unpaired = compare_runs(_summary(d_recs), _summary(o_recs, "sebp", SEBP_ON_LAYERS), d_recs, o_recs, paired=False)
    assert "ratio_iqr" not in unpaired["timing"]["step"] and unpaired["verdict"] == "within noise"
