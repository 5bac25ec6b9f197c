"""benchmarks/gpu_suite.py: every step names commands that exist, and every result it adds lands in a family
file and run that the docs read."""
from __future__ import annotations

import json
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
