"""`finetune --probe-every` end to end (a tiny local BERT with MiniLM's tokenizer on the bundled tweets): the
probes in metrics.jsonl and summary.json, `grad-stats RUN_DIR` (table, figure, tidy JSON), the checkpoints
loadable as models (`from_pretrained`, `analyze RUN_DIR/checkpoints/step-N`), and the bad inputs."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForSequenceClassification
from typer.testing import CliRunner

from sebp_probe.cli import app
from tests.cli.test_finetune_cli import FAST, _tiny_bert
from tests.convergence.finetune_helpers import isolated_accelerate  # noqa: F401


def _run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dense", "sebp"])
def test_probed_run_its_figure_and_its_checkpoints(tmp_path, method):
    model = _tiny_bert(tmp_path / "bert")
    out = tmp_path / "run"
    r = _run("finetune", model, "tweets", *FAST, "--method", method, "--max-steps", 3, "--probe-every", 2,
             "--save-steps", 2, "-o", out)
    assert r.exit_code == 0, r.output
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    probes = [x for x in records if x["type"] == "grad_stats"]
    assert [x["step"] for x in probes] == [1, 3]
    assert all(len(x["layers"]) == 12 for x in probes)  # 2 layers x 6 linears
    summary = json.loads((out / "summary.json").read_text())
    assert summary["grad_stats"]["every"] == 2 and summary["grad_stats"]["steps"] == [1, 3]
    assert all(x["record_ms"] > 0 for x in probes)  # each record's own host time
    assert summary["grad_stats"]["record_ms"] == pytest.approx(sum(x["record_ms"] for x in probes) / 2)  # median
    q = summary["grad_stats"]["types"]["attention.self.query"]
    assert q["rows_90"] == [p["types"]["attention.self.query"]["rows_90"] for p in probes]

    fig, tidy = tmp_path / "gs.png", tmp_path / "gs.json"
    r = _run("grad-stats", out, "-o", fig, "--json", tidy)
    assert r.exit_code == 0, r.output
    assert fig.stat().st_size > 1000 and "attention.self.query" in r.output
    doc = json.loads(tidy.read_text())
    assert {"device", "versions", "date", "command", "rows"} <= set(doc)
    types = ["attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
             "intermediate.dense", "output.dense"]
    assert {(row["step"], row["layer_type"]) for row in doc["rows"]} == {(s, t) for s in (1, 3) for t in types}

    # the last checkpoint is the saved model; the one before it the weights of its own step
    ckpts = sorted((out / "checkpoints").iterdir())
    assert [c.name for c in ckpts] == ["step-000002", "step-000003"]
    final = AutoModelForSequenceClassification.from_pretrained(out / "model").state_dict()
    last = AutoModelForSequenceClassification.from_pretrained(ckpts[-1]).state_dict()
    earlier = AutoModelForSequenceClassification.from_pretrained(ckpts[0]).state_dict()
    assert set(last) == set(final) and all(torch.equal(last[k], final[k]) for k in final)
    assert any(not torch.equal(earlier[k], final[k]) for k in final)
    r = _run("analyze", ckpts[0], "tweets", "--max-batches", 1, "--batch-size", 8, "--max-length", 32, "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.output[r.output.index("{"):])
    assert len(report["layers"]) == 12


def test_grad_stats_of_a_folder_without_probes_is_one_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"type": "train", "step": 1}\n')
    r = _run("grad-stats", tmp_path, "-o", tmp_path / "x.png")
    assert r.exit_code != 0 and "no gradient statistics" in r.output and "--probe-every" in r.output
    assert len(r.output.strip().splitlines()) == 1


@pytest.mark.parametrize("bad", ["0", "-2"])
def test_probe_every_zero_or_negative_is_one_line(tmp_path, bad):
    r = _run("finetune", "minilm", "tweets", "--probe-every", bad, "-o", tmp_path / "run")
    assert r.exit_code != 0 and "--probe-every must be an integer >= 1" in r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "run").exists()
