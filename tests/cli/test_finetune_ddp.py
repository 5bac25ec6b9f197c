"""Data parallel through torchrun, on the CPU (2 processes, gloo; accelerate sees ACCELERATE_USE_CPU=1):
exact SEBP gives dense's losses, one process writes the files, and SIGTERM + --resume equals an
uninterrupted run. The same code runs NCCL DDP on GPUs (under accelerate launch on GPUs)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.cli.test_finetune_cli import _tiny_bert, _train_records, assert_same_records
from tests.helpers import run_torchrun

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]  # run apart from the xdist workers: tests/conftest.py

ARGS = ["tweets", "--max-samples", "400", "--batch-size", "8", "--max-length", "32", "--eval-samples", "32",
        "--padding", "max_length",
        "--always-sebp", "--dense-fallback", "1"]


def _env() -> dict:
    return {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}


def _finetune(*args, timeout: float = 300) -> str:
    """`sebp-probe finetune ARGS` in 2 processes; its stdout (a failure or hang fails the test naming the rank)."""
    return run_torchrun(["-m", "sebp_probe", "finetune", *args], timeout, env=_env())[0]


def _torchrun(*args):
    """The same started in the background (to be signalled)."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             "-m", "sebp_probe", "finetune", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _tiny_bert(tmp_path_factory.mktemp("tiny") / "bert")


STEPS = ["--max-steps", "16", "--eval-steps", "8"]  # shared by the --compare run and the interrupted one


@pytest.fixture(scope="module")
def compare_run(tiny, tmp_path_factory):
    """One --compare launch: its SEBP run is also the uninterrupted reference of the SIGTERM test."""
    out = tmp_path_factory.mktemp("compare") / "run"
    _finetune(tiny, *ARGS, *STEPS, "--compare", "--json", "-o", str(out))
    return out


def test_two_process_compare_exact_sebp_equals_dense(compare_run):
    summary = json.loads((compare_run / "summary.json").read_text())
    assert {s["num_processes"] for s in summary["runs"].values()} == {2}
    assert summary["comparison"]["max_abs_loss_gap"] < 1e-5
    steps = [r["step"] for r in _train_records(compare_run / "sebp" / "metrics.jsonl") if r["type"] == "train"]
    assert steps == list(range(1, 17))  # one writer, no duplicate lines
    names = {p.name for p in (compare_run / "sebp" / "checkpoints" / "step-000016").iterdir()}
    assert {"model.safetensors", "optimizer.bin", "random_states_0.pkl", "random_states_1.pkl",
            "trainer_state.json", "config.json"} <= names  # one state per process; loadable (config, tokenizer)
    assert not {n for n in names if n.startswith("random_states_")} - {"random_states_0.pkl", "random_states_1.pkl"}


@pytest.mark.parametrize("scope", ["layers", "model"])
def test_two_process_compiled_exact_sebp_equals_dense(tiny, tmp_path, scope):
    """--compile default under DDP: exact SEBP still gives dense's losses. ``layers`` (the default) compiles
    each layer inside DDP's wrapper, without a break; under ``model`` Dynamo does not trace DDP's own
    ``_inside_ddp_forward`` context, so DDP's forward splits there (2 breaks on this torch) and the model's
    forward compiles as its own graph. Both runs count the same breaks, the second compiling afresh (before,
    it reused the first run's frames and counted none)."""
    _finetune(tiny, *ARGS, "--max-steps", "4", "--compare", "--compile", "default", "--compile-scope", scope,
              "--json", "-o", str(tmp_path / "run"))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    sebp = summary["runs"]["sebp"]
    assert sebp["num_processes"] == 2 and len(sebp["calibration"]["layers"]) == 12
    dense = summary["runs"]["dense"]
    assert sebp["compile"]["scope"] == dense["compile"]["scope"] == {"layers": "layers", "model": "forward"}[scope]
    assert sebp["compile"]["graphs"] >= 1 and sebp["compile"]["graph_breaks"] == dense["compile"]["graph_breaks"] <= 2
    if scope == "layers":
        assert sebp["compile"]["graph_breaks"] == 0
    assert summary["comparison"]["max_abs_loss_gap"] < 1e-5


def test_two_process_sigterm_then_resume_equals_uninterrupted(tiny, compare_run, tmp_path):
    """Interrupted at step 3 or later, then resumed: the records of the uninterrupted SEBP run of ``compare_run``
    (--compare runs each arm as a plain run would, same seed and data)."""
    base = [tiny, *ARGS, *STEPS]
    p = _torchrun(*base, "-o", str(tmp_path / "b"))
    metrics, deadline = tmp_path / "b" / "metrics.jsonl", time.time() + 240
    while time.time() < deadline and p.poll() is None:
        if metrics.exists() and metrics.read_text().count('"train"') >= 3:
            p.send_signal(signal.SIGTERM)  # torchrun forwards it to both workers
            break
        time.sleep(0.02)
    p.communicate(timeout=300)
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and 3 <= summary["steps"] < 16
    _finetune(*base, "-o", str(tmp_path / "b"), "--resume")
    assert_same_records(_train_records(tmp_path / "b" / "metrics.jsonl"),
                        _train_records(compare_run / "sebp" / "metrics.jsonl"))


def test_two_process_auto_eps_shares_the_main_report(tiny, tmp_path):
    """The main process analyses and broadcasts its report (tests/probe/test_finetune_report_ddp.py checks
    that the others do not analyse); here the real gloo broadcast carries it and both processes train."""
    args = ["tweets", "--max-samples", "400", "--batch-size", "8", "--max-length", "32", "--eval-samples", "32",
            "--padding", "max_length"]
    _finetune(tiny, *args, "--auto-eps", "--max-steps", "3", "--json", "-o", str(tmp_path / "run"), timeout=600)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["layers"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    run = summary["runs"]["sebp"] if "runs" in summary else summary
    assert run["num_processes"] == 2 and run["steps"] == 3


def _tiny_llama(path) -> str:
    """A 2-layer Llama with the bundled MiniLM's vocabulary (the tweets tokenize without a download)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from sebp_probe.data.assets import minilm_dir

    tok = AutoTokenizer.from_pretrained(minilm_dir())
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=40, max_position_embeddings=128,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_two_process_causal_lm_labelled_head_through_the_forward_equals_the_models_loss(tmp_path):
    """A causal LM in two processes keeps ``--head labelled`` (its output layer on the labelled positions,
    through DDP's forward, ``logits_to_keep``): the losses and held-out loss of ``--head full``."""
    model = _tiny_llama(tmp_path / "llama")
    args = ["tweets", "--max-samples", "200", "--batch-size", "8", "--max-length", "48", "--eval-samples", "16",
            "--padding", "longest", "--max-steps", "4", "--always-sebp", "--dense-fallback", "1", "--json"]
    runs = {}
    for head in ("labelled", "full"):
        out = _finetune(model, *args, "--head", head, "-o", str(tmp_path / head))
        assert head != "labelled" or "through the model's own forward (logits_to_keep)" in out
        summary = json.loads((tmp_path / head / "summary.json").read_text())
        assert summary["head"] == head and summary["num_processes"] == 2
        runs[head] = ([r["loss"] for r in _train_records(tmp_path / head / "metrics.jsonl") if r["type"] == "train"],
                      summary["final_eval"]["eval_loss"])
    assert len(runs["labelled"][0]) == 4
    assert max(abs(a - b) for a, b in zip(runs["labelled"][0], runs["full"][0])) < 1e-5
    assert runs["labelled"][1] == pytest.approx(runs["full"][1], rel=1e-6)
