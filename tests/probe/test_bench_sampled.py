"""The whole-model bench's opt-in ``sampled`` method (sebp_probe.bench.bench_sampled): planned only by name, no
CUDA-graph timing, and on the CPU an entry whose linears sampled their rows (counted) at the dense loss."""
from __future__ import annotations

import torch

from sebp_probe.bench import bench_cases, bench_model
from sebp_probe.bench.bench_cases import MODEL_CASES


def test_sampled_is_planned_only_when_asked_for():
    case = bench_cases.tiny(MODEL_CASES["llama-3.2-1b-sft"])
    default = bench_model.plan(case, n_batches=1, device="cpu")
    assert not any(e["method"] == "sampled" for e in default["entries"])
    p = bench_model.plan(case, n_batches=1, device="cpu", graphs=True, layouts=("longest",),
                         methods=("dense", "sampled:labelled"))
    got = {(e["method"], e["head"], e["timing"]): e["reason"] for e in p["entries"]}
    assert ("sampled", "labelled", "eager") in got and got[("sampled", "labelled", "eager")] is None
    assert ("sampled", "full", "eager") not in got
    assert got[("sampled", "labelled", "graphs")]  # a reason: no CUDA graphs here (nor for sampled mode)


def test_sampled_entry_samples_rows_at_the_dense_loss():
    case = bench_cases.tiny(MODEL_CASES["llama-3.2-1b-sft"])
    r = bench_model.bench_model(case, torch.float32, repeats=3, n_batches=1, device="cpu", warmup=1,
                                methods=("dense", "sampled"), layouts=("longest",))
    rows = {(x["method"], x["head"]) for x in r["rows"]}
    assert {("sampled", "full"), ("sampled", "labelled")} <= rows
    for head in ("full", "labelled"):
        c = r["sebp_layers"][f"sampled {head}"]
        assert c["linears"] > 0 and c["budget"] == "auto" and 0 < c["kept"] < c["nonzero"], c
    assert max(x["loss_gap"] for x in r["rows"]) < 1e-5  # the forward is dense's: the same loss
