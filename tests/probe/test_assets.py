"""Model and dataset resolution, column detection, tokenization and padding."""
from __future__ import annotations

import json

import pytest
import torch

from sebp_probe.data.assets import AssetError, load_model, model_identity
from sebp_probe.data.batching import PadCollator
from sebp_probe.config import DataConfig
from sebp_probe.data.textdata import load_text_data, make_loader


class WordTokenizer:
    """A whitespace tokenizer standing in for a decoder's (pad 0, EOS 1)."""

    pad_token_id, eos_token_id, padding_side = 0, 1, "right"

    def __call__(self, text, add_special_tokens=True, truncation=False, max_length=None):
        ids = [2 + (hash(w) % 50) for w in text.split()]
        return {"input_ids": ids[:max_length] if truncation else ids}


@pytest.fixture(scope="module")
def minilm():
    return load_model("minilm", num_labels=3)


def test_bundled_tweets_splits_are_disjoint_and_labeled():
    train = load_text_data(DataConfig(), "classification")
    test = load_text_data(DataConfig(split="test"), "classification")
    assert train.label_names == ["negative", "neutral", "positive"]
    assert len(train) > 30000 and 3000 < len(test) < 4500
    assert not {e["text"] for e in test.examples[:200]} & {e["text"] for e in train.examples}
    assert {e["label"] for e in train.examples[:2000]} == {0, 1, 2}


def test_minilm_batches_fixed_and_dynamic_padding(minilm):
    assert minilm.task == "classification" and type(minilm.model).__name__ == "BertForSequenceClassification"
    data = load_text_data(DataConfig(max_samples=40), "classification")
    fixed = next(iter(make_loader(minilm, data, DataConfig(batch_size=8, max_length=96))))
    assert fixed["input_ids"].shape == (8, 96) and fixed["labels"].shape == (8,)
    lengths = fixed["attention_mask"].sum(1)
    assert (lengths < 96).all() and (fixed["attention_mask"][:, 0] == 1).all()  # right padding
    dyn = next(iter(make_loader(minilm, data, DataConfig(batch_size=8, padding="longest"))))
    assert dyn["input_ids"].shape[1] == int(lengths.max())


def test_local_files_and_column_detection(tmp_path, minilm):
    csv = tmp_path / "pairs.csv"
    csv.write_text("premise,hypothesis,label\nA cat sat.,An animal sat.,0\nIt rains.,It is dry.,2\nHi,Hello,1\n")
    data = load_text_data(DataConfig(dataset=str(csv)), "classification")
    assert data.identity["columns"]["text_pair_column"] == "hypothesis" and data.num_labels == 3
    batch = next(iter(make_loader(minilm, data, DataConfig(dataset=str(csv), padding="longest"))))
    sep = minilm.tokenizer.sep_token_id
    assert int((batch["input_ids"][0] == sep).sum()) == 2  # two segments
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps({"review": f"good {i}", "stars": i % 2}) for i in range(6)))
    data = load_text_data(DataConfig(dataset=str(jl), label_column="stars"), "classification")
    assert data.identity["columns"]["text_column"] == "review" and len(data) == 6
    pq = tmp_path / "d.parquet"
    import pandas as pd

    pd.DataFrame({"text": ["a b", "c d"], "label": ["x", "y"]}).to_parquet(pq)
    assert load_text_data(DataConfig(dataset=str(pq)), "classification").label_names == ["x", "y"]


def test_prompt_response_masks_prompt_tokens(tmp_path, minilm):
    f = tmp_path / "qa.jsonl"
    f.write_text(json.dumps({"prompt": "what is two plus two", "response": "four"}) + "\n")
    data = load_text_data(DataConfig(dataset=str(f)), "causal-lm")
    fake = type(minilm)(model=None, tokenizer=WordTokenizer(), task="causal-lm", name="fake", source="test")
    for side in ("right", "left"):
        b = next(iter(make_loader(fake, data, DataConfig(dataset=str(f), max_length=10, padding_side=side))))
        ids, labels, mask = b["input_ids"][0], b["labels"][0], b["attention_mask"][0]
        assert int(mask.sum()) == 7 and int((labels != -100).sum()) == 2  # "four" + EOS
        kept = labels[labels != -100]
        assert kept[-1] == 1 and (mask[labels != -100] == 1).all()
        assert (mask[:3] == 0).all() if side == "left" else (mask[-3:] == 0).all()


def test_pad_collator_left_right():
    items = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8], "labels": [8]}]
    right = PadCollator(0, "causal-lm", "longest", 16, "right")(items)
    left = PadCollator(0, "causal-lm", "max_length", 4, "left")(items)
    assert right["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert right["labels"].tolist() == [[-100, 6, 7], [-100, -100, -100]]  # first token: never a target
    assert left["input_ids"].tolist() == [[0, 5, 6, 7], [0, 0, 0, 8]]
    assert left["attention_mask"].tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]
    assert left["labels"].tolist() == [[-100, -100, 6, 7], [-100, -100, -100, -100]]


def test_pad_collator_rounds_the_longest_up_to_a_multiple():
    items = [{"input_ids": [5, 6, 7], "label": 1}, {"input_ids": [8], "label": 0}]
    four = PadCollator(0, "classification", "longest", 16, "right", multiple=4)(items)
    assert four["input_ids"].tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]] and four["labels"].tolist() == [1, 0]
    assert PadCollator(0, "classification", "longest", 5, "left", multiple=4)(items * 2)["input_ids"].shape == (4, 4)
    capped = PadCollator(0, "classification", "longest", 3, "right", multiple=8)(items)  # never past max_length
    assert capped["input_ids"].shape == (2, 3)
    assert PadCollator(0, "classification", "max_length", 6, "right", multiple=4)(items)["input_ids"].shape == (2, 6)


def test_left_padded_decoder_pads_carry_no_gradient():
    from tests.tiny_models import tiny_model

    model = tiny_model("llama")
    collate = PadCollator(0, "causal-lm", "longest", 16, "left")
    batch = collate([{"input_ids": list(range(3, 12)), "labels": list(range(3, 12))},
                     {"input_ids": [5, 6, 7], "labels": [5, 6, 7]}])
    grads = {}
    o_proj = model.model.layers[1].self_attn.o_proj
    o_proj.register_full_backward_hook(lambda m, gi, go: grads.update(dy=go[0].detach()))
    model(**batch).loss.backward()
    pads = batch["attention_mask"] == 0
    assert pads.sum() == 6
    assert (grads["dy"][pads] == 0).all()  # before the fix the pad left of the first token carried loss


@pytest.mark.parametrize("content,msg", [
    ("text,score\nhello,0.5\n", "no label column"),
    ("text,label\n", "has no rows"),
    ("words,label\n1,0\n2,1\n", "no text column"),
    ("text,label\nhi,0\nho,0\n", "fewer than 2 classes"),
])
def test_bad_datasets(tmp_path, content, msg):
    f = tmp_path / "bad.csv"
    f.write_text(content)
    with pytest.raises(AssetError, match=msg):
        load_text_data(DataConfig(dataset=str(f)), "classification")


def test_bad_names_give_one_line():
    for bad, msg in [("/no/such/model", "does not exist"), ("./missing", "does not exist")]:
        with pytest.raises(AssetError, match=msg):
            load_model(bad)
    with pytest.raises(AssetError, match="does not exist"):
        load_text_data(DataConfig(dataset="/no/such/file.csv"), "classification")
    with pytest.raises(AssetError, match="column 'nope'"):
        load_text_data(DataConfig(label_column="nope"), "classification")
    with pytest.raises(AssetError, match="unknown task"):
        load_model("minilm", task="regression")
    with pytest.raises(ValueError, match="padding"):
        DataConfig(padding="dynamic")


def test_model_identity_distinguishes_models(minilm):
    from tests.tiny_models import tiny_model

    a, b = model_identity(minilm.model), model_identity(tiny_model("bert"))
    assert a["model_type"] == b["model_type"] == "bert"
    assert a["linear_fingerprint"] != b["linear_fingerprint"]
    assert a == model_identity(minilm.model)


@pytest.mark.slow
def test_smollm2_loads_offline_from_bundled_gguf(tmp_path_factory):
    s = load_model("smollm2")
    assert s.task == "causal-lm" and type(s.model).__name__ == "LlamaForCausalLM"
    assert s.tokenizer.pad_token_id is not None
    data = load_text_data(DataConfig(max_samples=4), "causal-lm")
    b = next(iter(make_loader(s, data, DataConfig(max_length=24, batch_size=4, padding="longest"))))
    with torch.no_grad():
        loss = s.model(**b).loss
    assert torch.isfinite(loss) and 0.5 < loss.item() < 12


def test_eval_split_labels_use_the_training_classes(tmp_path):
    train = load_text_data(DataConfig(), "classification")
    test = load_text_data(DataConfig(split="test", max_samples=3), "classification", label_names=train.label_names)
    assert test.label_names == train.label_names
    for e in test.examples:  # ids mean the same classes as in train
        assert 0 <= e["label"] < 3
    f = tmp_path / "d.csv"
    f.write_text("text,label\na,x\nb,z\n")
    with pytest.raises(AssetError, match="training split does not have"):
        load_text_data(DataConfig(dataset=str(f)), "classification", label_names=["x", "y"])


def test_prompts_longer_than_max_length_are_refused_not_nan(tmp_path, minilm):
    f = tmp_path / "qa.jsonl"
    f.write_text(json.dumps({"prompt": "one two three four five six", "response": "seven"}) + "\n")
    data = load_text_data(DataConfig(dataset=str(f)), "causal-lm")
    fake = type(minilm)(model=None, tokenizer=WordTokenizer(), task="causal-lm", name="fake", source="test")
    with pytest.raises(AssetError, match="no target token"):
        make_loader(fake, data, DataConfig(dataset=str(f), max_length=4))


def test_hub_dataset_names_reach_the_loader(monkeypatch):
    """Hub names of one, two and three parts and repo:config are tried as (repository, configuration) pairs
    (until 2026-11-22 one- and two-part names such as imdb and glue/sst2 raised IndexError before loading)."""
    import sys
    import types

    from sebp_probe.data.textdata import hub_candidates

    assert hub_candidates("imdb") == [("imdb", None)]
    assert hub_candidates("glue/sst2") == [("glue", "sst2"), ("glue/sst2", None)]
    assert hub_candidates("owner/repo/cfg") == [("owner/repo", "cfg")]
    assert hub_candidates("glue:sst2") == [("glue", "sst2")]
    calls = []

    def load_dataset(repo, conf, split):
        calls.append((repo, conf, split))
        if (repo, conf) in {("imdb", None), ("glue", "sst2")}:
            return [{"sentence" if conf else "text": f"sample {i}", "label": i % 2} for i in range(6)]
        raise FileNotFoundError(f"Dataset '{repo}' doesn't exist on the Hub\nsecond line")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    for name in ("imdb", "glue/sst2"):
        data = load_text_data(DataConfig(dataset=name), "classification")
        assert len(data) == 6 and data.examples[0]["text"] == "sample 0", name
    assert ("imdb", None, "train") in calls and ("glue", "sst2", "train") in calls
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):  # online, the hub's own reason is the message
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(AssetError, match=r"cannot load dataset 'nosuch/thing'.*doesn't exist") as e:
        load_text_data(DataConfig(dataset="nosuch/thing"), "classification")
    assert "\n" not in str(e.value)
    assert calls[-2:] == [("nosuch", "thing", "train"), ("nosuch/thing", None, "train")]


def test_classification_head_labels(tmp_path):
    """Label names size the head and name its outputs; a checkpoint whose classification head has another
    number of labels is refused in one line (transformers' own error pointed at a report it did not print)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertConfig

    from sebp_probe.data.assets import minilm_dir

    tok = AutoTokenizer.from_pretrained(minilm_dir())
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                     intermediate_size=40, max_position_embeddings=64, num_labels=3)
    path = tmp_path / "cls3"
    AutoModelForSequenceClassification.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    m = load_model(str(path), "classification", label_names=["negative", "neutral", "positive"])
    assert m.model.config.id2label == {0: "negative", 1: "neutral", 2: "positive"}
    assert m.model.config.label2id["positive"] == 2
    with pytest.raises(AssetError, match="has a 3-label classification head but the dataset has 2 labels"):
        load_model(str(path), "classification", label_names=["no", "yes"])
    base = load_model("minilm", "classification", label_names=["no", "yes"])  # a base model: a new head
    assert base.model.config.num_labels == 2 and base.model.config.id2label[1] == "yes"
