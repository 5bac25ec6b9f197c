"""--auto-eps under data parallel: only the main process analyses; the others take its report, and a failed
analysis stops every process with the main one's message (accelerate's broadcast stubbed out here; the real
one runs in tests/cli/test_finetune_ddp.py)."""
from __future__ import annotations

from types import SimpleNamespace

from sebp_probe.analysis import analyze
from sebp_probe.train import finetune

REPORT = {"schema": "stub"}


def _run(monkeypatch, main: bool, outcome, sent: list):
    calls = []

    def fake_analysis(loaded, data_cfg, progress=None):
        calls.append(loaded)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def fake_broadcast(objs, from_process=0):
        if main:  # the main process sends its payload
            sent.append(objs[0])
            return objs
        return [sent[0]]  # the others receive what the main one sent

    monkeypatch.setattr(analyze, "analyze_for_finetune", fake_analysis)
    monkeypatch.setattr("accelerate.utils.broadcast_object_list", fake_broadcast)
    acc = SimpleNamespace(num_processes=2, is_main_process=main)
    cfg = SimpleNamespace(data=None)
    try:
        return finetune._analysis_on_main("model", cfg, acc, None), calls
    except Exception as exc:  # noqa: BLE001
        return exc, calls


def test_only_the_main_process_analyses(monkeypatch):
    sent: list = []
    got, calls = _run(monkeypatch, True, REPORT, sent)
    assert got == REPORT and calls == ["model"]
    got, calls = _run(monkeypatch, False, RuntimeError("must not run"), sent)
    assert got == REPORT and calls == []


def test_a_failed_analysis_stops_every_process(monkeypatch):
    sent: list = []
    got, _ = _run(monkeypatch, True, ValueError("no rows"), sent)
    assert isinstance(got, ValueError) and str(got) == "no rows"
    got, calls = _run(monkeypatch, False, REPORT, sent)
    assert isinstance(got, finetune.FinetuneError) and calls == []
    assert "main process" in str(got) and "ValueError: no rows" in str(got)


def test_one_process_analyses_directly(monkeypatch):
    monkeypatch.setattr(analyze, "analyze_for_finetune", lambda loaded, data_cfg, progress=None: REPORT)
    assert finetune._analysis_on_main("model", SimpleNamespace(data=None), None, None) == REPORT
    acc = SimpleNamespace(num_processes=1, is_main_process=True)
    assert finetune._analysis_on_main("model", SimpleNamespace(data=None), acc, None) == REPORT
