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
