"""benchmarks/step_trace.py: the profile of a command's optimizer steps, hooked in from outside the command."""
from __future__ import annotations

import sys

import pytest

from tests.helpers import load_benchmark


@pytest.fixture(scope="module")
def script():
    yield load_benchmark("step_trace")
    sys.modules.pop("step_trace", None)


def test_busy_intervals_and_the_part_of_one_set_the_other_leaves_uncovered(script):
    comp = script._merged([(0, 4), (2, 6), (10, 12)])
    assert comp == [(0, 6), (10, 12)] and script._length(comp) == 8
    comm = script._merged([(5, 11), (13, 14)])
    assert script._uncovered(comm, comp) == 4 + 1  # 6..10 and 13..14
    assert script._uncovered(comp, []) == 8 and script._uncovered([], comp) == 0


def test_a_script_runs_under_it_and_each_run_gets_its_profile(script, tmp_path, monkeypatch):
    train = tmp_path / "train.py"
    train.write_text("import torch\n"
                     "for run in range(2):\n"
                     "    m = torch.nn.Linear(8, 8); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                     "    for _ in range(6):\n"
                     "        m(torch.randn(4, 8)).sum().backward(); o.step(); o.zero_grad()\n")
    from torch.optim.optimizer import _global_optimizer_post_hooks

    hooks = len(_global_optimizer_post_hooks)
    out = tmp_path / "trace"
    monkeypatch.setattr(sys, "argv", ["step_trace.py", "--out", str(out), "--steps", "3:5", "--", str(train)])
    script.main()
    files = sorted(p.name for p in out.iterdir())
    assert files == ["run1_rank0.txt", "run2_rank0.txt"]
    assert (out / "run1_rank0.txt").read_text().startswith("profiled steps: 2, wall ")
    assert len(_global_optimizer_post_hooks) == hooks  # its hook is gone: later optimizers run as they were


def test_two_optimizers_stepped_in_turn_are_two_runs_and_a_short_run_writes_nothing(script, tmp_path, monkeypatch):
    train = tmp_path / "train.py"
    train.write_text("import torch\n"
                     "m = [torch.nn.Linear(8, 8) for _ in range(3)]\n"
                     "o = [torch.optim.SGD(x.parameters(), lr=0.1) for x in m]\n"
                     "for _ in range(6):\n"
                     "    for x, p in zip(m[:2], o[:2]):\n"
                     "        x(torch.randn(4, 8)).sum().backward(); p.step(); p.zero_grad()\n"
                     "m[2](torch.randn(4, 8)).sum().backward(); o[2].step()\n")  # a third run, one step
    out = tmp_path / "trace"
    monkeypatch.setattr(sys, "argv", ["step_trace.py", "--out", str(out), "--steps", "2:4", "--", str(train)])
    script.main()
    # one profile at a time: run 2 came to its first step while run 1 was being profiled, run 3 had one step
    assert sorted(p.name for p in out.iterdir()) == ["run1_rank0.txt"]
    monkeypatch.setattr(sys, "argv", ["step_trace.py", "--out", str(out), "--steps", "1:3", "--", str(train)])
    with pytest.raises(SystemExit):
        script.main()
