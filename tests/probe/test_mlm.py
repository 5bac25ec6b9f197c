"""Masked-LM batches: the 15% / 80-10-10 scheme, seeded; loading with task mlm; the head path on a real BERT."""
from __future__ import annotations

import json

import pytest
import torch

from sebp_probe.data.assets import load_model
from sebp_probe.data.batching import PadCollator
from sebp_probe.config import DataConfig
from sebp_probe.model.heads import head_loss
from sebp_probe.data.mlm import MLMCollator, mask_tokens
from sebp_probe.data.textdata import load_text_data, make_loader

SPECIAL = (0, 101, 102)  # pad, [CLS], [SEP]
MASK, VOCAB = 103, 1000


def _ids(rows=400, length=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(200, VOCAB, (rows, length), generator=g)
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=g)
    mask = (torch.arange(length)[None] < lengths[:, None]).long()
    ids[:, 0] = 101
    ids[torch.arange(rows), lengths - 1] = 102
    return ids.masked_fill(mask == 0, 0), mask


def _mask(ids, mask, seed):
    return mask_tokens(ids, mask_token_id=MASK, vocab_size=VOCAB, special_ids=SPECIAL, attention_mask=mask,
                       generator=torch.Generator().manual_seed(seed))


def test_standard_scheme_proportions_and_exclusions():
    ids, mask = _ids()
    before = ids.clone()
    out, labels = _mask(ids, mask, seed=1)
    assert torch.equal(ids, before)  # the input is left alone
    chosen = labels != -100
    eligible = (mask == 1) & ~torch.isin(ids, torch.tensor(SPECIAL))
    assert not (chosen & ~eligible).any()  # never padding or special tokens
    assert torch.equal(labels[chosen], ids[chosen])
    assert torch.equal(out[~chosen], ids[~chosen])
    share = chosen.sum() / eligible.sum()
    assert 0.14 < share < 0.16
    n = chosen.sum()
    masked = (out[chosen] == MASK).sum() / n
    unchanged = (out[chosen] == ids[chosen]).sum() / n  # includes random draws that hit the same token (0.1%)
    assert 0.78 < masked < 0.82 and 0.085 < unchanged < 0.115
    assert 0.085 < 1 - masked - unchanged < 0.115  # random tokens


def test_seeded_and_deterministic():
    ids, mask = _ids(rows=8, length=40)
    a, b, c = _mask(ids, mask, 5), _mask(ids, mask, 5), _mask(ids, mask, 6)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[1], c[1])


def test_collator_pads_then_masks_and_advances_its_generator():
    items = [{"input_ids": [101, 5, 6, 7, 8, 9, 102], "labels": [0] * 7},
             {"input_ids": [101, 4, 102], "labels": [0] * 3}]
    collate = MLMCollator(PadCollator(0, "mlm", "longest", 16, "right"), MASK, VOCAB, SPECIAL, seed=0,
                          probability=0.5)
    first = collate(items)
    assert set(first) == {"input_ids", "attention_mask", "labels"} and first["input_ids"].shape == (2, 7)
    assert (first["labels"][first["attention_mask"] == 0] == -100).all()
    again = MLMCollator(PadCollator(0, "mlm", "longest", 16, "right"), MASK, VOCAB, SPECIAL, seed=0,
                        probability=0.5)(items)
    assert torch.equal(first["labels"], again["labels"])  # same seed, same first batch


def test_bad_probability_and_tokenizer_without_mask():
    ids, mask = _ids(rows=2, length=8)
    with pytest.raises(ValueError, match="probability"):
        mask_tokens(ids, mask_token_id=MASK, vocab_size=VOCAB, probability=1.5)

    class NoMask:
        mask_token_id = None

    with pytest.raises(ValueError, match="no mask token"):
        MLMCollator.for_tokenizer(NoMask(), lambda items: items)


def test_minilm_as_masked_lm_end_to_end(tmp_path):
    """The bundled BERT loaded with task mlm, batches from make_loader, the head path's loss = the model's."""
    loaded = load_model("minilm", task="mlm")
    assert loaded.task == "mlm" and type(loaded.model).__name__ == "BertForMaskedLM"
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(json.dumps({"text": f"the quick brown fox number {i} jumps over the lazy dog"})
                           for i in range(8)))
    cfg = DataConfig(dataset=str(f), batch_size=4, max_length=24, padding="longest")
    data = load_text_data(cfg, "mlm")
    batch = next(iter(make_loader(loaded, data, cfg)))
    again = next(iter(make_loader(loaded, data, cfg)))
    assert torch.equal(batch["labels"], again["labels"])
    assert (batch["labels"] != -100).any() and (batch["labels"][batch["attention_mask"] == 0] == -100).all()
    model = loaded.model
    want = model(**batch).loss
    got = head_loss(model, batch, "mlm")
    assert got.labelled == int((batch["labels"] != -100).sum())
    assert abs(got.loss.item() - want.item()) <= 1e-6 * want.item()
