"""The bucket sampler, best-fit-decreasing rows, the packed collator and the padding share per strategy."""
from __future__ import annotations

import random

import pytest
import torch

from sebp_probe.data.batching import (LengthGroupedBatchSampler, PackedCollator, PackingError, PadCollator,
                                 length_grouped_batches, pack_rows, padding_share, random_batches)
from sebp_probe.layouts import LAYOUTS


def skewed(n: int = 1000, seed: int = 0) -> list[int]:
    """Most examples short, a long tail: the lengths where padding to the batch's longest wastes most."""
    rng = random.Random(seed)
    return [min(128, max(2, int(rng.lognormvariate(3.0, 0.8)))) for _ in range(n)]


def _padded_slots(lens, batches) -> int:
    return sum(len(b) * max(lens[i] for i in b) for b in batches)


def test_bucket_sampler_is_a_pure_function_of_seed_and_epoch():
    lens = skewed(500)
    s = LengthGroupedBatchSampler(lens, 16, seed=3)
    s.set_epoch(2)
    first = list(s)
    again = LengthGroupedBatchSampler(lens, 16, seed=3)
    again.set_epoch(2)
    assert list(again) == first == list(s)
    s.set_epoch(3)
    assert list(s) != first
    assert list(LengthGroupedBatchSampler(lens, 16, seed=4)) != list(LengthGroupedBatchSampler(lens, 16, seed=3))


@pytest.mark.parametrize("n, bs", [(500, 16), (37, 8), (8, 8), (5, 8), (801, 16)])
def test_bucket_sampler_takes_every_index_once(n, bs):
    lens = skewed(n)
    s = LengthGroupedBatchSampler(lens, bs, seed=1)
    batches = list(s)
    assert sorted(i for b in batches for i in b) == list(range(n))
    assert len(s) == len(batches) == -(-n // bs)
    assert sum(len(b) < bs for b in batches) == (n % bs != 0)  # one short batch at most
    kept = list(LengthGroupedBatchSampler(lens, bs, seed=1, drop_last=True))
    assert len(kept) == len(LengthGroupedBatchSampler(lens, bs, drop_last=True)) == n // bs
    assert all(len(b) == bs for b in kept)


def test_bucket_batches_hold_similar_lengths_and_the_longest_comes_first():
    lens = skewed(2000)
    bucket = length_grouped_batches(lens, 16, seed=0)
    rand = random_batches(len(lens), 16, seed=0)
    assert max(lens[i] for i in bucket[0]) == max(lens)
    # far less padding than random batches: on these lengths, random batches are mostly padding
    waste = lambda bs: 1 - sum(lens) / _padded_slots(lens, bs)  # noqa: E731
    assert waste(rand) > 0.5 and waste(bucket) < 0.1
    # batches are not in length order: the next batch's length is random
    tops = [max(lens[i] for i in b) for b in bucket[1:]]
    assert tops != sorted(tops) and tops != sorted(tops, reverse=True)


def test_bucket_sampler_drives_a_dataloader():
    items = [{"input_ids": list(range(2, 2 + n)), "label": n % 3} for n in skewed(100)]
    sampler = LengthGroupedBatchSampler([len(i["input_ids"]) for i in items], 8, seed=0)
    loader = torch.utils.data.DataLoader(items, batch_sampler=sampler,
                                         collate_fn=PadCollator(0, "classification", "longest", 128, "right"))
    batches = list(loader)
    assert len(batches) == len(loader) == 13
    assert sum(int(b["attention_mask"].sum()) for b in batches) == sum(len(i["input_ids"]) for i in items)


def test_best_fit_decreasing_rows():
    assert pack_rows([6, 5, 4, 3, 2], 10) == [[0, 2], [1, 3, 4]]  # 6+4, 5+3+2
    assert pack_rows([8, 3, 2], 12) == [[0], [1, 2]]  # 2 rows of 8 rather than 11 + 2, padded to 11
    lens = skewed(300)
    rows = pack_rows(lens, 128)
    assert sorted(i for r in rows for i in r) == list(range(300))
    assert all(sum(lens[i] for i in r) <= 128 for r in rows)
    assert len(rows) <= -(-sum(lens) // 128) + 1  # about as few rows as the tokens need
    with pytest.raises(PackingError, match="does not fit the packing budget of 10"):
        pack_rows([4, 11], 10)


def test_packed_collator_lays_out_causal_batches():
    items = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
             {"input_ids": [8, 9, 10, 11, 12], "labels": [8, 9, 10, 11, 12]},
             {"input_ids": [13, 14], "labels": [-100, 14]}]
    b = PackedCollator(pad_id=0, task="causal-lm", max_length=6)(items)
    # best fit decreasing into rows of 6: [5 tokens] | [3 + 2 tokens]; rows padded to the fullest (5)
    assert b["input_ids"].tolist() == [[8, 9, 10, 11, 12], [5, 6, 7, 13, 14]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    assert b["sequence_ids"].tolist() == [[0, 0, 0, 0, 0], [1, 1, 1, 2, 2]]
    assert b["labels"].tolist() == [[-100, 9, 10, 11, 12], [-100, 6, 7, -100, 14]]
    assert b["cu_seqlens"].tolist() == [0, 5, 8, 10] and b["cu_seqlens"].dtype == torch.int32
    # max_seqlen: the longest (5) rounded up to its bucket, a plain int
    assert b["order"].tolist() == [1, 0, 2] and b["max_seqlen"] == 16 and type(b["max_seqlen"]) is int
    # labels set at positions 1-4 | 1, 2, 4: the positions before them predict them
    assert (b["n_targets"], b["max_row_targets"]) == (7, 4)
    assert type(b["n_targets"]) is int and type(b["max_row_targets"]) is int
    assert b["input_ids"].reshape(-1)[b["flat_index"]].tolist() == [8, 9, 10, 11, 12, 5, 6, 7, 13, 14]


def test_packed_collator_row_tails():
    items = [{"input_ids": [3] * 4, "label": 0}, {"input_ids": [4] * 5, "label": 1}, {"input_ids": [5] * 3, "label": 2}]
    b = PackedCollator(pad_id=1, task="classification", max_length=8)(items)
    # two rows either way; rows of 7 rather than 8 leave 2 tail tokens rather than 4
    assert b["input_ids"].tolist() == [[4, 4, 4, 4, 4, 1, 1], [3, 3, 3, 3, 5, 5, 5]]
    assert b["sequence_ids"][0].tolist() == [0, 0, 0, 0, 0, -1, -1]
    assert b["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 0]  # each tail token a sequence of its own
    assert b["labels"].tolist() == [1, 0, 2]  # one label per sequence, in layout order
    assert b["input_ids"].reshape(-1)[b["flat_index"]].tolist() == [4] * 5 + [3] * 4 + [5] * 3


def test_packing_budget_below_the_max_length_is_one_line():
    with pytest.raises(PackingError) as e:
        PackedCollator(0, "causal-lm", max_length=128, budget=64)
    msg = str(e.value)
    assert isinstance(e.value, ValueError) and "\n" not in msg and "budget" in msg and "128" in msg
    with pytest.raises(PackingError, match="does not fit"):
        PackedCollator(0, "causal-lm", max_length=4)([{"input_ids": [1] * 5, "labels": [1] * 5}])


def test_padding_share_on_known_batches():
    assert padding_share([10] * 12, 4, 32, "max_length") == pytest.approx(1 - 10 / 32)
    assert padding_share([10] * 12, 4, 32, "longest") == 0.0
    assert padding_share([10] * 12, 4, 32, "bucket") == 0.0
    # 4 sequences of 10 need 2 rows of at most 32: 2 rows of 20 rather than 30 + 10 padded to 30
    assert padding_share([10] * 12, 4, 32, "packed") == 0.0
    assert padding_share([10, 10, 10, 7], 4, 32, "packed") == pytest.approx(1 - 37 / 40)
    # lengths beyond max_length are cut, as tokenizing does
    assert padding_share([50, 50], 2, 32, "longest") == 0.0
    with pytest.raises(ValueError, match="unknown layout"):
        padding_share([3], 1, 8, "sorted")


def test_padding_share_ranks_the_layouts_on_skewed_lengths():
    lens = skewed(2000)
    share = {s: padding_share(lens, 32, 128, s, seed=1) for s in LAYOUTS}
    assert share["max_length"] > share["longest"] > share["bucket"] > share["packed"]
    assert share["longest"] > 0.5 and share["bucket"] < 0.1 and share["packed"] < 0.05
    assert padding_share(lens, 32, 128, "packed", seed=1) == share["packed"]  # deterministic


def test_seqlen_bound_is_the_power_of_two_at_or_above():
    from sebp_probe.data.batching import seqlen_bound

    assert [seqlen_bound(n) for n in (1, 16, 17, 1000, 1024, 1025, 2048)] == [16, 16, 32, 1024, 1024, 2048, 2048]


def test_padded_lengths_round_up_to_the_multiple_within_max_length():
    from sebp_probe.data.batching import PadCollator, padded_length

    assert [padded_length(n, 30, 8) for n in (1, 8, 9, 23, 25, 30)] == [8, 8, 16, 24, 30, 30]
    assert padded_length(13, 64, 1) == 13
    items = [{"input_ids": list(range(3, 3 + n)), "label": 0} for n in (5, 11)]
    assert PadCollator(0, "classification", "longest", 64, "right", 8)(items)["input_ids"].shape == (2, 16)
    # the padding share counts the rounded lengths: 3 sequences of 10 padded to 16
    assert padding_share([10] * 3, 3, 32, "longest", multiple=8) == pytest.approx(1 - 10 / 16)


def test_a_run_s_most_rows_come_from_its_longest_example_as_padded():
    """most_rows: batch size x the longest training example, padded as the run pads (a multiple of 8 when
    compiled) and at most max_length; batch size x max_length where every batch has that shape."""
    from sebp_probe.config import DataConfig, FinetuneConfig
    from sebp_probe.data.train_data import most_rows
    from tests.convergence.finetune_helpers import synthetic_data

    data = synthetic_data("classification", n=40, max_len=21, min_len=21)  # every example 21 tokens

    def cfg(padding, **kw):
        return FinetuneConfig(data=DataConfig(max_length=128, batch_size=8, padding=padding), **kw)

    assert most_rows(cfg("longest"), data) == 8 * 21
    assert most_rows(cfg("longest", compile="default"), data) == 8 * 24
    assert most_rows(cfg("max_length", compile="default"), data) == 8 * 128
    assert most_rows(cfg("auto", compile="default"), data, "bucket") == 8 * 24
    short = FinetuneConfig(data=DataConfig(max_length=16, batch_size=8, padding="longest"), compile="default")
    assert most_rows(short, data) == 8 * 16  # truncated to max_length


def test_compiled_runs_pad_to_the_compile_multiple():
    from sebp_probe.config import FinetuneConfig
    from sebp_probe.data.batching import COMPILE_MULTIPLE
    from sebp_probe.data.train_data import pad_multiple

    assert COMPILE_MULTIPLE == 8
    assert pad_multiple(FinetuneConfig()) == 1
    assert pad_multiple(FinetuneConfig(compile="default")) == COMPILE_MULTIPLE
    assert pad_multiple(FinetuneConfig(compile="max-autotune-no-cudagraphs")) == COMPILE_MULTIPLE
    assert pad_multiple(FinetuneConfig(compile="reduce-overhead")) == COMPILE_MULTIPLE
    graphs = FinetuneConfig(cuda_graphs=True, compile="default")
    assert pad_multiple(graphs) == graphs.graph_bucket
