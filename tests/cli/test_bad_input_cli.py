"""Careless input to finetune, analyze and heatmap (issue 39): each case is one clear line (or a safe outcome
that says what it did), and no run data is lost."""
from __future__ import annotations

import json
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

        from sebp_probe.data.assets import minilm_dir

        _bert_without_tokenizer(model, vocab=120)
        AutoTokenizer.from_pretrained(minilm_dir()).save_pretrained(model)
    out = tmp_path / "run"
    if command == "finetune":
        line = _error_line(_run([str(model), *FAST, "--max-steps", "2", "-o", str(out)]))
    else:
        line = _error_line(_analyze(str(model), "tweets", *ANALYZE, "-o", str(out / "r.json")))
    assert needle in line
    assert not out.exists()


def _labelled_csv(path: Path, labels: list) -> str:
    words = ["good", "bad", "fine", "awful", "great", "dull", "nice", "odd"]
    rows = [f"{words[i % 8]} day number {i},{labels[i % len(labels)]}" for i in range(40)]
    path.write_text("text,label\n" + "\n".join(rows) + "\n")
    return str(path)


# 2. labels: counted, sparse integers mapped to classes (said in one line), never range(max + 1)


@pytest.mark.parametrize("labels", [[1], ["pos"]])
def test_a_single_label_is_refused(tiny, tmp_path, labels):
    out = tmp_path / "run"
    line = _error_line(_run([tiny, _labelled_csv(tmp_path / "d.csv", labels), *FAST, "--max-steps", "2",
                             "-o", str(out)]))
    assert f"has fewer than 2 classes: every row is '{labels[0]}'" in line
    assert not out.exists()


@pytest.mark.parametrize("labels, mapped", [
    ([0, 1000, 2000], "0 -> 0, 1000 -> 1, 2000 -> 2"),
    ([3000000000, 7, 12], "7 -> 0, 12 -> 1, 3000000000 -> 2"),  # range(max + 1) would not fit in memory
])
@pytest.mark.parametrize("command", [pytest.param("finetune", marks=pytest.mark.slow), "analyze"])
def test_sparse_integer_labels_become_classes_and_say_so(tiny, tmp_path, labels, mapped, command):
    import json

    out, data = tmp_path / "run", _labelled_csv(tmp_path / "d.csv", labels)
    if command == "finetune":
        r = _run([tiny, data, *FAST, "--max-steps", "2", "--method", "dense", "-o", str(out)])
    else:
        r = _analyze(tiny, data, *ANALYZE, "-o", str(out / "r.json"))
    assert r.exit_code == 0, r.output
    assert f"note: label column 'label' of '{data}': its {len(labels)} integer labels are not " \
           f"0..{len(labels) - 1}; mapped in increasing order ({mapped})" in " ".join(r.output.split())
    if command == "finetune":
        config = json.loads((out / "model" / "config.json").read_text())
        assert config["id2label"] == {str(i): str(v) for i, v in enumerate(sorted(labels))}
    else:
        assert json.loads((out / "r.json").read_text())["dataset"]["notes"][0].endswith(f"({mapped})")


# 3. tiny datasets: one line, or a run where one can be made


@pytest.mark.parametrize("rows, args, needle", [
    (["the cat sat on the mat today"], ["--task", "mlm"], "has 1 row(s): too few to hold out rows for evaluation"),
    (["the cat sat on the mat today,1"], [], "fewer than 2 classes: every row is '1'"),
])
def test_a_one_row_dataset_is_one_line(tiny, tmp_path, rows, args, needle):
    data, out = tmp_path / "one.csv", tmp_path / "run"
    data.write_text(("text\n" if not rows[0].endswith(",1") else "text,label\n") + "\n".join(rows) + "\n")
    line = _error_line(_run([tiny, str(data), *FAST, "--max-steps", "2", *args, "-o", str(out)]))
    assert needle in line
    assert not out.exists()


@pytest.mark.parametrize("command", [pytest.param("finetune", marks=pytest.mark.slow), "analyze"])
def test_the_smallest_datasets_that_can_run_do(tiny, tmp_path, command):
    data, out = tmp_path / "three.csv", tmp_path / "run"
    data.write_text("text,label\nthe cat sat,1\nthe dog ran,0\nthe cow ate,2\n")
    if command == "finetune":  # two rows to train on, one held out
        r = _run([tiny, str(data), *FAST, "--max-steps", "2", "--method", "dense", "-o", str(out)])
        assert r.exit_code == 0, r.output
        assert (out / "model" / "config.json").exists()
    else:
        r = _analyze(tiny, str(data), *ANALYZE, "-o", str(out / "r.json"))
        assert r.exit_code == 0, r.output
        assert (out / "r.json").exists()


def _snapshot(out: Path) -> dict:
    """Every file of a run directory and its bytes: what no refused command may change."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


# 4. --resume checks the data by what they are, not by the string given


@pytest.mark.slow
@pytest.mark.parametrize("change, needle", [
    ("edited", "train sha256"),
    ("grown", "train rows 40 -> 41"),
    ("other folder", "train origin"),
    ("same file, absolute path", None),  # the same data by another name resumes
])
def test_resume_on_other_data_is_refused(tiny, tmp_path, monkeypatch, change, needle):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    _labelled_csv(first / "d.csv", [0, 1, 2])
    out = tmp_path / "run"
    args = [*FAST, "--max-steps", "2", "--method", "dense", "-o", str(out)]
    monkeypatch.chdir(first)
    assert _run([tiny, "d.csv", *args]).exit_code == 0
    before = _snapshot(out)
    data = "d.csv"
    if change == "edited":
        (first / "d.csv").write_text((first / "d.csv").read_text().replace("good day number 0,0", "good day number 0,1"))
    elif change == "grown":
        (first / "d.csv").write_text((first / "d.csv").read_text() + "one more row,2\n")
    elif change == "other folder":
        _labelled_csv(second / "d.csv", [2, 1, 0])
        monkeypatch.chdir(second)
    else:
        data = str(first / "d.csv")
    r = _run([tiny, data, *args, "--resume"])
    if needle is None:
        assert r.exit_code == 0 and "already completed" in r.output, r.output
    else:
        line = _error_line(r)
        assert "--resume: the data are not those the run in" in line and needle in line
    assert _snapshot(out) == before


@pytest.mark.slow
def test_resume_on_another_number_of_processes_is_refused(tiny, tmp_path):
    data, out = tmp_path / "d.csv", tmp_path / "run"
    _labelled_csv(data, [0, 1, 2])
    args = [tiny, str(data), *FAST, "--max-steps", "2", "--method", "dense", "-o", str(out)]
    assert _run(args).exit_code == 0
    config = json.loads((out / "run_config.json").read_text())
    config["num_processes"] = 2  # as a 2-process launch writes it
    (out / "run_config.json").write_text(json.dumps(config))
    before = _snapshot(out)
    line = _error_line(_run([*args, "--resume"]))
    assert "trained on 2 process(es), this launch has 1; resume it with 2" in line, line
    assert _snapshot(out) == before


# 5. --overwrite: the old run goes only once the new one has taken its first step


@pytest.mark.slow
@pytest.mark.parametrize("fail_at, error", [(1, RuntimeError), (1, KeyboardInterrupt), (1, "nan"),
                                            (2, RuntimeError)])
def test_overwrite_keeps_the_old_run_until_the_new_one_took_a_step(tiny, tmp_path, monkeypatch, fail_at, error):
    import json

    from sebp_probe.model.losses import Head

    out = tmp_path / "run"
    args = [tiny, *FAST, "--max-steps", "3", "--method", "dense", "-o", str(out)]
    assert _run([*args, "--save-steps", "1"]).exit_code == 0
    before = _snapshot(out)
    calls, real = [], Head.loss

    def failing(head, model, batch):
        calls.append(1)
        if len(calls) == fail_at and error == "nan":  # the first step's loss diverges: the run stops before it
            return real(head, model, batch) * float("nan")
        if len(calls) == fail_at:
            raise error("boom")
        return real(head, model, batch)

    monkeypatch.setattr(Head, "loss", failing)
    r = _run([*args, "--overwrite", "--lr", "1e-4"])
    if error is KeyboardInterrupt:
        assert r.exit_code == 130 and "interrupted" in r.stderr
    elif error == "nan":
        assert "loss became non-finite (nan) at step 1" in _error_line(r)
    else:
        assert "boom" in _error_line(r)
    assert not (out / ".replaced").exists()
    if fail_at == 1:  # nothing trained: the old run is back, byte for byte
        assert _snapshot(out) == before
    else:  # the new run took a step: it replaced the old one
        records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert [x["step"] for x in records if x["type"] == "train"] == [1]
        assert json.loads((out / "run_config.json").read_text())["config"]["lr"] == 1e-4
        assert not (out / "checkpoints").exists() and not (out / "model").exists()


def test_a_run_set_aside_by_a_killed_overwrite_is_never_deleted(tiny, tmp_path):
    out = tmp_path / "run"
    (out / ".replaced").mkdir(parents=True)
    (out / ".replaced" / "summary.json").write_text("{}")
    for extra in ([], ["--overwrite"], ["--resume"]):
        line = _error_line(_run([tiny, *FAST, "--max-steps", "2", "-o", str(out), *extra]))
        assert "holds the run an interrupted --overwrite replaced" in line
    assert (out / ".replaced" / "summary.json").read_text() == "{}"


# 6. checkpoints are written atomically; --resume says which one it took and what it passed over


@pytest.mark.slow
@pytest.mark.parametrize("cut", ["in the state files", "before the trainer state", "an old partial folder"])
def test_a_checkpoint_write_cut_short_is_never_resumed_from_silently(tiny, tmp_path, monkeypatch, cut):
    import json

    from accelerate import Accelerator

    out = tmp_path / "run"
    args = [tiny, *FAST, "--max-steps", "3", "--save-steps", "1", "--method", "dense", "-o", str(out)]
    saves, real = [], Accelerator.save_state

    def killed_second_write(self, path, *a, **kw):  # a second Ctrl-C while the step-2 checkpoint is written
        saves.append(path)
        if len(saves) == 2 and cut == "in the state files":
            Path(path).mkdir(parents=True, exist_ok=True)  # the run made it before the write
            (Path(path) / "model.safetensors").write_bytes(b"half")
            raise KeyboardInterrupt
        result = real(self, path, *a, **kw)
        if len(saves) == 2:
            raise KeyboardInterrupt
        return result

    with monkeypatch.context() as m:
        m.setattr(Accelerator, "save_state", killed_second_write)
        r = _run(args)
    assert r.exit_code == 130, r.output
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [".partial-step-000002", "step-000001"]
    partial = ".partial-step-000002"
    if cut == "an old partial folder":  # as a non-atomic write left it: a step folder without its state
        (ckpts / partial).rename(ckpts / "step-000002")
        (ckpts / "step-000002" / "trainer_state.json").unlink(missing_ok=True)
        partial = "step-000002"
    r = _run([*args, "--resume"])
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert f"dense: resuming from {ckpts / 'step-000001'} (step 1); passed over incomplete {partial}" in said
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in records if x["type"] == "train"] == [1, 2, 3]
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000002", "step-000003"]  # complete, the limit of 2
    assert json.loads((ckpts / "step-000002" / "trainer_state.json").read_text())["step"] == 2


def _command(command: str, model: str, out: Path, *args: str):
    """finetune, analyze or heatmap of ``model`` on the bundled tweets, small, writing under ``out``."""
    if command == "finetune":
        return _run([model, "tweets", *FAST, "--max-steps", "2", "-o", str(out), *args])
    from typer.testing import CliRunner

    from sebp_probe.cli import app

    extra = ["--layer", "query", "-o", str(out / "h.png")] if command == "heatmap" else ["-o", str(out / "r.json")]
    return CliRunner().invoke(app, [command, model, "tweets", *ANALYZE, *extra, *args])


# 7. --max-length above the model's positions: checked up front


@pytest.mark.parametrize("command", ["finetune", "analyze", "heatmap"])
@pytest.mark.parametrize("max_length, positions", [("65", 64), ("100000", 64)])
def test_max_length_above_the_models_positions_is_one_line(tiny, tmp_path, command, max_length, positions):
    out = tmp_path / "run"
    line = _error_line(_command(command, tiny, out, "--max-length", max_length))
    assert f"--max-length {max_length} is above the {positions} positions of model" in line
    assert f"use --max-length {positions} or less" in line
    assert not out.exists()


def test_roberta_positions_leave_out_the_padding_offset():
    from sebp_probe.data.assets import max_positions
    from tests.tiny_models import tiny_config

    assert max_positions(tiny_config("roberta")) == 70 - 2  # pad_token_id 1: positions start at 2
    assert max_positions(tiny_config("bert")) == 64


# 10. --task causal-lm on an encoder


@pytest.mark.parametrize("command", ["finetune", "analyze", "heatmap"])
def test_causal_lm_on_an_encoder_is_refused(tmp_path, command):
    out = tmp_path / "run"
    line = _error_line(_command(command, "minilm", out, "--task", "causal-lm"))
    assert "model 'minilm' is an encoder (bert)" in line and "--task causal-lm needs a decoder" in line
    assert not out.exists()


# 8. analyze / heatmap -o: checked before the work; an existing file replaced only with --overwrite, as finetune


@pytest.mark.parametrize("command", ["analyze", "heatmap"])
@pytest.mark.parametrize("case", ["directory", "under a file", "exists", "no permission"])
def test_an_output_that_cannot_be_written_is_one_line_before_the_work(tiny, tmp_path, monkeypatch, command, case):
    import sebp_probe.outputs as outputs

    name = "r.json" if command == "analyze" else "h.png"
    target = {"directory": tmp_path, "under a file": tmp_path / "f.txt" / "sub" / name,
              "exists": tmp_path / name, "no permission": tmp_path / "new" / name}[case]
    (tmp_path / "f.txt").write_text("mine")
    (tmp_path / name).write_text("mine")
    if case == "no permission":  # (a root user may write anywhere: the check is what is tested)
        monkeypatch.setattr(outputs.os, "access", lambda p, mode: Path(p) != tmp_path)
    calls = []
    monkeypatch.setattr("sebp_probe.data.assets.resolve_model_path", lambda *a: calls.append(a))  # no work starts
    args = ["--layer", "query"] if command == "heatmap" else []
    line = _error_line(_analyze(tiny, "tweets", *args, "-o", str(target)) if command == "analyze" else
                       _heatmap(tiny, "tweets", *args, "-o", str(target)))
    assert line.startswith(f"error: --output {target}")
    assert {"directory": "is a directory: name a file in it", "under a file": f"{tmp_path / 'f.txt'} is a file",
            "exists": "exists: pass --overwrite to replace it", "no permission": f"no permission to write into "
            f"{tmp_path}"}[case] in line
    assert not calls
    assert (tmp_path / "f.txt").read_text() == (tmp_path / name).read_text() == "mine"


def _heatmap(*args):
    from typer.testing import CliRunner

    from sebp_probe.cli import app

    return CliRunner().invoke(app, ["heatmap", *args])


def test_analyze_replaces_a_report_with_overwrite_and_writes_it_like_every_other_file(tiny, tmp_path):
    import json
    import os
    import stat

    out = tmp_path / "r.json"
    out.write_text("old")
    old_mask = os.umask(0o022)
    try:
        r = _analyze(tiny, _labelled_csv(tmp_path / "d.csv", [0, 1, 2]), *ANALYZE, "-o", str(out), "--overwrite")
    finally:
        os.umask(old_mask)
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["schema"] == "sebp-probe/report"
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.csv", "r.json"]  # no temporary file left


# 9. a hub name while offline, or one letter off a bundled name


@pytest.mark.parametrize("command", ["finetune", "analyze"])
@pytest.mark.parametrize("model, data, needle", [
    ("minlm", "tweets", "cannot load model 'minlm' from the hub: offline mode is on (HF_HUB_OFFLINE=1) and it is "
                        "not in the local cache; did you mean 'minilm'? the bundled models are minilm, smollm2"),
    ("nobody/no-such-model", "tweets", "offline mode is on (HF_HUB_OFFLINE=1) and it is not in the local cache; "
                                       "the bundled models are minilm, smollm2"),
    ("minilm", "tweet", "cannot load dataset 'tweet' from the hub: offline mode is on (HF_HUB_OFFLINE=1) and it is "
                        "not in the local cache; did you mean 'tweets'? the bundled datasets are tweets, tweets-sft"),
])
def test_hub_names_offline_and_near_misses_say_so(tmp_path, monkeypatch, command, model, data, needle):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    if command == "finetune":
        r = _run([model, data, *FAST, "--max-steps", "2", "-o", str(out)])
    else:
        r = _analyze(model, data, *ANALYZE, "-o", str(out / "r.json"))
    assert needle in _error_line(r)
    assert not out.exists()


def test_a_near_miss_online_keeps_the_hubs_reason():
    from sebp_probe.data.assets import hub_miss

    line = hub_miss("model", "SmolLM", ("minilm", "smollm2"), "404: not a valid model identifier", None)
    assert line == ("cannot load model 'SmolLM' from the hub: 404: not a valid model identifier; did you mean "
                    "'smollm2'? the bundled models are minilm, smollm2")


# Also: texts that look missing, repeated rows, labels that are missing


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".jsonl"])
def test_texts_that_read_like_missing_values_stay_texts(tmp_path, suffix):
    import json

    from sebp_probe.config import DataConfig
    from sebp_probe.data.textdata import load_text_data

    texts = ["NaN", "NA", "null", "None", "N/A", "", "hello"]
    f = tmp_path / f"d{suffix}"
    if suffix == ".jsonl":
        f.write_text("\n".join(json.dumps({"text": t or None, "label": i % 2}) for i, t in enumerate(texts)))
    else:
        sep = "\t" if suffix == ".tsv" else ","
        f.write_text(f"text{sep}label\n" + "".join(f"{t}{sep}{i % 2}\n" for i, t in enumerate(texts)))
    data = load_text_data(DataConfig(dataset=str(f)), "classification")
    assert [e["text"] for e in data.examples] == texts
    assert data.identity["notes"] == [f"1 of 7 rows of {str(f)!r} have no text (an empty field or null): kept as "
                                      "empty texts"]


@pytest.mark.parametrize("missing", ["NA", "null", ""])
def test_a_missing_label_is_still_refused(tmp_path, missing):
    from sebp_probe.data.assets import AssetError
    from sebp_probe.config import DataConfig
    from sebp_probe.data.textdata import load_text_data

    f = tmp_path / "d.csv"
    f.write_text(f"text,label\na,0\nb,{missing}\nc,1\n")
    with pytest.raises(AssetError, match=r"holds missing or non-integer values \(1 of 3 rows\)"):
        load_text_data(DataConfig(dataset=str(f)), "classification")


@pytest.mark.slow
@pytest.mark.parametrize("repeats", [0, 1, 3])
def test_repeated_rows_of_a_local_file_never_reach_both_splits(tiny, tmp_path, repeats):
    import json

    from sebp_probe.config import DataConfig
    from sebp_probe.data.textdata import load_text_data

    f = tmp_path / "d.csv"
    _labelled_csv(f, [0, 1, 2])
    lines = f.read_text().splitlines()
    f.write_text("\n".join(lines + lines[1:11] * repeats) + "\n")  # the first 10 rows again, with their labels
    out = tmp_path / "run"
    r = _run([tiny, str(f), *FAST, "--max-steps", "2", "--method", "dense", "-o", str(out)])
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    if repeats:
        assert f"note: dropped {10 * repeats} of {40 + 10 * repeats} rows of {str(f)!r} that repeat an earlier " \
               "row's text, so that held-out rows never repeat training rows" in said
    else:
        assert "note:" not in said
    run = json.loads((out / "run_config.json").read_text())
    assert run["train_examples"] + run["eval_examples"] == 40
    train, held = load_text_data(DataConfig(dataset=str(f)), "classification").deduplicated().split_off(0.1)
    assert not {e["text"] for e in train.examples} & {e["text"] for e in held.examples}
