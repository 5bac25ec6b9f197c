"""benchmarks/fsdp_sft_collect.py: the committed two-GPU SFT table comes from the committed raw archives."""
from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
RAW = ROOT / "results" / "fsdp_sft_h100" / "raw"


def test_collect_reproduces_the_committed_json(tmp_path):
    mod = load_benchmark("fsdp_sft_collect")
    want = json.loads((ROOT / "results" / "fsdp_sft_h100" / "fsdp_sft.json").read_text())
    args = want["command"].split()[2:]  # python benchmarks/fsdp_sft_collect.py OUT --pairs ...
    mod.main([str(tmp_path / "got.json"), *[str(ROOT / a) if a.startswith("results/") else a for a in args[1:]]])
    got = json.loads((tmp_path / "got.json").read_text())
    assert {k: v for k, v in got.items() if k != "command"} == {k: v for k, v in want.items() if k != "command"}
    places = {r["place"] for p in got["pairs"].values() for r in p["runs"].values()}
    assert places == {1, 2}
    # measured with cuDNN's attention, the second run of a process stepped far faster, whichever method it was
    before = got["before"]["pairs"]
    assert before["pair_dense-first"]["step_ratio_per_step"] > 1.5 > 0.7 > before["pair_sebp-first"]["step_ratio_per_step"]
    assert got["resume"]["resumed_from_step"] == 8 and got["resume"]["identical_steps"][:4] == [1, 2, 3, 4]
    assert "trained on 2 process(es), this launch has 1" in got["resume_other_process_count"]
    # by layers, in both orders: every step of a layer's recompile on either process left out, the interval
    # of the median around it
    both = got["both_orders"]["compiled by layers"]
    lo, hi = both["step_ratio_ci95_over_steps"]
    assert both["steps"] == 70 and lo <= both["step_ratio"] <= hi and len(both["step_ratio_by_order"]) == 2
    for name in ("pair_layers_dense-first", "pair_layers_sebp-first"):
        assert got["pairs"][name]["timed_steps"] == 35 == len(got["pairs"][name]["step_ratios"])
