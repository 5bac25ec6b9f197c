"""`sebp-probe finetune` end to end, offline: bundled tweets, a tiny local BERT (MiniLM's tokenizer) and the
bundled MiniLM; output files, output-dir refusal, bad input, non-finite loss, SIGTERM + --resume."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertConfig
from typer.testing import CliRunner

from sebp_probe.cli import app
from tests.convergence.finetune_helpers import isolated_accelerate  # noqa: F401

# The layout these runs were written for (the default is auto, which times layouts first: its own tests below).
FAST = ["--max-samples", "160", "--batch-size", "8", "--max-length", "32", "--eval-samples", "32",
        "--padding", "max_length"]


def _tiny_bert(path: Path, hidden: int = 32) -> str:
    from sebp_probe.data.assets import minilm_dir

    tok = AutoTokenizer.from_pretrained(minilm_dir())
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=40, max_position_embeddings=64, num_labels=3)
    AutoModelForSequenceClassification.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _tiny_bert(tmp_path_factory.mktemp("tiny") / "bert")


def _run(args):
    return CliRunner().invoke(app, ["finetune", *args])


def _error_line(result) -> str:
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert result.exit_code == 1, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def _train_records(path: Path) -> list[dict]:
    keep = ("type", "step", "epoch", "loss", "lr", "tokens", "eval_loss", "eval_accuracy")
    return [{k: r[k] for k in keep if k in r} for r in map(json.loads, path.read_text().splitlines())]


def assert_same_records(got: list[dict], want: list[dict]) -> None:
    """The same training records from two processes: steps, learning rates, tokens and accuracies equal, losses
    equal to 1e-6. On some CPUs (an AMD EPYC, 2026-11-23) the same run in another process now and then gave a
    loss 1e-7 apart (a step's loss in its last bits, one run in three or four), whatever the thread count;
    a resume that went wrong (other batches, other dropout masks, a lost optimizer state) moves them by far
    more."""
    assert [{k: v for k, v in r.items() if "loss" not in k} for r in got] == \
        [{k: v for k, v in r.items() if "loss" not in k} for r in want]
    for g, w in zip(got, want):
        for k in ("loss", "eval_loss"):
            if k in w:
                assert g[k] == pytest.approx(w[k], rel=1e-6, abs=0), (g, w)


def test_help_has_examples():
    r = _run(["--help"])
    assert r.exit_code == 0
    for word in ("Examples", "--auto-eps", "--compare", "--resume", "--lora", "accelerate launch"):
        assert word in r.output


@pytest.mark.slow
def test_compare_run_writes_outputs_and_guards_its_directory(tiny, tmp_path):
    out = tmp_path / "run"
    args = [tiny, "tweets", *FAST, "--max-steps", "6", "--compare", "--always-sebp", "--dense-fallback", "1",
            "-o", str(out)]
    r = _run([*args, "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert summary["status"] == "completed"
    assert summary["comparison"]["max_abs_loss_gap"] < 1e-5
    assert len(summary["runs"]["sebp"]["calibration"]["layers"]) == 12
    for name in ("run_config.json", "summary.json", "loss.png", "eval.png"):
        assert (out / name).stat().st_size > 0
    for method in ("dense", "sebp"):
        recs = _train_records(out / method / "metrics.jsonl")
        assert [x["step"] for x in recs if x["type"] == "train"] == [1, 2, 3, 4, 5, 6]
        assert recs[-1]["type"] == "eval" and 0 <= recs[-1]["eval_accuracy"] <= 1
        model = AutoModelForSequenceClassification.from_pretrained(out / method / "model")
        assert type(model.bert.encoder.layer[0].attention.self.query).__name__ == "Linear"
        assert (out / method / "checkpoints" / "step-000006").is_dir()

    before = (out / "summary.json").read_text()
    line = _error_line(_run(args))  # the directory holds a run: refused, nothing touched
    assert "holds another run" in line and "--resume" in line and "--overwrite" in line
    assert (out / "summary.json").read_text() == before
    line = _error_line(_run([*args, "--overwrite", "--max-steps", "0"]))  # bad input: the old run survives
    assert "max steps" in line and (out / "summary.json").read_text() == before
    r = _run([*args, "--resume"])  # a completed run: nothing to redo
    assert r.exit_code == 0 and "already completed" in r.output
    r = _run([tiny, "tweets", *FAST, "--max-steps", "3", "--method", "dense", "-o", str(out), "--overwrite"])
    assert r.exit_code == 0, r.output
    assert not (out / "sebp").exists() and (out / "metrics.jsonl").exists()


def _forced_sebp_compare(tiny, out, flag: str) -> dict:
    """The summary of a 4-step --compare run with SEBP on every layer (forced) and ``flag``."""
    r = _run([tiny, "tweets", *FAST, "--max-steps", "4", "--compare", "--always-sebp", "--dense-fallback", "1",
              flag, "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.mark.slow
def test_sebp_norms_compare_matches_dense_and_saves_plain_norms(tiny, tmp_path):
    out = tmp_path / "norms"
    summary = _forced_sebp_compare(tiny, out, "--sebp-norms")
    calib = summary["runs"]["sebp"]["calibration"]
    assert len(calib["layers"]) == 12 and len(calib["norms"]) == 5  # embeddings + 2 per layer
    assert summary["comparison"]["max_abs_loss_gap"] < 1e-5  # exact: the dense losses
    model = AutoModelForSequenceClassification.from_pretrained(out / "sebp" / "model")
    assert type(model.bert.encoder.layer[0].output.LayerNorm).__name__ == "LayerNorm"
    assert json.loads((out / "run_config.json").read_text())["config"]["sebp_norms"] is True


@pytest.mark.slow
def test_sebp_acts_compare_matches_dense(tiny, tmp_path):
    out = tmp_path / "acts"
    summary = _forced_sebp_compare(tiny, out, "--sebp-acts")
    calib = summary["runs"]["sebp"]["calibration"]
    assert calib["activations"] == ["bert.encoder.layer.0.intermediate", "bert.encoder.layer.1.intermediate"]
    assert calib["norms"] == []
    assert summary["comparison"]["max_abs_loss_gap"] < 1e-5  # exact: the dense losses
    assert json.loads((out / "run_config.json").read_text())["config"]["sebp_acts"] is True


def test_directory_of_other_files_is_never_cleared(tiny, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    for extra in ([], ["--overwrite"]):
        line = _error_line(_run([tiny, *FAST, "--max-steps", "2", "-o", str(tmp_path), *extra]))
        assert "notes.txt" in line
    assert (tmp_path / "notes.txt").read_text() == "mine" and len(list(tmp_path.iterdir())) == 1


@pytest.mark.parametrize("args,needle", [
    (["--eps", "-1"], "eps must be a finite number >= 0"),
    (["--eps", "nan"], "eps must be a finite number >= 0"),
    (["--top-n", "0"], "top-n (N) must be"),
    (["--top-n", "256"], "keeps every row"),
    (["--mode", "exact", "--eps", "0.001"], "exact mode"),
    (["--mode", "threshold"], "threshold mode needs"),
    (["--mode", "bogus"], "unknown SEBP mode"),
    (["--method", "dense", "--eps", "0.001"], "method dense uses no SEBP settings"),
    (["--lr", "0"], "learning rate"),
    (["--max-steps", "5", "--epochs", "1"], "not both"),
    (["--padding", "sideways"], "padding must be"),
    (["--bf16", "--fp16"], "exclude each other"),
    (["--resume"], "holds no sebp-probe finetune run"),
    (["--report", "missing.json"], "does not exist"),
    (["--targets", "nosuchlayer"], "matches no linear layer"),
    (["--auto-eps", "--report", "r.json"], "only one of them"),
    (["--auto-eps", "--top-n", "64"], "drop --top-n"),
    (["--report", "r.json", "--eps", "0.001", "--mode", "threshold"], "drop --eps"),
    (["--auto-eps", "--targets", "query"], "drop --targets"),
    (["--eps", "1e9"], "no row of any layer is active"),
    (["--cuda-graphs", "--graph-bucket", "0"], "graph bucket must be an integer >= 1"),
    (["--cuda-graphs", "--fp16"], "--cuda-graphs does not take --fp16"),
    (["--compile", "fast"], "unknown compile mode 'fast'"),
    (["--compile", "reduce-overhead", "--cuda-graphs"], "it records CUDA graphs itself"),
    (["--padding", "longest", "--compile", "auto"], "--compile auto chooses by timing, which --padding auto does"),
    (["--sebp-first"], "--sebp-first orders the two runs of --compare: add --compare"),
    (["--head", "middle"], "unknown head 'middle'; choose labelled, full or cce"),
])
def test_bad_input_is_one_line_and_writes_nothing(tiny, tmp_path, args, needle):
    out = tmp_path / "run"
    line = _error_line(_run([tiny, *FAST, "--max-steps", "2", "-o", str(out), *args]))
    assert needle in line
    assert not out.exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_cuda_graphs_without_a_gpu_is_refused(tiny, tmp_path):
    out = tmp_path / "run"
    line = _error_line(_run([tiny, *FAST, "--max-steps", "2", "-o", str(out), "--cuda-graphs"]))
    assert "--cuda-graphs needs a CUDA GPU" in line
    assert not out.exists()


def test_dataset_without_labels_is_refused(tiny, tmp_path):
    csv = tmp_path / "unlabeled.csv"
    csv.write_text("text,source\nhello there,a\nhow are you,b\n")
    line = _error_line(_run([tiny, str(csv), "--max-steps", "2", "-o", str(tmp_path / "run")]))
    assert "no label column" in line and "--label-column" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_report_for_another_model_is_refused(tiny, tmp_path):
    from sebp_probe.analysis.analyze import AnalyzeSettings, analyze_for_finetune
    from sebp_probe.data.assets import load_model
    from sebp_probe.config import DataConfig
    from sebp_probe.analysis.report import save_report

    other = load_model(_tiny_bert(tmp_path / "wide", hidden=48), num_labels=3)
    report = analyze_for_finetune(other, DataConfig(max_samples=16, batch_size=8, max_length=32),
                                  AnalyzeSettings(max_batches=2))
    save_report(report, tmp_path / "wide.json")
    line = _error_line(_run([tiny, *FAST, "--max-steps", "2", "--report", str(tmp_path / "wide.json"),
                             "-o", str(tmp_path / "run")]))
    assert "the report was made for" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_non_finite_loss_stops_with_a_clear_message(tiny, tmp_path):
    out = tmp_path / "run"
    line = _error_line(_run([tiny, *FAST, "--max-steps", "20", "--lr", "1e30", "--save-steps", "1",
                             "-o", str(out)]))
    assert "non-finite" in line and "last good checkpoint" in line
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "diverged" and Path(summary["checkpoint"]).is_dir()
    assert summary["checkpoint"] in line and not (out / "model").exists()


@pytest.mark.slow
def test_sigterm_checkpoints_and_resume_matches_uninterrupted(tmp_path):
    """Real MiniLM (dropout on) on tweets: SIGTERM from outside, then --resume == an uninterrupted run."""
    base = ["minilm", "tweets", *FAST, "--max-steps", "6", "--eval-steps", "4", "--save-steps", "100"]
    # The uninterrupted run here (one thread, as in the processes: tests/conftest.py); the one interrupted is a
    # process of its own, and so is the resume, in a fresh process as a user's would be.
    r = _run([*base, "-o", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    cmd = [sys.executable, "-m", "sebp_probe", "finetune", *base, "-o"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    out = tmp_path / "b"
    proc = subprocess.Popen([*cmd, str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    metrics, deadline = out / "metrics.jsonl", time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count('"train"') >= 2:
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 130, err
    assert "interrupted: checkpoint" in err and "--resume" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and 2 <= summary["steps"] < 6  # the resume crosses the eval at 4

    r = subprocess.run([*cmd, str(out), "--resume"], capture_output=True, text=True, env=env, timeout=480)
    assert r.returncode == 0, r.stderr
    assert_same_records(_train_records(out / "metrics.jsonl"), _train_records(tmp_path / "a" / "metrics.jsonl"))


def test_topk_report_from_other_batch_shapes_is_refused(tiny, tmp_path):
    from sebp_probe.analysis.analyze import AnalyzeSettings, analyze_for_finetune
    from sebp_probe.data.assets import load_model
    from sebp_probe.config import DataConfig
    from sebp_probe.analysis.report import save_report

    loaded = load_model(tiny, num_labels=3)
    report = analyze_for_finetune(loaded, DataConfig(max_samples=16, batch_size=4, max_length=32),
                                  AnalyzeSettings(max_batches=2))
    save_report(report, tmp_path / "r.json")
    line = _error_line(_run([tiny, *FAST, "--max-steps", "2", "--report", str(tmp_path / "r.json"),
                             "--mode", "topk", "-o", str(tmp_path / "run")]))
    assert "measured on batches of 4 x 32" in line and "8 x 32" in line
    assert not (tmp_path / "run").exists()


def test_settings_added_later_do_not_block_resuming_older_runs():
    from sebp_probe.train.rundir import config_changes as _config_changes

    old = {"lr": 1e-4, "data": {"max_length": 32}}  # written before sebp_norms existed
    assert _config_changes(old, {**old, "sebp_norms": False}) == []
    assert _config_changes(old, {**old, "sebp_norms": True}) == ["sebp_norms"]
    assert _config_changes(old, {**old, "sebp_acts": False}) == []
    assert _config_changes(old, {**old, "cuda_graphs": False}) == []


def test_peak_from_step3_is_summarised_and_compared():
    """On CUDA each train record carries its own step's peak beside the run's running maximum; the summary
    and the comparison add the peak from step 3 on (DDP may or may not still hold its first buckets at step
    2's peak, for dense and SEBP alike). Records without step peaks (CPU) give no such key."""
    from sebp_probe.train.metrics import compare_runs as _compare, summarize_records

    def recs(step_peaks):
        out, run = [], 0.0
        for i, p in enumerate(step_peaks, 1):
            run = max(run, p)
            out.append({"type": "train", "step": i, "loss": 1.0, "backward_ms": 1.0, "step_ms": 2.0,
                        "peak_mem_mb": run, "step_peak_mem_mb": p})
        return out

    d_recs, s_recs = recs([100.0, 150.0, 120.0, 121.0]), recs([100.0, 180.0, 110.0, 111.0])
    dense, sebp = summarize_records(d_recs), summarize_records(s_recs)
    assert dense["peak_mem_mb"] == 150.0 and dense["peak_mem_mb_from_step3"] == 121.0
    assert sebp["peak_mem_mb"] == 180.0 and sebp["peak_mem_mb_from_step3"] == 111.0
    cmp = _compare(dense, sebp, d_recs, s_recs)
    assert cmp["peak_mem_ratio"] == pytest.approx(1.2)
    assert cmp["peak_mem_ratio_from_step3"] == pytest.approx(111.0 / 121.0)
    cpu = [{k: v for k, v in r.items() if k != "step_peak_mem_mb"} for r in recs([5.0, 6.0, 7.0])]
    assert "peak_mem_mb_from_step3" not in summarize_records(cpu)
    assert "peak_mem_ratio_from_step3" not in _compare(summarize_records(cpu), summarize_records(cpu), cpu, cpu)


def test_processes_that_accelerate_does_not_join_are_refused(tiny, tmp_path, monkeypatch):
    """torchrun on CPU without ACCELERATE_USE_CPU=1 starts processes that accelerate runs as separate
    single-process trainings into one output directory: refused, nothing written."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "run"
    line = _error_line(_run([tiny, *FAST, "--max-steps", "2", "-o", str(out)]))
    assert "WORLD_SIZE=2" in line and "ACCELERATE_USE_CPU=1" in line
    assert not out.exists()


def test_head_option_reaches_the_run(tiny, tmp_path):
    for head in ("full", "labelled"):
        out = tmp_path / head
        result = _run([tiny, *FAST, "--max-steps", "2", "--method", "dense", "--head", head, "-o", str(out),
                       "--json"])
        assert result.exit_code == 0, result.output
        assert json.loads((out / "summary.json").read_text())["head"] == head
    out = tmp_path / "cce"  # a classifier has no LM head for Cut-Cross-Entropy: its own loss, and why
    result = _run([tiny, *FAST, "--max-steps", "2", "--method", "dense", "--head", "cce", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["head"] == "full" and "a classifier has no LM head" in summary["head_fallback_reason"]


@pytest.mark.slow
@pytest.mark.parametrize("order", [[], ["--sebp-first"]])
def test_compare_of_the_same_computation_reports_no_speedup(tiny, tmp_path, order):
    """Calibration leaves every layer dense (no layer's share of active rows is under --dense-fallback), so both
    runs of --compare compute dense: in either order the headline says so and prints no speedup, and the ratio
    it measured anyway (the timing's noise, first step and compiles left out) is stored, not shown as a gain."""
    out = tmp_path / "same"
    args = [tiny, "tweets", *FAST, "--max-steps", "12", "--compare", "--dense-fallback", "0.001", *order,
            "-o", str(out)]
    r = _run(args)
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())  # the console wraps long lines
    line = text[text.index("SEBP vs dense:"):text.index("bwd/step ms: medians")]
    assert "both runs computed the same thing: SEBP ran on 0 layers" in line and "no speedup" in line, line
    assert "step x" not in line.replace("measured step ratio x", "") and "backward x" not in line, line
    cmp = json.loads((out / "summary.json").read_text())["comparison"]
    assert cmp["verdict"] == "same computation" and cmp["max_abs_loss_gap"] == 0.0
    assert "speedup_step" not in cmp and cmp["timing"]["timed_steps"] == 11
    assert "left out as warm-up" in r.output
