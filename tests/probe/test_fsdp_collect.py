"""benchmarks/fsdp_collect.py rebuilds the committed two-GPU result from the raw run files beside it."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_collect_reproduces_the_committed_json():
    spec = importlib.util.spec_from_file_location("fsdp_collect", ROOT / "benchmarks" / "fsdp_collect.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    got = mod.collect(ROOT / "results" / "fsdp_h200" / "raw")
    want = json.loads((ROOT / "results" / "fsdp_h200" / "fsdp.json").read_text())
    assert got == want
    assert got["environment"]["gpus"] == 2 and got["runs"]["lora-sebp"]["methods"]["sebp"]["sebp_layers"] == 112
