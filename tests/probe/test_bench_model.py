"""The whole-model benchmark off the GPU: its cases (lengths, prompt masking, one pool of sequences for every
layout), the limit's FLOP count on a hand-made example, the Liger patching's globals, the figure, and a CPU run
of the whole thing on tiny BERT and Llama cases (every entry but the CUDA-only ones, which say why)."""
from __future__ import annotations

import json
import statistics
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from sebp_probe.bench import bench_cases, bench_model, bench_peers
from sebp_probe.data.batching import PackedCollator
from sebp_probe.bench.bench_cases import LAYOUTS, MODEL_CASES, Geometry



def test_length_distributions():
    sft = bench_cases.sample_lengths("sft", 4000, 2048, seed=0)
    assert 16 <= min(sft) and max(sft) <= 2048 and 270 <= statistics.median(sft) <= 330
    assert 0.003 < sum(n == 2048 for n in sft) / 4000 < 0.03  # a tail reaches the max length
    sst2 = bench_cases.sample_lengths("sst2", 4000, 512, seed=0)
    assert 5 <= min(sst2) and max(sst2) <= 66 and 0.05 < sum(sst2) / (4000 * 512) < 0.075
    short = bench_cases.sample_lengths("short", 500, 4096, seed=1)
    assert 64 <= min(short) and max(short) <= 512
    assert min(bench_cases.sample_lengths("sft", 500, 64, seed=2)) >= 2  # tiny: still a labelled token
    with pytest.raises(ValueError, match="unknown length distribution"):
        bench_cases.sample_lengths("zipf", 4, 64, 0)


def test_prompt_masking_and_classification_items():
    case = MODEL_CASES["llama-3.2-1b-sft"]
    lens = [2, 3, 8, 100]
    for n, it in zip(lens, bench_cases.make_items(case, lens, 1000, seed=0)):
        prompt = min(int(0.75 * n), n - 1)
        assert len(it["input_ids"]) == n and min(it["input_ids"]) > bench_cases.PAD_ID
        assert it["labels"][:prompt] == [-100] * prompt and it["labels"][prompt:] == it["input_ids"][prompt:]
    bert = bench_cases.make_items(MODEL_CASES["bert-base"], [5, 9], 1000, seed=0)
    assert all(it["label"] in (0, 1) and "labels" not in it for it in bert)


def _sequences(layout: str, batch: dict) -> list[tuple]:
    """The real tokens of each sequence of a collated batch."""
    if layout == "packed":
        flat, cu = batch["input_ids"].reshape(-1)[batch["flat_index"]], batch["cu_seqlens"].tolist()
        return [tuple(flat[a:b].tolist()) for a, b in zip(cu[:-1], cu[1:])]
    return [tuple(row[m.bool()].tolist()) for row, m in zip(batch["input_ids"], batch["attention_mask"])]


@pytest.mark.parametrize("name", ["llama-3.2-1b-sft", "bert-base"])
def test_every_layout_lays_out_the_same_pool(name):
    case = bench_cases.tiny(MODEL_CASES[name])
    lens = bench_cases.sample_lengths(case.lengths, case.batch * 5, case.max_length, seed=0)
    items = bench_cases.make_items(case, lens, 512, seed=0)
    batches = bench_cases.layout_batches(case, items, seed=0)
    pool = sorted(tuple(it["input_ids"]) for it in items)
    for layout in LAYOUTS:
        assert len(batches[layout]) == 5
        assert sorted(s for b in batches[layout] for s in _sequences(layout, b)) == pool, layout
    assert all(b["input_ids"].shape[1] == case.max_length for b in batches["max_length"])
    spread = {lay: statistics.fmean(max(map(len, _sequences(lay, b))) - min(map(len, _sequences(lay, b)))
                                    for b in batches[lay]) for lay in ("longest", "bucket")}
    assert spread["bucket"] < spread["longest"]  # bucket groups similar lengths
    share = bench_cases.layout_padding(lens, case, 0, "mask")
    assert share["max_length"] > share["longest"] > max(share["bucket"], share["packed"])
    assert bench_cases.layout_padding(lens, case, 0, "varlen")["packed"] == 0.0


_CFG = SimpleNamespace(model_type="llama", hidden_size=4, intermediate_size=8, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=2, num_hidden_layers=2, vocab_size=10)


def test_limit_formula_on_a_hand_made_batch():
    """Two sequences of 4 and 2 tokens padded to 4, one labelled token each, 2 decoder layers.

    Per layer sum(in x out): queries 4x4 = 16, keys and values 4x2 + 4x2 = 16, the rest (o 16, gate/up 2 x 32,
    down 32) 112. Layer 0: 8 rows, 6 active: 4 x 8 x 144 = 4608 FLOPs, 4 x 2 x 144 = 1152 inactive. Last layer:
    keys/values 4 x 8 x 16 = 512 (128 inactive); queries and the rest 4 x 8 x 128 = 4096, 2 rows active (3072
    inactive); LM head 4 x 8 x 40 = 1280 (960 inactive). Attention 10 x width 4 x (32 + 32 pairs) = 2560."""
    geo = Geometry(rows=2, length=4, seq_lens=[4, 2], read=[1, 1])
    f = bench_cases.backward_flops(_CFG, geo, "full", causal_kernel=False)
    assert f == {"linear": 10496, "inactive": 5312, "total": 13056}
    s = 5312 / 13056
    assert bench_cases.limit_ms(10.0, 20.0, s) == pytest.approx(10 + 20 * (1 - s))
    # labelled head: the last layer's queries (2 sequences x 1 slot), the rest and the LM head on the 2 rows
    lab = bench_cases.backward_flops(_CFG, geo, "labelled", causal_kernel=False)
    assert lab == {"linear": 4608 + 4 * 2 * 16 + 512 + 4 * 2 * 112 + 4 * 2 * 40, "inactive": 1152 + 128,
                   "total": 6464 + 10 * 4 * (32 + 2 * 4)}
    causal = bench_cases.backward_flops(_CFG, geo, "full", causal_kernel=True)
    assert causal["total"] == 10496 + 10 * 4 * (16 + 16)
    varlen = bench_cases.backward_flops(_CFG, Geometry(1, 6, [4, 2], [1, 1], varlen=True), "full", True)
    assert varlen["inactive"] == 4 * 4 * 128 + 4 * 4 * 40  # no padding: only the unread rows
    assert varlen["total"] == varlen["linear"] + 10 * 4 * 2 * (16 + 4) / 2


def test_packed_encoders_by_varlen_count_per_sequence_pairs_in_both_directions():
    """A BERT batch of sequences of 4 and 2 tokens packed in one row of 6: by varlen its attention computes
    4 x 4 + 2 x 2 pairs per layer and head, all of them (no causality); by the block mask all 6 x 6 of the row.
    The plan of a GPU run and its FLOPs say the same: varlen unless attention dropout trains."""
    batch = PackedCollator(0, "classification", 6)([{"input_ids": [5] * 4, "label": 0},
                                                     {"input_ids": [6] * 2, "label": 1}])
    bert = SimpleNamespace(model_type="bert", hidden_size=4, intermediate_size=8, num_attention_heads=2,
                           num_hidden_layers=2)
    varlen, mask = (bench_cases.geometry(batch, "classification", b) for b in ("varlen", "mask"))
    assert (varlen.rows, varlen.length, varlen.varlen) == (1, 6, True)
    assert (mask.rows, mask.length, mask.varlen) == (1, 6, False)
    lin = bench_cases.backward_flops(bert, varlen, "full", False)["linear"]
    assert bench_cases.backward_flops(bert, varlen, "full", False)["total"] == lin + 10 * 4 * 2 * (16 + 4)
    assert bench_cases.backward_flops(bert, mask, "full", False)["total"] == lin + 10 * 4 * 2 * 36

    case = bench_cases.tiny(MODEL_CASES["bert-base"])
    cfg = bench_model.model_config(case)
    assert bench_model.plan(case, n_batches=1, device="cuda")["packed_backend"] == "varlen"
    assert bench_model.packed_backend(cfg, torch.device("cuda"), torch.float32) == "mask"
    cfg.attention_probs_dropout_prob = 0.1
    assert bench_model.packed_backend(cfg, torch.device("cuda"), torch.bfloat16) == "mask"
    cfg = bench_model.model_config(case)
    batches, info = bench_model._pool(case, cfg, 1, 0, "varlen", True)
    geo = bench_cases.geometry(batches["packed"][0], "classification", "varlen")
    assert geo.varlen and info["layouts"]["packed"]["flops"]["full"] == [
        bench_cases.backward_flops(cfg, geo, "full", causal_kernel=False)]


def test_a_compiled_bench_pads_its_batches_to_the_compile_multiple():
    case = bench_cases.tiny(MODEL_CASES["llama-3.2-1b-sft"])
    cfg = bench_model.model_config(case)
    plain, _ = bench_model._pool(case, cfg, 4, 0, "varlen", True)
    batches, info = bench_model._pool(case, cfg, 4, 0, "varlen", True, compiled=True)
    for layout in ("longest", "bucket"):
        lens = [b["input_ids"].shape[1] for b in batches[layout]]
        assert all(n % 8 == 0 or n == case.max_length for n in lens), lens
        assert lens != [b["input_ids"].shape[1] for b in plain[layout]]  # some were not a multiple before
    planned = bench_model.plan(case, n_batches=4, device="cpu", compile="default")["layouts"]["longest"]
    assert planned["shapes"] == info["layouts"]["longest"]["shapes"]
    assert planned["padding_share"] == info["layouts"]["longest"]["padding_share"]


def test_layout_limits_and_summary():
    flops = [{"inactive": 1.0, "total": 4.0}, {"inactive": 1.0, "total": 2.0}]
    dense = [{"step_ms": 30.0, "forward_ms": 10.0, "backward_ms": 20.0}] * 2
    sebp = [{"step_ms": 25.0, "forward_ms": 10.0, "backward_ms": 15.0}] * 2
    info = {"layouts": {"longest": {"flops": {"full": flops}, "inactive_share": {"full": 0.333}}}}
    runs = {("longest", "dense", "full", "eager"): dense, ("longest", "sebp", "full", "eager"): sebp}
    (li,) = bench_cases.layout_limits(runs, {}, info)
    lim = (10 + 20 * 0.75 + 10 + 20 * 0.5) / 2
    assert li["limit_ms"] == pytest.approx(lim) and li["sebp_speedup"] == pytest.approx(1.2)
    assert li["sebp_of_limit"] == pytest.approx(round(lim / 25, 3))
    assert bench_cases.layout_limits(runs, {("longest", "sebp", "full", "eager"): "oom"}, info) == []
    rows = [dict(layout=lay, method=m, head="full", timing="eager", ms=ms) for lay, m, ms in
            (("longest", "dense", 30.0), ("longest", "sebp", 25.0), ("packed", "dense", 20.0),
             ("packed", "liger", 18.0), ("packed", "sebp", 19.0))]
    s = bench_cases.summarize(rows)["eager"]
    assert (s["fastest_dense"]["layout"], s["fastest_baseline"]["method"], s["fastest"]["method"],
            s["auto_pick"]["method"]) == ("packed", "liger", "liger", "sebp")
    assert rows[1]["vs_dense_same_layout"] == 1.2 and rows[4]["vs_fastest_baseline"] == round(18 / 19, 3)
    rows.append(dict(layout="packed", method="dense", head="labelled", timing="eager", ms=17.0))
    s = bench_cases.summarize(rows)["eager"]  # auto times both heads: the faster labelled head wins
    assert s["auto_pick"] == s["fastest_dense"] == {"layout": "packed", "method": "dense", "head": "labelled",
                                                    "ms": 17.0}


def test_liger_patch_is_confined_to_its_model(monkeypatch):
    """Liger's apply functions also set globals of the transformers module (RoPE, classes): the copy's context
    sets them for its steps only; the dense model keeps its own."""
    import transformers.models.llama.modeling_llama as ml

    def fake_apply(model):  # as apply_liger_kernel_to_llama(model=...): module globals and the instance
        ml.apply_rotary_pos_emb = "liger rope"
        ml.LigerOnly = "new name"
        model.forward = types.MethodType(lambda self, **kw: "liger forward", model)

    fake = types.ModuleType("liger_kernel.transformers")
    fake.apply_liger_kernel_to_llama = fake_apply
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    rope = ml.apply_rotary_pos_emb
    case = bench_cases.tiny(MODEL_CASES["llama-3.2-1b-sft"])
    model, context = bench_peers.liger_patch(bench_model.build_model(case, torch.float32, torch.device("cpu")),
                                             case.arch)
    assert ml.apply_rotary_pos_emb is rope and not hasattr(ml, "LigerOnly") and model() == "liger forward"
    with context():
        assert ml.apply_rotary_pos_emb == "liger rope" and ml.LigerOnly == "new name"
    assert ml.apply_rotary_pos_emb is rope and not hasattr(ml, "LigerOnly")
    assert bench_peers.liger_reason("bert", torch.device("cuda")).startswith(
        "Liger-Kernel has no patch for bert")


@pytest.fixture(scope="module")
def tiny_results() -> dict:
    """The whole benchmark of the tiny BERT and Llama cases on the CPU: 2 batches, one timed step each (the
    Cut-Cross-Entropy entry compiles on a CPU: tests/probe/test_bench_compile.py)."""
    out = {}
    for name in ("bert-base", "llama-3.2-1b-sft"):
        out[name] = bench_model.bench_model(bench_cases.tiny(MODEL_CASES[name]), torch.bfloat16, repeats=1,
                                            n_batches=2, graphs=True, breakdown=True, norms=True, acts=True,
                                            device="cpu", warmup=0, methods=("dense", "sebp", "liger"))
    return out


@pytest.mark.parametrize("name", ["bert-base", "llama-3.2-1b-sft"])
def test_whole_benchmark_on_a_cpu(tiny_results, name):
    r = tiny_results[name]
    json.dumps(r)  # one JSON
    decoder = name != "bert-base"
    want = {(lay, m, h) for lay in LAYOUTS for m in ("dense", "sebp") for h in ("full", "labelled")
            if decoder or not (lay == "packed" and h == "labelled")}
    assert {(x["layout"], x["method"], x["head"]) for x in r["rows"]} == want
    assert all(x["timing"] == "eager" and x["ms"] > 0 and len(x["per_batch_ms"]) == 2 for x in r["rows"])
    assert all(x["loss_gap"] < 0.05 for x in r["rows"])  # the same loss, bf16 rounding aside
    why = {(s["method"], s["timing"]): s["reason"] for s in r["skipped"] if s["layout"] == "max_length"}
    assert why[("dense", "graphs")] == "CUDA graphs need a GPU"
    assert ("Liger-Kernel's Triton kernels need a CUDA GPU" if decoder else "no patch for bert") in why[
        ("liger", "eager")]
    assert r["packed_backend"] == "mask" and r["layouts"]["packed"]["padding_share"] > 0
    assert r["backward_kernels"] == {"skipped": "the kernel breakdown needs a CUDA GPU"}
    assert r["sebp_layers"]["full"]["norms"] > 0 and r["sebp_layers"]["full"]["acts"] > 0
    if decoder:  # the labelled head keeps the LM head a plain linear
        assert r["sebp_layers"]["full"]["linears"] == r["sebp_layers"]["labelled"]["linears"] + 1
    assert {(li["layout"], li["head"]) for li in r["limits"]} == {(lay, h) for lay, _, h in want}
    for li in r["limits"]:
        assert 0 < li["inactive_share"] < 1 and li["limit_ms"] < li["dense_ms"]
    pick = r["summary"]["eager"]["auto_pick"]
    assert set(r["summary"]) == {"eager", "all"} and pick["ms"] == min(
        e["ms"] for e in r["rows"] if e["method"] in ("dense", "sebp") and e["timing"] == "eager")
    assert r["pool"]["sequences"] == 2 * r["case"]["batch"] == len(r["pool"]["lengths"])


def test_figure_of_the_results(tiny_results, tmp_path):
    from sebp_probe.analysis.plots import plot_bench_models

    models = list(tiny_results.values())
    graphed = json.loads(json.dumps(models[0]))
    graphed["rows"] += [dict(r, timing="graphs", ms=r["ms"] / 2) for r in graphed["rows"]
                        if r["layout"] != "packed" and r["head"] == "full"]
    graphed["summary"] = bench_cases.summarize(graphed["rows"])
    path = plot_bench_models([graphed, models[1]], tmp_path / "bench.png")
    assert path.stat().st_size > 10_000
    with pytest.raises(ValueError, match="unsupported image format"):
        plot_bench_models(models, tmp_path / "bench.txt")
    from matplotlib.figure import Figure

    assert isinstance(plot_bench_models(models), Figure)  # no path: the Figure, for a notebook to show


@pytest.mark.parametrize("name", ["qwen2.5-0.5b-sft", "bert-base"])
def test_packed_rows_by_varlen_as_on_a_gpu(name, monkeypatch):
    """The packed entries as a GPU runs them (one flattened row, varlen attention, BERT's in both directions;
    here a per-sequence sdpa in place of flash attention): no padding, the same loss as every padded layout,
    and for the decoder the labelled-rows head through the varlen last layer."""
    from sebp_probe.model import packing
    from tests.probe.test_packing import reference_varlen

    monkeypatch.setattr(packing, "VARLEN_KERNEL", reference_varlen)
    monkeypatch.setattr(packing, "attention_backend", lambda model: "varlen")
    r = bench_model.bench_model(bench_cases.tiny(MODEL_CASES[name]), torch.float32, repeats=1,
                                n_batches=1, device="cpu", warmup=0, methods=("dense", "sebp"))
    assert r["packed_backend"] == "varlen" and r["layouts"]["packed"]["padding_share"] == 0.0
    packed = {(x["method"], x["head"]) for x in r["rows"] if x["layout"] == "packed"}
    heads = ("full", "labelled") if name != "bert-base" else ("full",)  # the [CLS]-rows layer: padded only
    assert packed == {(m, h) for m in ("dense", "sebp") for h in heads}
    assert r["layouts"]["packed"]["shapes"][0][0] < r["case"]["batch"]  # fewer rows than sequences
    # fp32: every layout, method and head, the same loss (BERT's case keeps hidden dropout: other masks per entry)
    assert max(x["loss_gap"] for x in r["rows"]) < (1e-5 if name != "bert-base" else 0.05)


def test_one_head_of_a_method_can_be_selected():
    case = bench_cases.tiny(MODEL_CASES["llama-3.2-1b-sft"])
    p = bench_model.plan(case, n_batches=1, device="cpu", layouts=("packed",), methods=("sebp:labelled", "cce"))
    assert {(e["method"], e["head"]) for e in p["entries"]} == {("sebp", "labelled"), ("cce", "labelled")}
    with pytest.raises(ValueError, match="unknown method 'sebp:half'"):
        bench_model.plan(case, n_batches=1, device="cpu", methods=("sebp:half",))


def test_a_run_cut_short_keeps_what_it_measured():
    """bench_model hands out the result so far after each layout (and each compiled entry): what the CLI writes
    to -o while it runs, marked incomplete."""
    case = bench_cases.tiny(MODEL_CASES["llama-3.2-1b-sft"])
    seen = []
    final = bench_model.bench_model(case, torch.float32, repeats=1, n_batches=1, device="cpu", warmup=0,
                                    methods=("dense", "sebp"), layouts=("max_length", "packed"), partial=seen.append)
    assert [s["complete"] for s in seen] == [False, False] and final["complete"]
    assert {r["layout"] for r in seen[0]["rows"]} == {"max_length"}
    assert seen[-1]["rows"] == final["rows"]
    assert all("flops" not in lay for s in seen for lay in s["layouts"].values())


def test_the_results_environment_names_the_host_processor(monkeypatch):
    """Compiled steps without CUDA graphs are bound by the host: the JSON says which host it was."""
    import builtins
    import io

    from sebp_probe.bench import bench

    env = bench.environment()
    assert env["cpu"]["cores"] >= 1 and env["cpu"]["model"]
    real_open = builtins.open

    def fake_open(path, *a, **k):
        if path == "/proc/cpuinfo":
            return io.StringIO("processor\t: 0\nmodel name\t: Example CPU 9000 @ 3.0GHz\n")
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", fake_open)
    assert bench.host_cpu()["model"] == "Example CPU 9000 @ 3.0GHz"

    def no_proc(path, *a, **k):
        if path == "/proc/cpuinfo":
            raise FileNotFoundError(path)
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", no_proc)
    assert bench.host_cpu()["model"]  # falls back to the platform's name


def test_the_gpu_limits_come_from_nvidia_smi_or_are_none(monkeypatch):
    import subprocess

    from sebp_probe.bench import bench

    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        return SimpleNamespace(stdout="700.00, 1980\n", returncode=0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert bench.gpu_limits(1) == {"power_limit_w": 700.0, "max_sm_clock_mhz": 1980.0}
    assert seen[0][:3] == ["nvidia-smi", "-i", "1"]

    def missing(cmd, **kw):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "run", missing)
    assert bench.gpu_limits(0) is None
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: SimpleNamespace(stdout="[N/A], [N/A]\n", returncode=0))
    assert bench.gpu_limits(0) is None
