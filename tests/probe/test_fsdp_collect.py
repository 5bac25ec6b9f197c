"""benchmarks/fsdp_collect.py rebuilds the committed two-GPU result from the raw run files beside it."""
from __future__ import annotations

import json
from pathlib import Path
from tests.helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def test_collect_reproduces_the_committed_json():
    got = load_benchmark("fsdp_collect").collect(ROOT / "results" / "fsdp_h200" / "raw")
    want = json.loads((ROOT / "results" / "fsdp_h200" / "fsdp.json").read_text())
    assert got == want
    assert got["environment"]["gpus"] == 2 and got["runs"]["lora-sebp"]["methods"]["sebp"]["sebp_layers"] == 112
