"""`sebp-probe analyze` and `sebp-probe heatmap` end to end, offline, on the bundled MiniLM / SmolLM2 and
tweets (small batches), and the one-line errors of bad input."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sebp_probe.cli import app
from sebp_probe.analysis.report import check_report_for_model, layer_configs_from_report, load_report

SMALL = ["--max-batches", "2", "--batch-size", "8", "--max-length", "32"]


def _run(*args):
    return CliRunner().invoke(app, list(args))


def _error_line(result) -> str:
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert result.exit_code == 1, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_help_has_examples():
    for cmd in ("analyze", "heatmap"):
        r = _run(cmd, "--help")
        assert r.exit_code == 0 and "Examples" in r.output and "sebp-probe " + cmd in r.output


@pytest.mark.slow
def test_analyze_minilm_tweets_tables_report_and_json(tmp_path, monkeypatch):
    from rich.console import Console

    import sebp_probe.cli as cli

    monkeypatch.setattr(cli, "console", Console(width=80))  # piped output's width
    out = tmp_path / "report.json"
    r = _run("analyze", "minilm", "tweets", *SMALL, "-o", str(out), "--per-layer")
    assert r.exit_code == 0, r.output
    for text in ("Tokens per sample", "Sparsity of dL/dY per layer type", "Recommended SEBP settings",
                 "attention.self.query", "global setting", f"report written to {out}",
                 "Rows of dL/dY by cause per layer type", "backward GEMM FLOPs by cause, all layers: padding",
                 "Padding layouts (16 samples, batches of 8, max 32)", "recommended layout: "):
        assert text in r.output
    report = load_report(out)
    assert report["schema_version"] == 2
    assert report["model"]["name"] == "minilm" and report["model"]["model_type"] == "bert"
    assert report["dataset"]["name"] == "tweets" and report["dataset"]["num_samples"] == 16
    assert report["padding"] == {"padding": "max_length", "max_length": 32, "padding_side": "right",
                                 "batch_size": 8}
    assert len(report["layers"]) == 36 and report["analysis"]["batches"] == 2
    for name, e in report["layers"].items():  # at 80 columns the reasons come under the table, whole
        assert f"  {name}: {e['stats']['reason']}" in r.output
    # right padding: every padded token row is exactly zero, in every layer
    pad = report["tokens"]["pad_fraction"]
    key = report["layers"]["bert.encoder.layer.0.attention.self.key"]["stats"]
    assert key["zero_row_fraction"]["avg"] == pytest.approx(pad)
    # the last layer of the CLS classifier: only the 8 CLS rows of each 8 x 32 batch are active
    last = report["layers"]["bert.encoder.layer.5.intermediate.dense"]["stats"]
    assert last["zero_row_fraction"]["avg"] == pytest.approx(1 - 8 / 256)
    # ... by cause: the padding, then every real token but the CLS is label-less
    assert last["rows_by_cause"] == pytest.approx({"padding": pad, "label_less": 1 - 8 / 256 - pad, "other_zero": 0,
                                                   "near_zero": 0, "active": 8 / 256})
    assert key["rows_by_cause"]["padding"] == pytest.approx(pad) and key["rows_by_cause"]["label_less"] == 0
    advice = report["layouts"]
    assert set(advice["layouts"]) == {"max_length", "longest", "bucket", "packed"}
    assert advice["layouts"]["max_length"]["padding_share"] == pytest.approx(pad)  # as measured
    assert advice["layouts"]["packed"]["applies"]  # a BERT classifier packs exactly
    # most tweets fill the 32 tokens: no layout leaves a point less padding, so the simplest stays
    assert advice["recommended"] == "max_length" and advice["stack_sebp"]
    assert "label-less rows of the last layer" in advice["recommendation"]
    assert advice["recommendation"] in " ".join(r.output.split())

    r = _run("analyze", "minilm", "tweets", *SMALL, "--json")
    assert r.exit_code == 0, r.output
    as_json = json.loads(r.stdout)
    assert as_json["layers"].keys() == report["layers"].keys()
    assert as_json["tokens"] == report["tokens"]
    assert as_json["layouts"]["recommended"] == report["layouts"]["recommended"]
    assert as_json["totals"]["share_by_cause"] == pytest.approx(report["totals"]["share_by_cause"])


@pytest.mark.slow
def test_analyze_smollm2_left_padded_report_patches_the_model(tmp_path):
    out = tmp_path / "smol.json"
    r = _run("analyze", "smollm2", "tweets", "--padding-side", "left", "--max-batches", "1", "--batch-size", "4",
             "--max-length", "24", "--targets", "q_proj,down_proj", "-o", str(out))
    assert r.exit_code == 0, r.output
    report = load_report(out)
    assert report["model"]["model_type"] == "llama" and report["padding"]["padding_side"] == "left"
    assert len(report["layers"]) == 60
    from sebp_probe import patch_model
    from sebp_probe.data.assets import load_model

    model = load_model("smollm2").model
    check_report_for_model(report, model)
    assert len(patch_model(model, layer_configs=layer_configs_from_report(report))) == 60


@pytest.mark.slow
def test_analyze_reuse_table_and_report(tmp_path, monkeypatch):
    from rich.console import Console

    import sebp_probe.cli as cli

    monkeypatch.setattr(cli, "console", Console(width=100))
    out = tmp_path / "report.json"
    r = _run("analyze", "minilm", "tweets", *SMALL, "--targets", "query,output.dense", "--reuse", "-o", str(out))
    assert r.exit_code == 0, r.output
    assert "Gradient reuse (--method resprop)" in r.output and "reuse 0.9:" in r.output
    reuse = load_report(out)["reuse"]
    assert len(reuse["layers"]) == 18 and all(e["steps"] == 1 for e in reuse["layers"].values())
    assert "attention.self.query " in r.output.split("Gradient reuse")[1]
    r = _run("analyze", "minilm", "tweets", "--max-batches", "1", "--batch-size", "8", "--max-length", "32",
             "--reuse")
    assert r.exit_code == 1 and "at least 2 batches" in r.output


@pytest.mark.slow
@pytest.mark.parametrize("ext, magic", [(".png", b"\x89PNG\r\n\x1a\n"), (".pdf", b"%PDF"), (".svg", b"<?xml")])
def test_heatmap_writes_a_picture_in_the_extensions_format(tmp_path, ext, magic):
    out = tmp_path / f"q0{ext}"
    r = _run("heatmap", "minilm", "tweets", "--layer", "*.0.attention.self.query", "-o", str(out),
             "--max-batches", "1", "--batch-size", "4", "--max-length", "32")
    assert r.exit_code == 0, r.output
    assert out.read_bytes().startswith(magic) and out.stat().st_size > 20_000
    assert "bert.encoder.layer.0.attention.self.query: eps" in r.output


def _csv(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("case", ["unknown model", "missing column", "empty dataset", "layer glob", "image format",
                                  "padding side", "tile", "max batches", "missing data file"])
@pytest.mark.slow
def test_bad_input_gives_one_clear_line(tmp_path, case):
    args, words = {
        "unknown model": (["analyze", "./no/such/model"], "does not exist"),
        "missing column": (["analyze", "minilm", _csv(tmp_path, "nolabel.csv", "text,score\nhello,1\nbye,2\n")],
                           "no label column"),
        "empty dataset": (["analyze", "minilm", _csv(tmp_path, "empty.csv", "text,label\n")], "no rows"),
        "layer glob": (["heatmap", "minilm", "tweets", "--layer", "*.nothing.*"], "matches no linear layer"),
        "image format": (["heatmap", "minilm", "tweets", "--layer", "query", "-o", "x.jpg"], "unsupported image"),
        "padding side": (["analyze", "--padding-side", "up"], "left or right"),
        "tile": (["analyze", "--tile", "0"], "tile"),
        "max batches": (["analyze", "--max-batches", "0"], "max batches"),
        "missing data file": (["analyze", "minilm", str(tmp_path / "gone.csv")], "does not exist"),
    }[case]
    assert words in _error_line(_run(*args))
