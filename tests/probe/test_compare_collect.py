"""benchmarks/compare_collect.py: the committed compare table comes from the committed raw archives."""
from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
RAW = ROOT / "results" / "compare_h100" / "raw"


def test_collect_reproduces_the_committed_json():
    got = load_benchmark("compare_collect").collect(sorted(RAW.glob("session*.tgz")))
    want = json.loads((ROOT / "results" / "compare_h100" / "compare.json").read_text())
    assert got == want
    same = [r for p in ("eager", "compile") for r in got["pairs"][p]["orders"].values()]
    assert len(same) == 4 and {r["verdict"] for r in same} == {"same computation"}
    assert all(r["sebp_layers"] == 0 for r in same)
