"""benchmarks/trainer_bench.py on a tiny model on the CPU: the JSON it writes (device, versions, date, command,
steps/s per variant) and, since plain and SEBP train the same batches from the same start, the same losses."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.convergence.finetune_helpers import isolated_accelerate  # noqa: F401 (a fresh accelerate state per test)
from tests.helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    pytest.importorskip("trl")
    yield load_benchmark("trainer_bench")
    sys.modules.pop("trainer_bench", None)


@pytest.mark.slow
@pytest.mark.parametrize("isolated", [False, True])
def test_tiny_bench_writes_its_json(bench, tmp_path, isolated):
    """Every kind of variant in this process; plain and SEBP each in a process of their own (a subprocess per
    variant, the same losses across the processes)."""
    out = tmp_path / "trainer.json"
    variants = "plain,sebp" if isolated else "plain,sebp,liger+compile,sebp-cce"
    args = ["--out", str(out), "--tiny", "--steps", "2", "--warmup", "1", "--variants", variants]
    args += [] if isolated else ["--in-process"]
    assert bench.main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["device"] and doc["date"] and doc["versions"]["trl"]
    assert doc["command"] == "python benchmarks/trainer_bench.py " + " ".join(args)
    assert doc["case"]["name"] == "llama-3.2-1b-sft (tiny)" and doc["case"]["batch"] == 4
    plain, sebp, *rest = doc["results"]
    assert plain["steps_per_s"] > 0 and sebp["steps_per_s"] > 0 and len(plain["step_ms"]) == 2
    assert plain["step_graphs"] == sebp["step_graphs"] == [0, 0]  # eager: Dynamo compiled nothing in a step
    assert sebp["sebp"]["head"] == "labelled" and len(sebp["sebp"]["calibration"]["density"]) == 14
    assert doc["ratios"]["sebp/plain"] > 0
    assert len(plain["loss"]) == 3
    assert all(abs(a - b) <= 1e-4 * max(1.0, a) for a, b in zip(plain["loss"], sebp["loss"]))
    if isolated:
        assert not rest
        return
    liger, cce = rest
    assert liger["variant"] == "liger+compile" and liger["error"]  # no Liger here, and no compile on a CPU
    if cce.get("error") is None:  # with cut-cross-entropy installed (the bench extra): its head, the same losses
        assert cce["sebp"]["head"] == "cce"
        assert all(abs(a - b) <= 1e-4 * max(1.0, a) for a, b in zip(plain["loss"], cce["loss"]))


def test_gpu_suite_asks_only_for_variants_the_bench_knows(bench, tmp_path):
    """benchmarks/gpu_suite.py's trainer step: every variant it asks for is one the bench knows, and it merges the
    compiled variants, each timed in a process of its own, into one JSON."""
    from tests.helpers import load_benchmark

    suite = load_benchmark("gpu_suite")
    jobs = suite.STEPS["trainer"].jobs(tmp_path, "h100")
    asked = [job.argv[job.argv.index("--variants") + 1] for job in jobs if "--variants" in job.argv]
    variants = [v.removesuffix("-nocudnn") for group in asked for v in group.split(",")]
    assert {"plain", "sebp", "liger", "liger+sebp", "sebp+compile", "liger+compile"} <= set(variants)
    assert set(variants) <= set(bench.VARIANTS)
    assert "--merge" in jobs[-1].argv and jobs[-1].add == ("trainer.json", "compiled_h100")


def test_merge_puts_runs_side_by_side_and_refuses_what_does_not_compare(bench, tmp_path):
    """Variants timed in separate calls (each within a time limit) merge into one JSON, their ratios computed
    anew; runs of another case, or one variant twice, are refused in one line."""
    base = {"tool": "benchmarks/trainer_bench.py", "device": "GPU", "versions": {}, "case": {"name": "c"},
            "steps": 10, "warmup": 4, "rounds": 1, "ratios": {}}
    paths = []
    for i, (variant, speed) in enumerate([("liger+compile", 4.0), ("sebp+compile", 5.0)]):
        doc = {**base, "command": f"python benchmarks/trainer_bench.py {i}", "date": f"2026-01-0{i + 1}",
               "results": [{"variant": variant, "steps_per_s": speed}]}
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(doc))
    out = tmp_path / "merged.json"
    assert bench.main(["--out", str(out), "--merge", *map(str, paths)]) == 0
    doc = json.loads(out.read_text())
    assert [r["variant"] for r in doc["results"]] == ["liger+compile", "sebp+compile"]
    assert doc["ratios"] == {"sebp+compile/liger+compile": 1.25} and doc["paired"] == {}  # no step times
    assert doc["date"] == "2026-01-02" and len(doc["merged"]) == 2 and doc["command"].count("trainer_bench") == 2
    with pytest.raises(SystemExit, match="more than one"):
        bench.main(["--out", str(out), "--merge", str(paths[0]), str(paths[0])])
    other = json.loads(paths[1].read_text())
    other["case"] = {"name": "d"}
    paths[1].write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="differs .* in case"):
        bench.main(["--out", str(out), "--merge", *map(str, paths)])


def test_paired_ratios_compare_step_by_step_and_leave_out_compiling_steps(bench):
    """Each pair's median of per-step ratios over the steps in which neither variant compiled a graph; a pair
    whose step counts differ is not compared step by step."""
    results = [{"variant": "liger+compile-nocudnn", "step_ms": [100.0, 200.0, 300.0, 400.0, 50.0],
                "step_graphs": [0, 0, 1, 0, 0]},
               {"variant": "sebp+compile", "step_ms": [80.0, 250.0, 100.0, 50000.0, 40.0],
                "step_graphs": [0, 0, 0, 1, 0]},
               {"variant": "plain+compile", "step_ms": [1.0, 2.0]}]
    got = bench._paired(results)
    assert got == {"sebp+compile/liger+compile-nocudnn": {"ratio": 1.25, "steps": 3, "left_out": 2}}


def test_profile_needs_fewer_steps_than_the_warm_up(bench, tmp_path):
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path / "t.json"), "--tiny", "--warmup", "2", "--profile", "2"])
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path / "t.json"), "--tiny", "--variants", "plain-nocuda"])
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path / "t.json"), "--tiny", "--rounds", "0"])


@pytest.mark.slow
def test_rounds_pool_each_variants_steps_in_both_orders(bench, tmp_path, monkeypatch):
    order = []
    real = bench.run_variant
    monkeypatch.setattr(bench, "run_variant", lambda v, opts, tmp: order.append(v) or real(v, opts, tmp))
    out = tmp_path / "trainer.json"
    assert bench.main(["--out", str(out), "--tiny", "--steps", "2", "--warmup", "1", "--in-process",
                       "--rounds", "2", "--variants", "plain,sebp"]) == 0
    assert order == ["plain", "sebp", "sebp", "plain"]
    doc = json.loads(out.read_text())
    assert doc["rounds"] == 2
    for r in doc["results"]:
        assert len(r["step_ms"]) == 4 and len(r["round_steps_per_s"]) == 2 and len(r["loss"]) == 6
        assert abs(r["step_ms_median"] - sorted(r["step_ms"])[1:3][0] / 2 - sorted(r["step_ms"])[1:3][1] / 2) < 1e-9


@pytest.mark.slow
def test_a_profiled_variant_without_cudnn_attention(bench, tmp_path):
    """``--profile K`` writes the operator tables of the last K warm-up steps beside the JSON; a ``-nocudnn``
    variant runs as its base variant (on a CPU, sdpa has no cuDNN to leave out)."""
    out = tmp_path / "trainer.json"
    args = ["--out", str(out), "--tiny", "--steps", "2", "--warmup", "2", "--profile", "1", "--in-process",
            "--variants", "sebp-nocudnn"]
    before = torch.backends.cuda.cudnn_sdp_enabled()
    assert bench.main(args) == 0
    assert torch.backends.cuda.cudnn_sdp_enabled() == before  # the variants run after it get sdpa's own choice
    (r,) = json.loads(out.read_text())["results"]
    assert r["variant"] == "sebp-nocudnn" and r["sebp"]["head"] == "labelled" and r["step_ms_mean"] > 0
    table = (tmp_path / "trainer.json.sebp-nocudnn.prof.txt").read_text()
    assert table.startswith("1 steps from step 2") and "by device time" in table and "by host time" in table
