"""`sebp-probe bench`: argument validation, the dry-run plan, and a clear refusal without a GPU."""
from __future__ import annotations

import json
import sys

import pytest
import torch
from typer.testing import CliRunner

from sebp_probe.bench import bench, bench_cases, bench_steps
from sebp_probe.cli import app

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, ["bench", *args])


def test_help_has_examples():
    res = _run("--help")
    assert res.exit_code == 0
    assert "Examples" in res.output and "sebp-probe bench llama-3.2-3b" in res.output


def test_dry_run_plan_for_a_shape_set_and_the_whole_model():
    res = _run("llama-3.2-3b", "--scope", "all", "--densities", "0.1,0.5", "--dry-run")
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output)
    shapes = {(s["in_features"], s["out_features"]) for s in plan["layers"]}
    assert shapes == {(3072, 3072), (3072, 1024), (3072, 8192), (8192, 3072)}
    assert all(s["rows"] == 4096 for s in plan["layers"])
    assert plan["densities"] == [0.1, 0.5]
    assert plan["models"][0]["case"]["max_length"] == 4096 and plan["models"][0]["case"]["batch"] == 1


def test_dry_run_plan_of_the_sft_case():
    """The whole-model plan without a GPU: one pool of 8 x 8 sequences, each layout's batches and padding, the
    share of the backward's FLOPs on inactive rows per head, and every entry with why it would be skipped."""
    res = _run("llama-3.2-1b-sft", "--scope", "model", "--graphs", "--dry-run")
    assert res.exit_code == 0, res.output
    (m,) = json.loads(res.output)["models"]
    assert m["case"]["name"] == "llama-3.2-1b-sft" and m["case"]["prompt"] == 0.75
    assert m["pool"]["sequences"] == 64 and len(m["pool"]["lengths"]) == 64
    lay = m["layouts"]
    assert lay["max_length"]["shapes"] == [[8, 2048]] * 8 and all(s[0] == 8 for s in lay["longest"]["shapes"])
    assert lay["max_length"]["padding_share"] > lay["longest"]["padding_share"] > lay["bucket"]["padding_share"]
    for layout in lay.values():
        assert 0 < layout["inactive_share"]["labelled"] < layout["inactive_share"]["full"] < 1
    entries = {(e["layout"], e["method"], e["head"], e["timing"]): e["reason"] for e in m["entries"]}
    assert len(entries) == 4 * 6 * 2  # layouts x (dense, SEBP: 2 heads each; Liger; CCE) x (eager, graphs)
    assert "packed rows change shape" in entries[("packed", "dense", "full", "graphs")] or \
        entries[("packed", "dense", "full", "graphs")] == "CUDA graphs need a GPU"
    if not torch.cuda.is_available():
        assert m["packed_backend"] == "mask" and "need a CUDA GPU" in entries[("longest", "liger", "full", "eager")]
        assert entries[("longest", "sebp", "labelled", "eager")] is None


def test_dry_run_explicit_layer():
    res = _run("--rows", "1000", "--in-features", "64", "--out-features", "96", "--dry-run")
    assert res.exit_code == 0, res.output
    (layer,) = json.loads(res.output)["layers"]
    assert (layer["rows"], layer["in_features"], layer["out_features"]) == (1000, 64, 96)


@pytest.mark.parametrize(
    "args,msg",
    [(["--densities", "0"], "density must be in (0, 1]"),
     (["--densities", "0.1,abc"], "densities must be numbers"),
     (["--densities", "1.5"], "density must be in (0, 1]"),
     (["--scope", "everything"], "--scope must be"),
     (["--dtype", "fp8"], "--dtype must be"),
     (["--mode", "fast"], "--mode must be"),
     (["--repeats", "0"], "--repeats"),
     (["--in-features", "64"], "explicit shapes need"),
     (["--rows", "-5", "--in-features", "4", "--out-features", "4"], "rows must be a positive integer"),
     (["no-such-model-or-dir", "--dry-run"], "unknown shape set or model"),
     (["llama-3.2-1b", "--scope", "model"], "no whole-model case"),
     (["bert-base", "--scope", "model", "--mode", "topk", "--dry-run"], "--mode topk needs an N per layer"),
     (["bert-base", "--scope", "all", "--mode", "topk"], "--mode topk needs an N per layer"),
     (["bert-base", "--scope", "model", "--no-pad-mask", "--dry-run"], "attends in both directions"),
     (["llama-3.2-3b", "--no-pad-mask"], "are for the whole-model run"),
     (["llama-3.2-3b", "--norms"], "are for the whole-model run"),
     (["llama-3.2-3b", "--acts", "--dry-run"], "are for the whole-model run"),
     (["bert-base", "--breakdown", "--dry-run"], "are for the whole-model run"),
     (["bert-base", "--keep-dx", "--dry-run"], "are for the whole-model run"),
     (["bert-base", "--tiny", "--dry-run"], "are for the whole-model run"),
     (["bert-base", "--mode", "sampled", "--budget", "0.5", "--sample-dx", "--dry-run"], "are for the whole-model run"),
     (["bert-base", "--scope", "model", "--figure", "f.txt", "--dry-run"], "unsupported image format"),
     (["bert-base", "--scope", "model", "--model-batches", "0"], "--model-batches must be >= 1"),
     (["bert-base", "--scope", "model", "--budget", "2", "--dry-run"], "--budget must be a share in (0, 1] or auto"),
     (["bert-base", "--mode", "sampled", "--dry-run"], "--mode sampled times one layer at a fixed share"),
     (["bert-base", "--scope", "model", "--mode", "sampled", "--budget", "0.5"], "use --scope layers"),
     (["bert-base", "--mode", "sampled", "--budget", "1.5"], "--budget must be a share in (0, 1]")],
)
def test_bad_arguments_are_one_line_errors(args, msg):
    res = _run(*args)
    assert res.exit_code == 1
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and msg in lines[0], res.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("scope", ["layers", "model"])
def test_refuses_clearly_without_a_gpu(tmp_path, scope):
    res = _run("--densities", "0.5", "--scope", scope, "-o", str(tmp_path / "r.json"))
    assert res.exit_code == 1 and "needs a CUDA GPU" in res.output
    assert not (tmp_path / "r.json").exists()


def test_tiny_whole_model_run_writes_json_figure_and_80_column_tables(tmp_path, monkeypatch):
    """--tiny: the whole-model run of a shrunk case end to end (on a CPU without a GPU): one JSON with the
    environment and command, one figure, and tables that fit the 80 columns of piped output."""
    from sebp_probe import tables

    monkeypatch.setattr(tables.console, "width", 80)
    out, fig = tmp_path / "r.json", tmp_path / "r.png"
    args = ("llama-3.2-1b-sft", "--scope", "model", "--tiny", "--model-batches", "1", "--model-repeats", "1",
            "--graphs", "-o", str(out), "--figure", str(fig), "--methods", "dense,sebp,liger")  # CCE compiles: slow
    monkeypatch.setattr(sys, "argv", ["sebp-probe", "bench", *args])
    res = _run(*args)
    assert res.exit_code == 0, res.output
    result = json.loads(out.read_text())
    assert result["command"].startswith("sebp-probe bench llama-3.2-1b-sft") and "torch" in result["environment"]
    (m,) = result["models"]
    assert m["case"]["name"] == "llama-3.2-1b-sft (tiny)" and len(m["rows"]) >= 16
    assert fig.stat().st_size > 10_000
    lines = res.output.splitlines()
    prose = ("llama-3.2-1b-sft (tiny), ", "not run (", "figure written", "results written", "loss check")
    assert "…" not in res.output and max(len(line) for line in lines if not line.startswith(prose)) <= 80
    assert "fastest dense" in res.output and "--padding auto would pick" in res.output
    assert any(line.split()[:3] == ["packed", "sebp", "labelled"] for line in lines)


def test_budget_reaches_the_sampled_entries(tmp_path):
    out = tmp_path / "r.json"
    res = _run("bert-base", "--scope", "model", "--tiny", "--model-batches", "1", "--model-repeats", "1",
               "--layouts", "packed", "--methods", "sampled:full", "--budget", "0.4", "-o", str(out))
    assert res.exit_code == 0, res.output
    (m,) = json.loads(out.read_text())["models"]
    c = m["sebp_layers"]["sampled full"]
    assert c["budget"] == 0.4 and not c["sample_dx"] and 0.3 < c["kept"] / c["nonzero"] < 0.6, c


def test_sample_dx_reaches_the_sampled_entries(tmp_path):
    out = tmp_path / "r.json"
    res = _run("bert-base", "--scope", "model", "--tiny", "--model-batches", "1", "--model-repeats", "1",
               "--layouts", "packed", "--methods", "sampled:full", "--budget", "0.4", "--sample-dx", "-o", str(out))
    assert res.exit_code == 0, res.output
    (m,) = json.loads(out.read_text())["models"]
    assert m["sebp_layers"]["sampled full"]["sample_dx"] is True


def test_padded_rows():
    mask = bench.padded_rows(2048, 512, 0.1, "cpu")
    assert mask.view(4, 512)[:, :51].all() and not mask.view(4, 512)[:, 51:].any()
    assert bench.padded_rows(100, 512, 0.01, "cpu").sum() == 1  # never empty


def test_shapes_from_a_local_config(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=256, intermediate_size=688, num_attention_heads=8, num_key_value_heads=2,
                num_hidden_layers=2, vocab_size=100).save_pretrained(tmp_path)
    shapes = bench.resolve_shapes(str(tmp_path), rows=2048, seq=256)
    assert {(s.in_features, s.out_features) for s in shapes} == {(256, 256), (256, 64), (256, 688), (688, 256)}
    assert all(s.rows == 2048 and s.seq == 256 and not s.bias for s in shapes)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_right_padded_decoder_needs_no_pad_mask(arch):
    """What --no-pad-mask relies on: with right padding a causal decoder's real tokens never see the pads,
    so loss and every gradient are the same without the mask (fp32, to rounding)."""
    from tests.tiny_models import padded_batch, tiny_model

    model = tiny_model(arch).float()
    batch = padded_batch(arch, lengths=(11, 4, 7), side="right")
    grads = []
    for b in (batch, {k: v for k, v in batch.items() if k != "attention_mask"}):
        model.zero_grad(set_to_none=True)
        loss = model(**b).loss
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (l1, g1), (l2, g2) = grads
    torch.testing.assert_close(l1, l2, rtol=1e-6, atol=1e-6)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # and the check fails where it should: left padding puts the pads into the real tokens' context
    left = padded_batch(arch, lengths=(11, 4, 7), side="left")
    masked = model(**left).loss
    unmasked = model(**{k: v for k, v in left.items() if k != "attention_mask"}).loss
    assert not torch.allclose(masked, unmasked, rtol=1e-4, atol=1e-4)


def test_kernel_kinds_of_the_backward_breakdown():
    kinds = {
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64": "attention",
        "fmha_cutlassB_bf16_aligned_64x64_k64_sm80": "attention",
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "gemm",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "gemm",
        "_grads_kernel": "sebp", "_row_flags_kernel": "sebp", "_compact_kernel": "sebp",
        "void at::native::reduce_kernel<128, 4, at::native::ReduceOp<c10::BFloat16>>": "reduction",
        "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<c10::BFloat16>": "norm",
        "void at::native::(anonymous namespace)::layer_norm_grad_input_kernel_vectorized<c10::BFloat16>": "norm",
        "void at::native::vectorized_elementwise_kernel<8, at::native::GeluBackwardCUDAKernelImpl>": "elementwise/other",
        "void at::native::(anonymous namespace)::embedding_backward_feature_kernel<float>": "embedding",
    }
    for name, kind in kinds.items():
        assert bench_steps.kernel_kind(name) == kind, name


def _model_result() -> dict:
    """A whole-model result as bench_model gives it, with CUDA-graph times and a kernel breakdown (made up)."""
    rows = [dict(layout=lay, method=m, head=h, timing=t, ms=ms, forward_ms=ms / 3, backward_ms=2 * ms / 3,
                 peak_gib=None if t == "graphs" else 12.5, padding_share=pad, per_batch_ms=[ms],
                 loss_gap=None if t == "graphs" else 0.002 if m == "sebp" else 0.0)
            for lay, pad, scale in (("max_length", 0.81, 3.0), ("longest", 0.55, 1.4), ("bucket", 0.12, 1.1),
                                    ("packed", 0.0, 1.0))
            for m, h, base in (("dense", "full", 100.0), ("dense", "labelled", 90.0), ("sebp", "full", 95.0),
                               ("sebp", "labelled", 85.0), ("liger", "full", 88.0))
            for t, ms in (("eager", base * scale), ("graphs", base * scale * 0.8))
            if not (t == "graphs" and (lay == "packed" or h == "labelled" or m == "liger"))]
    limits = [dict(layout=r["layout"], head=r["head"], timing=r["timing"], inactive_share=0.42, dense_ms=r["ms"],
                   sebp_ms=r["ms"] * 0.9, limit_ms=r["ms"] * 0.7, sebp_speedup=1.111, limit_speedup=1.429,
                   sebp_of_limit=0.778) for r in rows if r["method"] == "dense"]
    return {"case": {"name": "llama-3.2-1b-sft", "batch": 8, "max_length": 2048}, "pad_mask": False, "norms": True,
            "acts": True, "pool": {"batches": 8}, "packed_backend": "varlen", "rows": rows, "limits": limits,
            "summary": bench_cases.summarize(rows),
            "skipped": [dict(layout="packed", method="dense", head="full", timing="graphs",
                             reason="packed rows change shape from batch to batch")],
            "backward_kernels": {"longest dense full": {"total_ms": 3.0, "by_kind_ms": {"gemm": 2.0,
                                                                                       "attention": 0.75}},
                                 "longest sebp full": {"total_ms": 1.5, "by_kind_ms": {
                                     "sebp": 0.5, "sebp act": 0.1, "attention": 0.75, "reduction": 0.15}}}}


@pytest.mark.parametrize("width", [80, 250])
def test_tables_render_results(capsys, monkeypatch, width):
    """The result tables render the committed per-layer results and a whole-model result (every entry kind,
    graphs, limits, breakdown, skipped reasons), and fit 80 columns when piped, so a table bug cannot cost a GPU
    run its output."""
    from pathlib import Path

    from sebp_probe import tables

    root = Path(__file__).resolve().parents[2] / "results"
    result = json.loads((root / "layers.json").read_text())["runs"]["h100_bert-base"]
    result["models"] = [_model_result()]
    monkeypatch.setattr(tables.console, "width", width)
    tables.bench_tables(result)
    raw = capsys.readouterr().out
    out = " ".join(raw.split())  # titles wrap to their table's width
    assert "GPU kernel time of one backward by kind" in out and "no padding mask" in out
    assert "longest sebp full 0.00 0.75 0.60 0.00 0.15 1.50" in out  # sebp = sebp + sebp act; other = the rest
    assert "longest dense full 140.0 112.0 12.50 55" in out  # eager, graphs, GiB, padding %
    assert "fastest dense packed dense labelled 90.00 ms" in out and "packed rows change shape" in out
    assert "eager: the limit of each layout" in out and "graphs: the limit" in out
    assert "loss within 0.002 (relative, largest: max_length sebp full)" in out and "dropout" not in out
    bert = _model_result()
    bert["case"] = dict(bert["case"], name="bert-base", arch="bert", config={})  # BERT's hidden dropout: 0.1
    tables.bench_tables({**result, "models": [bert]})
    assert "hidden dropout 0.1 draws other masks in every entry" in " ".join(capsys.readouterr().out.split())
    if width == 80:  # the summary and skipped lines are soft-wrapped prose
        prose = ("llama-3.2-1b-sft, ", "not run (", "loss check")
        assert "…" not in raw and max(len(line) for line in raw.splitlines() if not line.startswith(prose)) <= 80


def test_layer_tables_fit_80_columns(capsys, monkeypatch):
    """Piped output is 80 columns wide: the per-layer results come as three tables (times; speedups; shares of
    the ideal's speedup) with no cell cut short, and every layer's shares are printed whole; a file from before
    a timing shows "-" in its column."""
    from pathlib import Path

    from sebp_probe import tables

    root = Path(__file__).resolve().parents[2] / "results"
    result = json.loads((root / "layers.json").read_text())["runs"]["h100_llama-3.2-3b"]
    result["models"] = []
    for key in ("triton_fraction_of_ideal_io_speedup", "triton_reuse_fraction_of_ideal_speedup",
                "triton_rows_reuse_fraction_of_ideal_speedup"):  # the first layer as a file from before ideal +io
        result["layers"][0].pop(key, None)
    result["layers"][0]["ms"].pop("ideal_io", None)
    result["layers"][1]["ms"]["ideal_io"] = 0.0512
    result["layers"][1]["triton_fraction_of_ideal_io_speedup"] = 0.876
    result["layers"][1]["triton_reuse_fraction_of_ideal_speedup"] = 0.912
    result["layers"][1]["triton_rows_reuse_fraction_of_ideal_speedup"] = 0.954
    monkeypatch.setattr(tables.console, "width", 80)
    tables.bench_tables(result)
    out = capsys.readouterr().out
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= 80
    assert "median ms)" in out and "share of the" in out
    n = len(result["layers"])
    rows = [line for line in out.splitlines() if line.strip().startswith("llama-3.2-3b")]
    assert len(rows) == 3 * n
    for layer, row in zip(result["layers"], rows[2 * n:]):
        cells = row.split()
        assert cells[-5] == f"{layer['triton_fraction_of_ideal_speedup']:.2f}", row
        assert cells[-4] == f"{layer['triton_rows_fraction_of_ideal_speedup']:.2f}", row
        for cell, key in zip(cells[-3:], ("triton_fraction_of_ideal_io_speedup",
                                          "triton_reuse_fraction_of_ideal_speedup",
                                          "triton_rows_reuse_fraction_of_ideal_speedup")):
            assert cell == (f"{layer[key]:.2f}" if key in layer else "-"), row
    assert rows[1].split()[-3] == "0.051" and rows[2 * n + 1].split()[-3:] == ["0.88", "0.91", "0.95"]
    assert rows[0].split()[-3] == "-"  # no ideal +io time in the first layer
    result["layers"][0].pop("triton_rows_fraction_of_ideal_speedup")  # a file from before that timing
    tables.bench_tables(result)
    first = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("llama-3.2-3b")]
    assert first[2 * n].split()[-4] == "-"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="times a layer on a GPU")
def test_sampled_layer_bench_times_every_variant(tmp_path):
    out = tmp_path / "s.json"
    res = _run("--rows", "2048", "--in-features", "256", "--out-features", "512", "--mode", "sampled", "--budget",
               "0.5", "--densities", "0.5,1.0", "--repeats", "3", "-o", str(out))
    assert res.exit_code == 0, res.output
    layers = json.loads(out.read_text())["layers"]
    assert [r["density"] for r in layers] == [0.5, 1.0]
    for r in layers:
        assert set(r["ms"]) == {"dense", "sampled", "sampled_dx", "dense_eager", "sampled_eager",
                                "sampled_dx_eager"} and all(v > 0 for v in r["ms"].values())
    assert "Sampled backward per layer" in res.output
