"""``bench --scope model --probe``: a probed step (finetune --probe-every's hooks on the step's own backward)
against an unprobed one, interleaved, on the bench's own entries; on tiny config-built models on the CPU."""
from __future__ import annotations

import contextlib
import types

import pytest
import torch
import torch._dynamo as dynamo

from sebp_probe.analysis import hooks
from sebp_probe.bench import bench_cases, bench_model, probe_overhead
from sebp_probe.bench.bench_cases import MODEL_CASES
from sebp_probe.train import probe_steps

LLAMA = bench_cases.tiny(MODEL_CASES["llama-3.2-1b-sft"])


class _Clock:
    """A fake wall clock: a step advances it 10 ms, each gradient hook call of the collector 1 ms more (and a
    record after a probed step 5 ms, where the test says so)."""

    def __init__(self):
        self.now, self.arms = 0.0, []

    def perf_counter(self) -> float:
        return self.now


def _batches(case, n=2):
    model = bench_model.build_model(case, torch.float32, torch.device("cpu"))
    batches, _ = bench_model._pool(case, model.config, n, 0, "mask", True)
    return model, batches


def test_ratio_of_a_probed_step_by_a_fake_clock(monkeypatch):
    """The probed arm runs the collector's hooks on every target linear of the step's own backward (14 in the
    tiny Llama: 1 ms each on the fake clock), the unprobed arm none; the arms take turns, each first in every
    other round; the medians, the ratio and the record's size are what the clock and the model say."""
    clock = _Clock()
    monkeypatch.setattr(probe_overhead, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(probe_steps, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    real_grad = hooks.GradientStatsCollector._on_grad

    def on_grad(self, index, grad):
        if self._pending is not None:
            clock.now += 1e-3
        return real_grad(self, index, grad)

    monkeypatch.setattr(hooks.GradientStatsCollector, "_on_grad", on_grad)
    real_take = probe_overhead.StepProbe.take

    def take(self, step):  # the record after a probed step: 5 ms on the fake clock
        clock.now += 5e-3
        return real_take(self, step)

    monkeypatch.setattr(probe_overhead.StepProbe, "take", take)
    model, batches = _batches(LLAMA)

    def step_for(method, head):
        def step(m, b):
            clock.now += 10e-3
            clock.arms.append("probed" if any(mod._forward_hooks for mod in m.modules()) else "unprobed")
            return bench_model._step_fn(method, head)(m, b)
        return step

    keys = [("longest", "dense", "full", "eager"), ("longest", "dense", "labelled", "eager"),
            ("longest", "cce", "labelled", "eager"), ("longest", "dense", "full", "graphs")]
    out = probe_overhead.probe_overhead(lambda method, head: contextlib.nullcontext(model), step_for, batches, keys,
                                        "causal-lm", torch.device("cpu"), repeats=3, warmup=1)
    assert [(s["method"], s["timing"]) for s in out["skipped"]] == [("cce", "eager"), ("dense", "graphs")]
    # per batch: round 0 unprobed first, round 1 probed first, round 2 unprobed first
    assert clock.arms[:6] == ["unprobed", "probed", "probed", "unprobed", "unprobed", "probed"]
    assert len(out["rows"]) == 2
    for row in out["rows"]:
        assert row["unprobed_ms"] == pytest.approx(10.0) and row["probed_ms"] == pytest.approx(24.0)
        assert row["ratio"] == pytest.approx(2.4) and row["spread"] == 0 and "recompiles" not in row
        assert row["per_batch_ratio"] == pytest.approx([2.4, 2.4]) and row["probed_step_runs"] == "eager"
        assert row["layers"] == 14 and row["rows"] > 0
        # no device here: the step returns when its work is done, so its host time is its wall time
        assert (row["unprobed_host_ms"], row["probed_host_ms"]) == pytest.approx((10.0, 24.0))
        assert row["record_ms"] == pytest.approx(5.0)  # timed apart, in neither arm
    full, labelled = out["rows"]
    assert labelled["rows"] < full["rows"]  # the labelled head's last layer runs on the labelled rows only
    assert not any(mod._forward_hooks for mod in model.modules())  # no hook left behind
    lines = probe_overhead.probe_lines({"case": {"name": "tiny"}, "probe": out})
    assert "longest dense full eager: 10.00 -> 24.00 ms, 2.400x (noise +-0.0%)" in lines[1]
    assert lines[1].endswith("; host until the last launch 10.00 -> 24.00 ms; the record after it 5.00 ms")
    assert "not probed: longest cce labelled eager" in lines[-2]


@pytest.mark.slow
def test_probe_in_the_whole_bench_eager_and_compiled():
    """``bench_model(probe=True)``: the entries that ran (SEBP here: the probe does not tell methods apart),
    eager and compiled (Dynamo and AOTAutograd standing in for Inductor), probed on the bench's model and
    batches; a compiled entry's probed step runs compiled: its probed graphs compiled once before the timed
    steps, no recompile in them."""
    dynamo.reset()
    try:
        r = bench_model.bench_model(LLAMA, torch.float32, repeats=1, n_batches=2, device="cpu", warmup=1,
                                    compile="default", compile_backend="aot_eager", layouts=("longest",),
                                    methods=("sebp:labelled",), probe=True)
    finally:
        dynamo.reset()
    probe = r["probe"]
    got = {(p["method"], p["head"], p["timing"]): p for p in probe["rows"]}
    assert set(got) == {("sebp", "labelled", t) for t in ("eager", "compiled")}
    assert probe["skipped"] == []
    for (_, _, timing), p in got.items():
        assert p["unprobed_ms"] > 0 and p["probed_ms"] > 0 and p["layers"] == 14 and p["rows"] > 0
        assert p["ratio"] == pytest.approx(p["probed_ms"] / p["unprobed_ms"], rel=1e-3)
        assert p["probed_step_runs"] == timing
        if timing == "compiled":
            assert p["recompiles"] == 0 and p["probe_graphs"] >= 1
        else:
            assert "recompiles" not in p


def test_probe_is_for_the_whole_model_run():
    from typer.testing import CliRunner

    from sebp_probe.cli import app

    bad = CliRunner().invoke(app, ["bench", "bert-base", "--probe"])
    assert bad.exit_code == 1 and "--probe and --sample-dx are for the whole-model run" in " ".join(bad.output.split())
