"""`finetune --mode sampled`: bad budgets in one line, a run that samples and says so (approximate, the measured
share of rows skipped), the same command reproducing its bits, and a resume continuing the draws."""
from __future__ import annotations

import json
import shutil

import pytest

from sebp_probe.config import DataConfig, FinetuneConfig
from tests.cli.test_finetune_cli import FAST, _error_line, _run, _train_records, tiny  # noqa: F401

SAMPLED = ["--mode", "sampled", "--budget", "0.3", "--sample-warmup", "1"]


@pytest.mark.parametrize("args,needle", [
    (["--mode", "sampled", "--budget", "0"], "--budget must be a share in (0, 1]"),
    (["--mode", "sampled", "--budget", "1.5"], "--budget must be a share in (0, 1]"),
    (["--mode", "sampled", "--budget", "-0.2"], "--budget must be a share in (0, 1]"),
    (["--mode", "sampled", "--budget", "nan"], "--budget must be a share in (0, 1]"),
    (["--mode", "sampled", "--budget", "half"], "--budget must be a share in (0, 1] or auto, got 'half'"),
    (["--mode", "sampled", "--guard-every", "0"], "--guard-every must be an integer >= 1"),
    (["--mode", "exact", "--budget", "0.3"], "belong to --mode sampled"),
    (["--mode", "sampled", "--budget", "0.3", "--top-n", "8"], "takes --budget, not --top-n"),
    (["--mode", "sampled", "--budget", "0.3", "--sample-warmup", "-1"], "sample warm-up steps must be"),
    (["--method", "dense", "--budget", "0.3"], "method dense uses no SEBP settings"),
    (["--mode", "sampled", "--variance-tau", "0"], "--variance-tau must be a number > 0"),
    (["--mode", "sampled", "--budget", "0.3", "--variance-tau", "0.1"], "a fixed --budget share does not use it"),
])
def test_bad_budget_is_one_line_and_writes_nothing(tiny, tmp_path, args, needle):
    out = tmp_path / "run"
    line = _error_line(_run([tiny, *FAST, "--max-steps", "2", "-o", str(out), *args]))
    assert needle in line
    assert not out.exists()


def test_budget_alone_means_sampled_and_reaches_the_layers():
    cfg = FinetuneConfig(data=DataConfig(), budget=0.4, sample_warmup=3, grad_accum=2, seed=7)
    assert cfg.sebp_mode == "sampled"
    s = cfg.sebp_config()
    assert (s.mode, s.budget, s.warmup, s.seed, s.sample_dx) == ("sampled", 0.4, 6, 7, False)


def test_variance_tau_reaches_the_layers_and_belongs_to_sampled_mode():
    cfg = FinetuneConfig(data=DataConfig(), mode="sampled", variance_tau=0.1)
    assert (cfg.sebp_config().budget, cfg.sebp_config().variance_tau) == ("auto", 0.1)
    assert FinetuneConfig(data=DataConfig(), mode="sampled").sebp_config().variance_tau == 0.025  # VCAS's
    for bad in ({"mode": "exact"}, {}):
        with pytest.raises(ValueError, match="belong to --mode sampled"):
            FinetuneConfig(data=DataConfig(), variance_tau=0.1, **bad)
    for bad in (float("nan"), float("inf"), -1.0, True):
        with pytest.raises(ValueError, match="--variance-tau must be a number > 0"):
            FinetuneConfig(data=DataConfig(), mode="sampled", variance_tau=bad)


def test_sampled_mode_defaults_to_budget_auto():
    for cfg in (FinetuneConfig(data=DataConfig(), mode="sampled"), FinetuneConfig(data=DataConfig(), budget="auto")):
        assert cfg.sebp_mode == "sampled" and cfg.sebp_config().budget == "auto"
    assert FinetuneConfig(data=DataConfig()).sebp_mode == "exact"  # exact stays the default


@pytest.mark.slow
def test_guard_logs_cosine_one_at_budget_one_and_summarises(tiny, tmp_path):
    args = [tiny, *FAST, "--max-steps", "5", "--mode", "sampled", "--budget", "1", "--sample-warmup", "1",
            "--guard-every", "2", "-o", str(tmp_path / "g")]
    r = _run(args)
    assert r.exit_code == 0, r.output
    recs = [json.loads(x) for x in (tmp_path / "g" / "metrics.jsonl").read_text().splitlines()]
    checks = [x for x in recs if x["type"] == "sample_guard"]
    assert [c["step"] for c in checks] == [2, 4] and all(len(c["layers"]) == 12 for c in checks)
    for c in checks:
        for v in c["layers"].values():
            assert v["cosine"] == pytest.approx(1.0, abs=1e-6) and v["rel_error"] == 0.0 and v["kept_share"] == 1
    g = json.loads((tmp_path / "g" / "summary.json").read_text())["sampled"]["guard"]
    assert g["checks"] == 2 and g["raised"] == {} and g["median_rel_error"] == 0.0
    assert "guard: 2 checks, cosine to the exact dW min 1.000" in " ".join(r.output.split())


@pytest.mark.slow
def test_sampled_run_reports_rows_skipped_reproduces_and_resumes(tiny, tmp_path):
    args = [tiny, *FAST, "--max-steps", "6", "--save-steps", "3", *SAMPLED]
    r = _run([*args, "-o", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    assert "approximate (sampled mode, experimental; budget 0.3)" in r.output
    s = json.loads((tmp_path / "a" / "summary.json").read_text())["sampled"]
    assert s["layers"] == 12 and s["approximate"] and s["rows"] > 0
    assert 0.6 < s["skipped_of_nonzero"] < 0.8, s  # budget 0.3 of the non-zero rows kept, measured

    r = _run([*args, "-o", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    want = _train_records(tmp_path / "a" / "metrics.jsonl")
    assert _train_records(tmp_path / "b" / "metrics.jsonl") == want  # same seed, same bits

    # as if stopped after step 3's checkpoint: resume from it and continue the same draws
    run = tmp_path / "b"
    ckpts = sorted((run / "checkpoints").iterdir())
    state = json.loads((ckpts[0] / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["sampler"][0], state.keys()
    assert all(v["calls"] == 3 and v["tau"] > 0 for v in state["sampler"][0].values())
    for p in ckpts[1:] + [run / "model"]:
        shutil.rmtree(p)
    (run / "summary.json").unlink()
    r = _run([*args, "-o", str(run), "--resume"])
    assert r.exit_code == 0, r.output
    assert _train_records(run / "metrics.jsonl") == want
    assert json.loads((run / "summary.json").read_text())["sampled"] == \
        json.loads((tmp_path / "a" / "summary.json").read_text())["sampled"]
