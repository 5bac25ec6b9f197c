"""The parts of the batch layouts (:mod:`.layouts` names them): the padding collator, the bucket sampler
(batches of similar lengths), the packed collator (the batch's sequences concatenated into rows of a token
budget, padding-free), and the padding each layout leaves.

Under the layouts that are not ``grouped`` (``max_length``, ``longest``, ``packed``) a step trains on the same
``batch_size`` sequences (the training sampler draws them); the layout only lays them out, so the step's loss is
the same. ``bucket`` draws other batches: sequences of similar length together.

Training loader per layout (``items`` from :func:`~sebp_probe.data.textdata.tokenize`; :mod:`.train_data`)::

    not grouped: DataLoader(items, batch_size=bs, sampler=EpochSampler(len(items), seed), collate_fn=collate)
    grouped:     DataLoader(items, batch_sampler=LengthGroupedBatchSampler(lengths(items), bs, seed),
                            collate_fn=collate)

with ``collate = collator(layout, pad_id, task, max_length, side)``; each packed batch's loss is
:func:`sebp_probe.model.packing.packed_loss`.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

import torch

from ..layouts import LAYOUTS, Layout

MEGABATCH = 50  # batches per megabatch of the bucket sampler: wide enough to find similar lengths, still random


class PackingError(ValueError):
    """Sequences that cannot be packed, or a model the packed layout cannot run exactly; one line for the user."""


def lengths(items: Sequence[dict]) -> list[int]:
    """Token count of each tokenized example."""
    return [len(it["input_ids"]) for it in items]


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """The generator of an epoch's order, a pure function of (seed, epoch) so that a resumed run replays it
    (seeded as the training loop's ``EpochSampler``)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + epoch)


def random_batches(n: int, batch_size: int, seed: int, epoch: int = 0) -> list[list[int]]:
    """The batches of an epoch under the layouts that are not ``grouped``: a random permutation in chunks."""
    perm = torch.randperm(n, generator=epoch_generator(seed, epoch)).tolist()
    return [perm[i: i + batch_size] for i in range(0, n, batch_size)]


def length_grouped_batches(lens: Sequence[int], batch_size: int, seed: int, epoch: int = 0,
                           megabatch: int = MEGABATCH, drop_last: bool = False) -> list[list[int]]:
    """An epoch's batches of similar lengths: a random permutation cut into megabatches of ``megabatch``
    batches, each sorted by length (longest first) and cut into batches; then the batches in random order,
    except that the one holding the longest sequence comes first (a run that runs out of memory does so at
    once). Every index once; only the last batch of the last megabatch can be short (dropped with
    ``drop_last``)."""
    if batch_size < 1 or megabatch < 1:
        raise ValueError(f"batch size and megabatch must be >= 1, got {batch_size} and {megabatch}")
    g = epoch_generator(seed, epoch)
    perm = torch.randperm(len(lens), generator=g).tolist()
    size = megabatch * batch_size
    batches = []
    for m in range(0, len(perm), size):
        group = sorted(perm[m: m + size], key=lambda i: -lens[i])
        batches += [group[i: i + batch_size] for i in range(0, len(group), batch_size)]
    if drop_last and batches and len(batches[-1]) < batch_size:
        batches.pop()
    batches = [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]
    if batches:
        first = max(range(len(batches)), key=lambda b: max(lens[i] for i in batches[b]))
        batches.insert(0, batches.pop(first))
    return batches


class LengthGroupedBatchSampler(torch.utils.data.Sampler):
    """The ``bucket`` strategy's batch sampler (a DataLoader's ``batch_sampler``): the batches of
    :func:`length_grouped_batches`, a pure function of (seed, epoch)."""

    def __init__(self, lens: Sequence[int], batch_size: int, seed: int = 0, megabatch: int = MEGABATCH,
                 drop_last: bool = False):
        self.lens, self.batch_size, self.seed = list(lens), batch_size, seed
        self.megabatch, self.drop_last, self.epoch = megabatch, drop_last, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        return iter(length_grouped_batches(self.lens, self.batch_size, self.seed, self.epoch, self.megabatch,
                                           self.drop_last))

    def __len__(self) -> int:
        n, bs = len(self.lens), self.batch_size
        return n // bs if self.drop_last else -(-n // bs)


HOST_COUNTS = ("n_targets", "max_row_targets")  # ints a batch may carry for the labelled-rows head


def target_counts(labels: torch.Tensor) -> dict[str, int]:
    """A causal-LM batch's ``n_targets`` and ``max_row_targets``: the positions whose next token carries a label
    (what the labelled-rows head computes), in all and the most in one row, as Python ints, so that no step
    reads them from the device (:func:`sebp_probe.model.heads.head_loss`; under ``torch.compile``, no graph break)."""
    per_row = (labels[:, 1:] != -100).sum(1)
    return {"n_targets": int(per_row.sum()), "max_row_targets": int(per_row.max()) if per_row.numel() else 0}


def padded_length(longest: int, max_length: int, multiple: int) -> int:
    """A padded batch's length: ``longest`` rounded up to a multiple of ``multiple``, but not past ``max_length``
    (nor below ``longest``)."""
    return max(longest, min(max_length, -(-longest // multiple) * multiple))


class PadCollator:
    """Pads token lists into a batch: to ``max_length`` or the batch's longest, on the left or right; with
    ``multiple``, the longest rounded up to a multiple of it (at most ``max_length``): fewer batch shapes.
    ``counts``: causal-LM batches carry :func:`target_counts` too (what a compiled labelled-rows head reads)."""

    def __init__(self, pad_id: int, task: str, padding: str, max_length: int, side: str, multiple: int = 1,
                 counts: bool = False):
        self.pad_id, self.task, self.padding, self.max_length, self.side = pad_id, task, padding, max_length, side
        self.multiple, self.counts = multiple, counts and task == "causal-lm"

    def __call__(self, items: list[dict]) -> dict:
        L = self.max_length
        if self.padding != "max_length":
            longest = max(len(i["input_ids"]) for i in items)
            L = padded_length(longest, self.max_length, self.multiple)
        ids = torch.full((len(items), L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), L), dtype=torch.long)
        labels = torch.full((len(items), L), -100, dtype=torch.long) if self.task == "causal-lm" else None
        for row, it in enumerate(items):
            n = len(it["input_ids"])
            sl = slice(0, n) if self.side == "right" else slice(L - n, L)
            ids[row, sl] = torch.tensor(it["input_ids"])
            mask[row, sl] = 1
            if labels is not None:
                labels[row, sl] = torch.tensor(it["labels"])
                # A causal LM shifts labels by one: the first real token is predicted by the position before
                # it, a pad under left padding. Mask it, so pads never carry loss (as under right padding).
                labels[row, sl.start] = -100
        batch = {"input_ids": ids, "attention_mask": mask}
        if labels is not None:
            batch["labels"] = labels
            if self.counts:
                batch.update(target_counts(labels))
        elif self.task == "classification":
            batch["labels"] = torch.tensor([it["label"] for it in items])
        return batch  # mlm: labels come with the masking (sebp_probe.data.mlm.MLMCollator)


def _best_fit_decreasing(lens: Sequence[int], budget: int) -> list[list[int]]:
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free tokens, row), sorted: the first that fits is the fullest that fits
    for i in sorted(range(len(lens)), key=lambda i: -lens[i]):
        at = bisect.bisect_left(free, (lens[i], -1))
        if at == len(free):
            rows.append([i])
            bisect.insort(free, (budget - lens[i], len(rows) - 1))
        else:
            left, r = free.pop(at)
            rows[r].append(i)
            bisect.insort(free, (left - lens[i], r))
    return rows


def pack_rows(lens: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of ``lens`` per row of at most ``budget`` tokens: best-fit decreasing (longest first, each into
    the fullest row it fits) finds few rows; then the shortest row length that keeps that many rows, so that
    the rows, padded to the fullest, fill evenly (the last row alone would otherwise leave most of a row
    padding)."""
    longest = max(lens, default=0)
    if longest > budget:
        raise PackingError(f"a sequence of {longest} tokens does not fit the packing budget of {budget} tokens; "
                           "set the budget to at least the max length")
    rows = _best_fit_decreasing(lens, budget)
    lo, hi = max(longest, -(-sum(lens) // max(len(rows), 1))), budget
    while lo < hi:  # hi always packs into len(rows) rows
        mid = (lo + hi) // 2
        if len(_best_fit_decreasing(lens, mid)) <= len(rows):
            hi = mid
        else:
            lo = mid + 1
    return _best_fit_decreasing(lens, hi) if hi < budget else rows


def seqlen_bound(longest: int) -> int:
    """A packed batch's ``max_seqlen``: the power of two at or above ``longest`` (at least 16). The varlen
    kernel takes it as a bound (its grid covers that many rows per sequence, and the blocks past a sequence's
    end do nothing), so the result is the same. A compiled step takes it as a symbol (torch's varlen operator
    declares it a SymInt): Llama-1B's packed batches of the bench's pool, in three buckets, recompiled no layer on
    an H200 once the layers compiled without the size-guarded fusion
    (results/model_compiled.json, run llama-3.2-1b-sft_cce)."""
    return max(16, 1 << max(int(longest) - 1, 0).bit_length())


# Padded batches of a compiled run: lengths a multiple of this. Inductor specializes a graph compiled with dynamic
# shapes on whether the sequence length is a multiple of 8 (its aligned loads, and the lookup of its compiled
# code): on an H200 a Llama-1B and a Qwen2.5-0.5B layer compiled on `longest` batches recompiled at the first
# batch whose length was not (as TORCH_LOGS=recompiles shows).
COMPILE_MULTIPLE = 8


class PackedCollator:
    """Packs a batch's token lists into rows of at most ``budget`` tokens (default ``max_length``) by
    :func:`pack_rows`, padded to the fullest row. The batch holds, with n sequences in layout order (row by
    row) and T of their tokens:

    - ``input_ids``, ``position_ids`` [rows, L]: positions restart at 0 for each sequence; the row's tail is
      ``pad_id`` at position 0 (a token of its own to a causal mask, as a position change starts a sequence);
    - ``sequence_ids`` [rows, L]: the sequence of each token (0..n-1), -1 on the tail;
    - ``labels``: causal LM [rows, L], -100 on prompts, tails and each sequence's first token (its label would
      be predicted from the sequence before it); classification [n];
    - ``cu_seqlens`` (int32 [n+1]): where each sequence starts among the T tokens taken row by row;
      ``flat_index`` [T]: those tokens' places in ``input_ids.view(-1)``; ``max_seqlen``: an int, the
      longest sequence's length rounded up (:func:`seqlen_bound`);
    - ``order`` [n]: the place in the collated list of each sequence;
    - causal LM: ``n_targets``, ``max_row_targets`` (ints): the positions whose next token carries a label (what
      the labelled-rows head computes), in all and the most in one row, so that no step reads them from the
      device (:func:`sebp_probe.model.heads.head_loss`).

    Real tokens: ``int(cu_seqlens[-1])``; token slots: ``input_ids.numel()``.
    """

    def __init__(self, pad_id: int, task: str, max_length: int, budget: int | None = None):
        budget = max_length if budget is None else budget
        if budget < max_length:
            raise PackingError(f"a packing budget of {budget} tokens is below the max length of {max_length}; "
                               "set the budget to at least the max length")
        self.pad_id, self.task, self.budget = pad_id, task, budget

    def __call__(self, items: list[dict]) -> dict:
        lens = lengths(items)
        rows = pack_rows(lens, self.budget)
        L = max(sum(lens[i] for i in r) for r in rows)
        ids = torch.full((len(rows), L), self.pad_id, dtype=torch.long)
        pos = torch.zeros((len(rows), L), dtype=torch.long)
        seq = torch.full((len(rows), L), -1, dtype=torch.long)
        causal = self.task == "causal-lm"
        labels = torch.full((len(rows), L), -100, dtype=torch.long) if causal else None
        order, flat = [], []
        for r, row in enumerate(rows):
            at = 0
            for i in row:
                n = lens[i]
                ids[r, at: at + n] = torch.tensor(items[i]["input_ids"])
                pos[r, at: at + n] = torch.arange(n)
                seq[r, at: at + n] = len(order)
                if causal:
                    labels[r, at: at + n] = torch.tensor(items[i]["labels"])
                    labels[r, at] = -100
                flat.append(torch.arange(r * L + at, r * L + at + n))
                order.append(i)
                at += n
        seq_lens = torch.tensor([lens[i] for i in order])
        cu = torch.zeros(len(order) + 1, dtype=torch.int32)
        cu[1:] = seq_lens.cumsum(0)
        batch = {"input_ids": ids, "position_ids": pos, "sequence_ids": seq, "labels": labels, "cu_seqlens": cu,
                 "flat_index": torch.cat(flat), "max_seqlen": seqlen_bound(int(seq_lens.max())),
                 "order": torch.tensor(order)}
        if causal:  # a row's position t predicts label t + 1; each sequence's first label is -100, the tail's too
            batch.update(target_counts(labels))
        else:
            batch["labels"] = torch.tensor([items[i]["label"] for i in order])
        return batch


def batch_order(layout: Layout, lens: Sequence[int], batch_size: int, seed: int, epoch: int = 0) -> list[list[int]]:
    """The indices of each batch of an epoch under ``layout``, as its training sampler draws them."""
    if layout.grouped:
        return length_grouped_batches(lens, batch_size, seed, epoch)
    return random_batches(len(lens), batch_size, seed, epoch)


def collator(layout: Layout, pad_id: int, task: str, max_length: int, side: str = "right", multiple: int = 1,
             counts: bool = False):
    """The collate function of ``layout``'s batches (``side``, ``multiple`` and ``counts`` as
    :class:`PadCollator` takes them; packed rows take none: they always carry their counts)."""
    if layout.packed:
        return PackedCollator(pad_id, task, max_length)
    return PadCollator(pad_id, task, layout.pad_to, max_length, side, multiple, counts)


def layout_counts(lens: Sequence[int], batch_size: int, max_length: int, layout: str, seed: int = 0,
                  budget: int | None = None, multiple: int = 1) -> tuple[int, int, int, int]:
    """(batches, rows, token slots, real tokens) of an epoch (epoch 0 of ``seed``) under ``layout`` (a name of
    :data:`~sebp_probe.layouts.LAYOUTS`), for examples of ``lens`` tokens (cut to ``max_length``, as tokenizing
    does) in batches of ``batch_size``; ``budget``: the packed rows' (default ``max_length``); ``multiple``: padded
    lengths rounded up to a multiple of it, as :class:`PadCollator` rounds them."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    lay = LAYOUTS[layout]
    lens = [min(int(n), max_length) for n in lens]
    real = sum(lens)
    if not real:
        raise ValueError("no tokens to lay out")
    batches = rows = slots = 0
    for b in batch_order(lay, lens, batch_size, seed):
        bl = [lens[i] for i in b]
        batches += 1
        if lay.packed:
            packed = pack_rows(bl, max_length if budget is None else budget)
            rows += len(packed)
            slots += len(packed) * max(sum(bl[i] for i in r) for r in packed)
        else:
            longest = max_length if lay.pad_to == "max_length" else padded_length(max(bl), max_length, multiple)
            rows += len(b)
            slots += len(b) * longest
    return batches, rows, slots, real


def padding_share(lens: Sequence[int], batch_size: int, max_length: int, layout: str, seed: int = 0,
                  budget: int | None = None, multiple: int = 1) -> float:
    """Share of the token slots of an epoch that hold padding under ``layout`` (arguments as
    :func:`layout_counts`)."""
    _, _, slots, real = layout_counts(lens, batch_size, max_length, layout, seed, budget, multiple)
    return 1.0 - real / slots
