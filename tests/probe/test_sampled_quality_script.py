"""benchmarks/sampled_quality.py: `finetune` run folders of dense and sampled mode become one tidy file whose arms
name the budget (the variance budget where it is not VCAS's default, and a sampled dX), with the mean and sd over seeds."""
from __future__ import annotations

import json
import sys

import pytest

from tests.helpers import load_benchmark


@pytest.fixture
def script():
    yield load_benchmark("sampled_quality")
    sys.modules.pop("sampled_quality", None)


def _run(path, seed, acc, sampled=None):
    path.mkdir(parents=True)
    (path / "run_config.json").write_text(json.dumps({"config": {"seed": seed}, "created": "2026-12-07T00:00:00"}))
    (path / "summary.json").write_text(json.dumps({
        "method": "sebp" if sampled else "dense", "status": "finished", "steps": 3, "device": "cpu",
        "final_eval": {"eval_accuracy": acc, "eval_loss": 1 - acc}, "median_step_ms": 10.0,
        "median_backward_ms": 5.0, "sampled": sampled}))


def test_arms_name_the_budget_and_a_variance_budget_that_is_not_the_default(script, tmp_path):
    def sampled(budget, tau, skipped, sample_dx=False):
        return {"budget": budget, "variance_tau": tau, "skipped_of_nonzero": skipped, "skipped_of_rows": skipped,
                "rows": 10, "nonzero": 8, "kept": 4, "sample_dx": sample_dx}

    dirs = []
    for seed in (0, 1):
        _run(tmp_path / f"cmp{seed}" / "dense", seed, 0.7 + seed / 10)
        _run(tmp_path / f"cmp{seed}" / "sebp", seed, 0.7, sampled("auto", 0.1, 0.6))
        _run(tmp_path / f"def{seed}", seed, 0.75, sampled("auto", 0.025, 0.5))
        _run(tmp_path / f"fix{seed}", seed, 0.72, sampled(0.3, 0.025, 0.7))
        _run(tmp_path / f"dx{seed}", seed, 0.71, sampled(0.3, 0.025, 0.7, sample_dx=True))
        dirs += [tmp_path / f"cmp{seed}", tmp_path / f"def{seed}", tmp_path / f"fix{seed}", tmp_path / f"dx{seed}"]
    out = tmp_path / "out.json"
    assert script.main(["--out", str(out), "--command", "the runs", *map(str, dirs)]) == 0
    doc = json.loads(out.read_text())
    arms = {a["arm"]: a for a in doc["arms"]}
    assert list(arms) == ["dense", "sampled auto (tau 0.1)", "sampled auto", "sampled 0.3",
                          "sampled 0.3, dX sampled"]
    assert arms["dense"]["seeds"] == [0, 1] and arms["dense"]["eval_accuracy_mean"] == pytest.approx(0.75)
    assert arms["dense"]["eval_accuracy_sd"] == pytest.approx(0.0707, abs=1e-4)
    assert arms["sampled auto (tau 0.1)"]["skipped_of_nonzero_mean"] == pytest.approx(0.6)
    assert doc["environment"]["command"] == "the runs" and len(doc["rows"]) == 10


def test_an_arm_trained_again_from_one_seed_counts_once(script, tmp_path):
    sampled = {"budget": "auto", "variance_tau": 0.1, "skipped_of_nonzero": 0.6, "skipped_of_rows": 0.6,
               "rows": 10, "nonzero": 8, "kept": 4}
    dirs = []
    for name in ("a", "b"):
        _run(tmp_path / name / "dense", 0, 0.7 if name == "a" else 0.9)
        _run(tmp_path / name / "sebp", 0, 0.7, sampled)
        dirs.append(str(tmp_path / name))
    out = tmp_path / "out.json"
    assert script.main(["--out", str(out), "--command", "the runs", *dirs]) == 0
    dense = json.loads(out.read_text())["arms"][0]
    assert dense["arm"] == "dense" and dense["seeds"] == [0] and dense["eval_accuracy_mean"] == pytest.approx(0.7)


def test_one_arm_of_a_compare_folder_can_be_given_alone(script, tmp_path):
    _run(tmp_path / "cmp" / "dense", 0, 0.7)
    _run(tmp_path / "cmp" / "sebp", 0, 0.6, {"budget": 0.3, "skipped_of_nonzero": 0.7, "skipped_of_rows": 0.7,
                                            "rows": 10, "nonzero": 8, "kept": 3})
    (tmp_path / "cmp" / "run_config.json").write_text((tmp_path / "cmp" / "dense" / "run_config.json").read_text())
    for arm in ("dense", "sebp"):
        (tmp_path / "cmp" / arm / "run_config.json").unlink()  # as --compare writes it: the folder's own
    out = tmp_path / "out.json"
    assert script.main(["--out", str(out), "--command", "the runs", str(tmp_path / "cmp" / "dense")]) == 0
    arms = json.loads(out.read_text())["arms"]
    assert [a["arm"] for a in arms] == ["dense"] and arms[0]["eval_accuracy_mean"] == pytest.approx(0.7)
