"""Careless input to finetune, analyze and heatmap (issue 39): each case is one clear line (or a safe outcome
that says what it did), and no run data is lost."""
from __future__ import annotations

from pathlib import Path

import pytest
from transformers import BertConfig, BertModel

from tests.cli.test_finetune_cli import FAST, _error_line, _run, _tiny_bert
from tests.convergence.finetune_helpers import isolated_accelerate  # noqa: F401

ANALYZE = ["--max-batches", "1", "--batch-size", "4", "--max-length", "16"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _tiny_bert(tmp_path_factory.mktemp("tiny") / "bert")


def _bert_without_tokenizer(path: Path, vocab: int = 30522) -> str:
    cfg = BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=40, max_position_embeddings=64)
    BertModel(cfg).save_pretrained(path)  # a base model: the run adds a head for the data's labels
    return str(path)


def _analyze(*args):
    from typer.testing import CliRunner

    from sebp_probe.cli import app

    return CliRunner().invoke(app, ["analyze", *args])


# 1. a model folder whose tokenizer is not the model's


@pytest.mark.parametrize("command", ["finetune", "analyze"])
@pytest.mark.parametrize("folder, needle", [
    ("no tokenizer", "maps 100% of the first examples' tokens to [UNK]"),
    ("tokenizer too big", "has 30522 tokens but the model embeds only 120"),
])
def test_a_tokenizer_that_is_not_the_models_is_refused(tmp_path, command, folder, needle):
    model = tmp_path / "model"
    if folder == "no tokenizer":
        _bert_without_tokenizer(model)
    else:
        from transformers import AutoTokenizer

        from sebp_probe.assets import minilm_dir

        _bert_without_tokenizer(model, vocab=120)
        AutoTokenizer.from_pretrained(minilm_dir()).save_pretrained(model)
    out = tmp_path / "run"
    if command == "finetune":
        line = _error_line(_run([str(model), *FAST, "--max-steps", "2", "-o", str(out)]))
    else:
        line = _error_line(_analyze(str(model), "tweets", *ANALYZE, "-o", str(out / "r.json")))
    assert needle in line
    assert not out.exists()
