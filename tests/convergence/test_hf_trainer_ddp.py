"""apply_sebp(trainer) under two processes (torchrun, CPU, gloo: the trainers run accelerate's DDP), through the
real Trainer (tiny BERT classifier) and SFTTrainer (tiny Llama, completion-only loss): every process takes the
main process's calibrated layers, and the logged losses and gradient norms equal a plain trainer's under the same
launch (exact SEBP); add_grad_stats logs the statistics of both processes' rows together. The work runs in
trainer_ddp_worker.py; one launch serves all three tests."""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from tests.convergence.test_hf_trainer import LOSS_REL
from tests.helpers import run_torchrun

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]  # run apart from the xdist workers: tests/conftest.py
ROOT = Path(__file__).resolve().parents[2]
KINDS = ["trainer"] + (["sft"] if importlib.util.find_spec("trl") else [])
STATS = "grad_stats"  # add_grad_stats in the same launch


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("trainer_ddp")
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    run_torchrun([str(Path(__file__).with_name("trainer_ddp_worker.py")), str(out), *KINDS, STATS], 600, env=env,
                 cwd=ROOT)
    lines = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in lines] == [0, 1], "a process wrote no result"
    return lines


def _check(ranks: list[dict], kind: str) -> None:
    main, other = (r[kind]["sebp"] for r in ranks)
    assert main["processes"] == 2
    # the labelled-rows head calls the backbone past DDP's forward: the model's own loss, with SEBP layers
    assert main["head"] == other["head"] == "full" and "one process" in main["reason"]
    assert main["layers"] and main["swapped"] and other["swapped"]
    assert all(d > 0.0 for d in other["density"].values())  # on its own, the other process kept nothing
    assert other["layers"] == main["layers"], f"rank 1 runs {other['layers']}, rank 0 {main['layers']}"
    for rank in ranks:
        plain, ours = rank[kind]["plain"], rank[kind]["sebp"]
        for key in ("loss", "grad_norm"):
            assert len(ours[key]) == len(plain[key]) == 3
            for i, (a, b) in enumerate(zip(plain[key], ours[key])):
                assert abs(a - b) <= LOSS_REL * max(1.0, abs(a)), \
                    f"rank {rank['rank']} {key} step {i}: plain {a:.6f} vs sebp {b:.6f}"


def test_two_process_trainer_takes_the_main_layers_and_plain_losses(ranks):
    _check(ranks, "trainer")


def test_two_process_sft_trainer_takes_the_main_layers_and_plain_losses(ranks):
    if "sft" not in KINDS:
        pytest.skip("trl is not installed")
    _check(ranks, "sft")


def test_two_process_grad_stats_log_the_rows_of_both_processes(ranks):
    """add_grad_stats under DDP: the record each process makes of a probed step, and what the main process's
    trainer logs of it, are those of the two processes' counts summed (the processes saw different rows)."""
    import numpy as np

    from sebp_probe.analysis.through_training import StepCounts, step_record
    from sebp_probe.integrations.grad_stats import log_values

    main, other = (r[STATS] for r in ranks)
    assert main["processes"] == 2 and main["names"] == other["names"]
    assert [r["step"] for r in main["records"]] == [1, 3] and len(main["own"]) == len(other["own"]) == 2
    assert [h["step"] for h in main["logged"]] == [1, 3]
    roundtrip = lambda x: json.loads(json.dumps(x))  # noqa: E731 - as the worker wrote them
    for rec, logged, mine, theirs, its in zip(main["records"], main["logged"], main["own"], other["own"],
                                              other["records"]):
        a, b = np.asarray(mine), np.asarray(theirs)
        assert not np.array_equal(a, b)  # different data on each process
        both = step_record(StepCounts.unpack(main["names"], a + b), rec["step"])
        alone = step_record(StepCounts.unpack(main["names"], a), rec["step"])
        assert rec.pop("record_ms") > 0 and its.pop("record_ms") > 0  # each process's own host time
        assert rec == its == roundtrip(both) != roundtrip(alone)
        for t, e in rec["types"].items():  # the rows of a layer type: the sum of both processes' rows
            assert e["rows"] == alone["types"][t]["rows"] + step_record(
                StepCounts.unpack(main["names"], b), rec["step"])["types"][t]["rows"]
        want = log_values(both)
        assert want and set(logged) - {"step", "grad_stats/record_ms"} == set(want)
        assert all(logged[k] == pytest.approx(v, rel=1e-9) for k, v in want.items())
