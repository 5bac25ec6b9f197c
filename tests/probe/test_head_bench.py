"""benchmarks/head_bench.py runs (on a CPU with --tiny) and its methods agree on the loss."""
from __future__ import annotations

import json
from tests.helpers import load_benchmark


def test_tiny_run_writes_json(tmp_path):
    bench = load_benchmark("head_bench")
    out = tmp_path / "r.json"
    bench.main(["--out", str(out), "--tiny", "--device", "cpu", "--shapes", "tiny-llama", "--seq", "32",
                "--warmup", "1", "--repeats", "1", "--sebp", "--extra-chunks", "8"])
    data = json.loads(out.read_text())
    assert {"device", "torch", "transformers", "date", "command"} <= set(data["environment"])
    rows = data["results"]
    for scope in ("head", "model"):
        timed = {r["method"]: r for r in rows if r["scope"] == scope and "ms" in r}
        expected = {"hf", "gather", "ours", "ours@8"} | (
            {"ours+last_layer", "ours+last_layer@8", "ours+last_layer+sebp"} if scope == "model" else set())
        assert set(timed) == expected
        losses = [r["loss"] for r in timed.values()]
        assert max(losses) - min(losses) < 1e-2 * max(losses)  # bf16 throughout
    assert {r["method"] for r in rows if "error" in r} == {"cce", "liger"}  # they need a GPU
