"""benchmarks/gpu_suite.py: every step names commands that exist, and every result it adds lands in a family
file and run that the docs read."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tests.helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def suite():
    return load_benchmark("gpu_suite")


def test_every_step_runs_existing_scripts_and_the_package_cli(suite, tmp_path):
    for name, step in suite.STEPS.items():
        jobs = step.jobs(tmp_path, "h100")
        assert jobs, name
        for job in jobs:
            scripts = [Path(a) for a in job.argv if a.endswith(".py") and "/" in a]
            assert all(p.exists() for p in scripts), (name, scripts)
            if "sebp_probe" in job.argv:
                assert job.argv[job.argv.index("sebp_probe") + 1] in ("bench", "finetune"), (name, job.argv)


def test_each_added_result_is_a_run_of_a_family_file(suite, tmp_path):
    added = {}
    for name, step in suite.STEPS.items():
        for job in step.jobs(tmp_path, "h200"):
            if job.add:
                assert job.out is not None and job.out.parent == tmp_path, (name, job.out)
                added.setdefault(job.add[0], set()).add(job.add[1])
    for family, runs in added.items():
        have = set(json.loads((ROOT / "results" / family).read_text())["runs"])
        # a rerun replaces the documented runs (the GPU's name aside); method.md's probe table reads every
        # probe_* run of grad_stats.json, and says the cost is not measured yet while there is none
        by_prefix = family == "grad_stats.json" and all(r.startswith("probe_") for r in runs)
        assert runs & have or by_prefix, (family, runs - have)
    reproduce = {r["reproduce"].split()[2] for f in (ROOT / "results").glob("*.json")
                 for r in json.loads(f.read_text())["runs"].values()
                 if r.get("reproduce", "").startswith("python benchmarks/gpu_suite.py")}
    assert reproduce <= set(suite.STEPS)


def test_dry_run_prints_and_an_unknown_step_fails(suite, tmp_path, capsys):
    assert suite.main(["model", "--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "=== model" in out and "bench mistral-1b-sft --scope model --graphs --norms --acts" in out
    assert not list(tmp_path.iterdir())  # nothing ran
    with pytest.raises(SystemExit):
        suite.main(["no-such-step"])
    assert "unknown step" in capsys.readouterr().err
    assert suite.main(["--list"]) == 0 and "compiled-longest" in capsys.readouterr().out


# ------------------------------------------------------------- the finetune steps' runs into their family rows

def _run(d: Path, losses, step_ms, backward_ms, untimed=None, evals=(), **summary) -> dict:
    """A fake `finetune` run folder's metrics.jsonl (one train record a step; ``untimed``: step -> why) and the
    summary fields the collection reads; the summary, returned, is written by the caller."""
    d.mkdir(parents=True, exist_ok=True)
    recs = [{"type": "train", "step": i + 1, "loss": loss, "step_ms": s, "backward_ms": b,
             **({"untimed": untimed[i + 1]} if untimed and i + 1 in untimed else {})}
            for i, (loss, s, b) in enumerate(zip(losses, step_ms, backward_ms))]
    recs += [{"type": "eval", "step": s, "eval_loss": e} for s, e in evals]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return {"status": "completed", "steps": len(losses), "num_processes": 2, "median_backward_ms": 50.0,
            "median_step_ms": 100.0, "peak_mem_mb": 2048.0, "final_eval": {"eval_loss": 0.5},
            "calibration": {"layers": {"a": 1, "b": 2}, "fallback_dense": ["c"]}, **summary}


def _config(d: Path, device: str = "NVIDIA H100 80GB HBM3") -> None:
    (d / "run_config.json").write_text(json.dumps({"device": device, "num_processes": 2, "created": "2026-12-01T00:00",
                                                   "versions": {"torch": "2.11.0", "transformers": "5.17.0"}}))


def _single(d: Path, *args, **kw) -> None:
    s = _run(d, *args, **kw)
    (d / "summary.json").write_text(json.dumps(s))
    _config(d)


def _pair(d: Path, dense: tuple, sebp: tuple, order: str = "dense-first", **kw) -> None:
    runs = {"dense": _run(d / "dense", *dense, **kw), "sebp": _run(d / "sebp", *sebp, **kw)}
    runs["dense"]["calibration"] = None
    step = {"dense_ms": 20.0, "dense_iqr": [19.0, 21.0], "other_ms": 16.0, "other_iqr": [15.0, 17.0], "ratio": 1.25}
    top = {"runs": runs, "order": ["sebp", "dense"] if order == "sebp-first" else ["dense", "sebp"],
           "comparison": {"verdict": "faster", "max_abs_loss_gap": 0.0, "timing": {
               "timed_steps": 5, "step": step, "backward": {**step, "ratio": 1.5}}}}
    (d / "summary.json").write_text(json.dumps(top))
    _config(d)


@pytest.fixture(scope="module")
def runs_mod():
    return load_benchmark("finetune_runs")


def _collect(runs_mod, step: str, folder: Path, family: str, run: str, block: str, tmp_path) -> tuple[dict, str]:
    """The step's collection of ``folder`` as run ``run`` of a copy of results/``family``, and the doc block
    made from it."""
    out = tmp_path / f"{step}.json"
    assert runs_mod.main(["collect", step, str(folder), "-o", str(out)]) == 0
    root = tmp_path / "root"
    (root / "results").mkdir(parents=True, exist_ok=True)
    (root / "results" / family).write_text((ROOT / "results" / family).read_text())
    docs = load_benchmark("make_docs", "tools/docs")
    docs.add_run(root, family, run, out)
    page = docs.Page(root, root / "docs" / "x.md")
    return json.loads(out.read_text()), docs.GENERATORS[block](page)


def test_fsdp_runs_become_the_one_against_two_rows(runs_mod, tmp_path):
    f = tmp_path / "fsdp"
    _single(f / "one", [2.0, 1.5, 1.25], [10, 10, 10], [5, 5, 5], method="dense", calibration=None)
    _pair(f / "fsdp", ([2.0, 1.5, 1.0], [9, 9, 9], [4, 4, 4]), ([2.0, 1.5, 1.0], [8, 8, 8], [3, 3, 3]))
    _pair(f / "lora-sebp", ([2.0, 1.0], [9, 9], [4, 4]), ([2.0, 1.0], [8, 8], [3, 3]))
    doc, text = _collect(runs_mod, "fsdp", f, "fsdp.json", "one_vs_two", "fsdp_h200", tmp_path)
    assert doc["command"] == "python benchmarks/gpu_suite.py fsdp" and doc["environment"]["date"]
    assert doc["two_gpus_vs_one"]["max_abs_loss_gap"] == 0.25  # step 3: 1.25 against 1.0
    sebp = doc["runs"]["fsdp"]["methods"]["sebp"]
    assert (sebp["sebp_layers"], sebp["dense_layers"], sebp["losses"]) == (2, 1, [2.0, 1.5, 1.0])
    assert "| FSDP2, 2 GPUs | sebp | 2 of 3 | 3 |" in text and "0.250 vs one GPU" in text


def test_fsdp_sft_pairs_resume_and_fsdp1_become_rows(runs_mod, tmp_path):
    f = tmp_path / "fsdp_sft"
    steps = 8
    for order in ("dense-first", "sebp-first"):  # dense 200 ms a step, SEBP 160: 1.25x; step 5 compiled
        _pair(f / f"pair_{order}", ([1.0] * steps, [200] * 4 + [9000] + [200] * 3, [100] * steps),
              ([1.0] * steps, [160] * steps, [80] * steps), order, untimed={5: "compile"})
    ref = [3.0, 2.5, 2.0, 1.5]
    _single(f / "resume_ref", ref, [1] * 4, [1] * 4, method="sebp")
    _single(f / "resume", [3.0, 2.5, 2.25, 1.5], [1] * 4, [1] * 4, method="sebp")
    (f / "resume.interrupted.json").write_text(json.dumps({"steps_logged": 3, "checkpoint_step": 2}))
    _single(f / "fsdp1", [1.0] * 2, [1] * 2, [1] * 2, method="sebp")
    doc, text = _collect(runs_mod, "fsdp-sft", f, "fsdp.json", "sft_compiled", "fsdp_sft_h100", tmp_path)
    both = doc["both_orders"]["two H100s"]
    assert both["step_ratio"] == 1.25 and both["backward_ratio"] == 1.25 and both["steps"] == 2 * 4  # 4, 6, 7, 8
    first = doc["pairs"]["h100_sebp-first"]["runs"]
    assert first["sebp"]["place"] == 1 and first["dense"]["step_ms"] == 200
    assert doc["resume"] == {"steps": 4, "resumed_from_step": 2, "max_abs_loss_gap_before_kill": 0.0,
                             "max_abs_loss_gap_after_resume": 0.25}
    assert doc["fsdp1"]["status"] == "completed"
    assert "two H100s: step 1.25x (1.25x-1.25x by order)" in text and "resumed from step 2" in text


def test_fsdp_det_runs_become_the_bit_equality_rows(runs_mod, tmp_path):
    f = tmp_path / "fsdp_det"
    evals = ((2, 1.0), (4, 0.9))
    _single(f / "ref", [3.0, 2.0, 1.0, 0.5], [1] * 4, [1] * 4, evals=evals)
    _single(f / "ref2", [3.0, 2.0, 1.0, 0.5], [1] * 4, [1] * 4, evals=evals)
    _single(f / "resume", [3.0, 2.0, 1.0, 0.75], [1] * 4, [1] * 4, evals=evals)
    (f / "resume.interrupted.json").write_text(json.dumps({"steps_logged": 3, "checkpoint_step": 2}))
    _single(f / "scope_layers", [1.0] * 3, [9000, 120, 130], [1] * 3, untimed={1: "compile"},
            compile={"graphs": 4, "graph_breaks": 0}, compile_s=9.0)
    doc, text = _collect(runs_mod, "fsdp-det", f, "fsdp.json", "deterministic", "fsdp_det_h200", tmp_path)
    assert doc["twice"]["bit_equal_steps"] == 4 and doc["twice"]["evals_equal"]
    assert (doc["resume"]["first_differing_step"], doc["resume"]["resumed_from_step"]) == (4, 2)
    assert doc["compile_layers_one_gpu"]["compiled_at_steps"] == {"1": 9.0}
    assert "| killed and resumed | 3 of 4 | 4 | 0.25 | yes |" in text and "evaluation at steps 2 and 4" in text


def test_compare_pairs_become_the_headline_rows(runs_mod, tmp_path):
    f = tmp_path / "compare"
    for order in ("dense-first", "sebp-first"):
        _pair(f / f"eager_{order}", ([1.0], [20], [10]), ([1.0], [16], [8]), order)
    doc, text = _collect(runs_mod, "compare", f, "finetune.json", "compare", "compare_h100", tmp_path)
    assert list(doc["pairs"]) == ["eager"] and doc["pairs"]["eager"]["orders"]["sebp-first"]["order"][0] == "sebp"
    row = "| longest, eager | dense-first | 2 of 3 | faster | 5 | 20.0 (19.0-21.0) | 16.0 (15.0-17.0) | 1.25x |"
    assert row in text
    with pytest.raises(SystemExit):
        runs_mod.collect_compare(tmp_path / "none")


def test_interrupt_stops_a_run_after_its_steps(runs_mod, tmp_path):
    """SIGTERM once the run's metrics hold the steps, and the checkpoint written on the way out recorded; a run
    that ends first is a failure."""
    writer = ("import json, pathlib, signal, sys, time\n"
              "def stop(*a):\n"
              "    (p / 'checkpoints' / 'step-000002').mkdir(parents=True); sys.exit(130)\n"
              "signal.signal(signal.SIGTERM, stop)\n"
              "p = pathlib.Path(sys.argv[1]); p.mkdir(parents=True, exist_ok=True)\n"
              "for i in range(int(sys.argv[2])):\n"
              "    with open(p / 'metrics.jsonl', 'a') as f:\n"
              "        f.write(json.dumps({'type': 'train', 'step': i + 1}) + '\\n')\n"
              "    time.sleep(0.05)\n")
    run = tmp_path / "run"
    assert runs_mod.interrupt(run, 3, [sys.executable, "-c", writer, str(run), "1000"], poll_s=0.05) == 0
    assert 3 <= len(runs_mod.train_records(run)) < 1000 and runs_mod.resumed_from(run) == 2
    assert runs_mod.interrupt(tmp_path / "b", 5, [sys.executable, "-c", writer, str(tmp_path / "b"), "2"],
                              poll_s=0.05) == 1
