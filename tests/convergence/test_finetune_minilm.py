"""finetune() on the real all-MiniLM-L6-v2 and real tweets (offline, bundled): exact SEBP gives dense's
losses; --auto-eps runs the analysis, saves its report and patches what the report says."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from sebp_probe.train import finetune as ft
from sebp_probe.config import DataConfig, FinetuneConfig
from sebp_probe.analysis.report import layer_configs_from_report, load_report
from tests.convergence.finetune_helpers import isolated_accelerate  # noqa: F401

pytestmark = pytest.mark.slow

DATA = DataConfig(max_length=64, batch_size=8, max_samples=200)


def _losses(path):
    return [r["loss"] for r in map(json.loads, open(path)) if r["type"] == "train"]


def test_minilm_exact_sebp_reproduces_dense(tmp_path):
    cfg = FinetuneConfig(data=DATA, output_dir=str(tmp_path), compare=True, max_steps=5, lr=1e-4,
                         eval_samples=32, fallback_if_slower=False)
    s = ft.finetune(cfg)
    cal = s["runs"]["sebp"]["calibration"]
    # tweets are short: real padding. The labelled head runs the last layer's query, attention output and MLP on
    # the [CLS] rows alone, every one of them active: those 4 of the 36 linears stay dense.
    last = [n for n in cal["density"] if n.startswith("bert.encoder.layer.5.") and not n.endswith(("key", "value"))]
    assert len(cal["layers"]) == 32 and set(cal["fallback_dense"]) == set(last) and len(last) == 4
    assert max(d for n, d in cal["density"].items() if n not in last) < 0.8
    d, e = _losses(tmp_path / "dense" / "metrics.jsonl"), _losses(tmp_path / "sebp" / "metrics.jsonl")
    assert len(d) == 5 and max(abs(a - b) for a, b in zip(d, e)) < 1e-4
    assert s["runs"]["sebp"]["final_eval"]["eval_accuracy"] == pytest.approx(
        s["runs"]["dense"]["final_eval"]["eval_accuracy"], abs=1e-9)


def test_minilm_auto_eps_patches_the_reports_settings(tmp_path):
    # 64 tweets: the analysis reads 8 batches of 8 (200 tweets gave it its default maximum, 16)
    cfg = FinetuneConfig(data=replace(DATA, max_samples=64), output_dir=str(tmp_path), auto_eps=True, max_steps=3,
                         eval_samples=32, fallback_if_slower=False)
    s = ft.finetune(cfg)
    report = load_report(tmp_path / "report.json")
    assert report["model"]["name"] == "minilm"
    want = {n: c.to_dict() for n, c in layer_configs_from_report(report, None).items()}
    got = s["calibration"]["layers"]
    assert got and set(got) <= set(want)
    assert all(got[n] == want[n] for n in got)
    assert set(got) | set(s["calibration"]["fallback_dense"]) == set(want)
    assert s["status"] == "completed" and 0 <= s["final_eval"]["eval_accuracy"] <= 1
