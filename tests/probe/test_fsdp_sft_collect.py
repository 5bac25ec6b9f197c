"""benchmarks/fsdp_sft_collect.py: the committed two-GPU SFT table comes from the committed raw archives."""
from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
RAW = ROOT / "results" / "fsdp_sft_h100" / "raw"


def test_collect_reproduces_the_committed_json():
    mod = load_benchmark("fsdp_sft_collect")
    got = mod.collect(mod.read_archives([RAW / "pairs_compiled.tgz", RAW / "eager_resume_fsdp1.tgz"]))
    want = json.loads((ROOT / "results" / "fsdp_sft_h100" / "fsdp_sft.json").read_text())
    assert json.loads(json.dumps(got)) == want
    places = {r["place"] for p in got["pairs"].values() for r in p["runs"].values()}
    assert places == {1, 2}
    assert got["resume"]["resumed_from_step"] == 8 and got["resume"]["identical_steps"][:4] == [1, 2, 3, 4]
    assert "trained on 2 process(es), this launch has 1" in got["resume_other_process_count"]
