"""benchmarks/step_profile.py: without a GPU it refuses in one line; on one (``gpu``), a profiled entry writes its
operator tables with the command that made them."""
from __future__ import annotations

import sys

import pytest
import torch

from tests.helpers import load_benchmark


@pytest.fixture(scope="module")
def script():
    yield load_benchmark("step_profile")
    sys.modules.pop("step_profile", None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_a_gpu_it_refuses_in_one_line(script, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(sys, "argv", ["step_profile.py", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit):
        script.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("the profile needs a CUDA GPU") and not list(tmp_path.iterdir())


@pytest.mark.gpu
def test_a_profiled_entry_writes_its_tables(script, monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["step_profile.py", "--case", "bert-base", "--layout", "longest",
                                      "--entries", "dense:full", "--batches", "2", "--warmup", "1",
                                      "--out-dir", str(tmp_path)])
    assert script.main() == 0
    (table,) = tmp_path.iterdir()
    text = table.read_text()
    assert text.startswith("command: python benchmarks/step_profile.py --case bert-base")
    assert "by device time" in text and "by host time" in text


def test_host_calls_time_each_eager_sebp_backward_and_put_the_function_back(script):
    from sebp_kernels import sebp_linear
    from sebp_kernels.functional import SEBPLinearFunction

    orig = SEBPLinearFunction.__dict__["backward"]
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(4, 8, requires_grad=True)
    want = torch.autograd.grad(sebp_linear(x, w).square().sum(), (x, w))
    calls = script.HostCalls()
    calls.SLOW_MS = -1.0  # every call counts as slow: its line is written
    with calls:
        sebp_linear(x, w).sum().backward()  # not active: passes through untimed
        assert calls.ms == []
        calls.active = True
        got = torch.autograd.grad(sebp_linear(x, w).square().sum(), (x, w))
        calls.cprofile = True
        sebp_linear(x, w).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # the same gradients through the wrapper
    text = calls.summary("eager")
    assert text.startswith("eager: 2 calls, host ms median") and text.count("slow call") == 2
    assert "dY (6, 4), W (4, 8)" in text
    assert "sebp_backward" in calls.cprofile_table() or "linear_grads" in calls.cprofile_table()
    assert SEBPLinearFunction.__dict__["backward"] is orig
    assert calls.summary("again") == "again: no eager SEBP linear backward ran\n"
