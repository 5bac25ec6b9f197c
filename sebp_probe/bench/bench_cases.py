"""Whole-model benchmark cases: architectures, realistic lengths, the batches of every layout made from one pool
of sequences, the FLOP count behind each layout's limit, and what the results sum up to. No timing here
(:mod:`.bench_model`), no CLI.

Same data for every layout: a case samples one pool of ``batch x n_batches`` sequences (lengths from its
distribution, random tokens, labels as fine-tuning has them), and every layout lays out that pool:

- ``max_length``, ``longest``, ``packed``: the pool in random order cut into ``n_batches`` batches of ``batch``
  sequences (:func:`~sebp_probe.data.batching.random_batches`, the training sampler's order), padded to
  ``max_length``, to each batch's longest, or packed into rows of at most ``max_length`` tokens
  (:class:`~sebp_probe.data.batching.PackedCollator`);
- ``bucket``: the same pool regrouped by length (:func:`~sebp_probe.data.batching.length_grouped_batches`). The pool
  is smaller than the sampler's megabatch, so it is sorted whole: training sorts 50 batches at a time and gets
  batches at least this similar.

Each layout thus runs the same sequences in ``n_batches`` batches, and its mean time per batch compares what
the whole pool costs. The padding share of a layout is 1 - real tokens / token slots on those batches
(:func:`~sebp_probe.data.batching.padding_share`, which forms the same batches from the same seed); packed rows run
by varlen attention are one flattened row without any padding (share 0).

Limit of a layout (:func:`backward_flops`): the step time if the backward GEMMs of the rows whose dL/dY is zero
cost nothing. Rows with a zero dL/dY in exact arithmetic: padding, in every layer; in the last layer also the
rows no loss reads (causal LM: the query, attention-output and MLP rows of tokens without a label, e.g. SFT
prompts; classification: all but the [CLS] rows; keys and values stay active on every real token); in the LM
head the unlabelled rows. A linear over m rows costs 4 m n_in n_out backward FLOPs (dX and dW), attention
10 pairs heads head_dim (flash attention's five products; pairs: the query-key pairs its kernel computes, all
of each padded row under a mask, half of each sequence when causal without one). With s the share of the
backward's FLOPs on inactive rows and forward_ms, backward_ms measured for dense on that layout and head::

    limit_ms = forward_ms + backward_ms * (1 - s)

which takes the backward's time as spread over its FLOPs (norms, elementwise work and the loss scale alike).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

import torch

from ..data.batching import batch_order, collator, padding_share
from ..config import TIMINGS
from ..layouts import LAYOUTS

PAD_ID = 0


@dataclass(frozen=True)
class ModelCase:
    """A whole-model benchmark: architecture (``bert``: sequence classification; a decoder's model type such as
    ``llama``, ``mistral`` or ``qwen2``: causal LM),
    sequences per batch, max length, length distribution, and for causal LM the share of each sequence's
    tokens that is prompt (label -100; 0: every token labelled)."""

    name: str
    arch: str
    batch: int
    max_length: int
    lengths: str  # "sst2", "short" or "sft" (see sample_lengths)
    prompt: float = 0.0
    config: dict = field(default_factory=dict)

    @property
    def task(self) -> str:
        return "classification" if self.arch == "bert" else "causal-lm"


_LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, intermediate_size=8192, max_position_embeddings=131072,
                 rope_theta=500000.0, tie_word_embeddings=True, pad_token_id=PAD_ID)
# Mistral's architecture (its own module classes) at Llama-3.2-1B's size, Mistral's 32768-token vocabulary,
# untied head and no sliding window (Mistral's releases since v0.2)
_MISTRAL_1B = dict(vocab_size=32768, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                   num_key_value_heads=8, intermediate_size=8192, max_position_embeddings=32768,
                   rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False, pad_token_id=PAD_ID)
_QWEN_05B = dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, max_position_embeddings=32768,
                 rope_theta=1000000.0, tie_word_embeddings=True, pad_token_id=PAD_ID)

MODEL_CASES: dict[str, ModelCase] = {
    # attention dropout 0 (hidden dropout 0.1 stays): packed rows can then run varlen flash attention
    "bert-base": ModelCase("bert-base", "bert", 32, 512, "sst2", config=dict(
        vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
        max_position_embeddings=512, num_labels=2, attention_probs_dropout_prob=0.0, pad_token_id=PAD_ID)),
    "llama-3.2-1b-sft": ModelCase("llama-3.2-1b-sft", "llama", 8, 2048, "sft", 0.75, _LLAMA_1B),
    "mistral-1b-sft": ModelCase("mistral-1b-sft", "mistral", 8, 2048, "sft", 0.75, _MISTRAL_1B),
    "qwen2.5-0.5b-sft": ModelCase("qwen2.5-0.5b-sft", "qwen2", 8, 2048, "sft", 0.75, _QWEN_05B),
    "llama-3.2-3b": ModelCase("llama-3.2-3b", "llama", 1, 4096, "short", config=dict(
        vocab_size=128256, hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
        intermediate_size=8192, max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=True,
        pad_token_id=PAD_ID)),
    "qwen2.5-1.5b": ModelCase("qwen2.5-1.5b", "qwen2", 1, 4096, "short", config=dict(
        vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        intermediate_size=8960, max_position_embeddings=8192, tie_word_embeddings=True, pad_token_id=PAD_ID)),
}

TINY_MAX_LENGTH = 64


def tiny(case: ModelCase) -> ModelCase:
    """The case shrunk to hidden size 32, 2 layers, a 512-token vocabulary, at most 4 sequences of at most 64
    tokens: same architecture, layouts, labels and length distribution (scaled), for a check of the whole run
    on a CPU (or a quick one on a GPU)."""
    keep = {k: v for k, v in case.config.items() if k in ("tie_word_embeddings", "num_labels", "pad_token_id",
                                                          "attention_probs_dropout_prob")}
    cfg = dict(keep, vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               max_position_embeddings=TINY_MAX_LENGTH)
    if case.arch != "bert":
        cfg["num_key_value_heads"] = 2
    return replace(case, name=f"{case.name} (tiny)", batch=min(case.batch, 4), max_length=TINY_MAX_LENGTH, config=cfg)


def sample_lengths(kind: str, n: int, max_length: int, seed: int) -> list[int]:
    """Real-token counts of ``n`` sequences. ``sst2``: SST-2-like sentences (log-normal, median ~26 word pieces
    plus [CLS]/[SEP], 5..66); ``short``: uniform in [max_length/64, max_length/8] (64..512 at 4096); ``sft``:
    log-normal with median max_length * 300/2048 (300 at 2048) and sigma 0.8, clipped to
    [max_length/128, max_length] (16..2048 at 2048). All at most ``max_length`` and at least 2."""
    g = torch.Generator().manual_seed(seed)
    if kind == "sst2":
        vals = (torch.exp(math.log(26.0) + 0.55 * torch.randn(n, generator=g)).round() + 2).clamp(5, 66)
    elif kind == "short":
        vals = torch.randint(max(max_length // 64, 2), max_length // 8 + 1, (n,), generator=g)
    elif kind == "sft":
        median = max_length * 300 / 2048
        vals = torch.exp(math.log(median) + 0.8 * torch.randn(n, generator=g)).round().clamp(max_length / 128,
                                                                                               max_length)
    else:
        raise ValueError(f"unknown length distribution {kind!r}; choose sst2, short or sft")
    return [int(min(max(v, 2), max_length)) for v in vals.tolist()]


def make_items(case: ModelCase, lengths: list[int], vocab: int, seed: int) -> list[dict]:
    """Tokenized examples as :func:`~sebp_probe.data.textdata.tokenize` gives them: random ids (never the pad id);
    classification a random label of 2, causal LM labels -100 on the first ``prompt`` share of the tokens."""
    g = torch.Generator().manual_seed(seed + 1)
    items = []
    for n in lengths:
        ids = torch.randint(PAD_ID + 5, vocab, (n,), generator=g).tolist()
        if case.task == "classification":
            items.append({"input_ids": ids, "label": int(torch.randint(0, 2, (), generator=g))})
        else:
            prompt = min(int(case.prompt * n), n - 1)  # at least one labelled token
            items.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return items


def layout_indices(lengths: list[int], batch: int, seed: int) -> dict[str, list[list[int]]]:
    """The pool's sequences per batch of each layout (see the module docstring)."""
    return {name: batch_order(lay, lengths, batch, seed) for name, lay in LAYOUTS.items()}


def layout_batches(case: ModelCase, items: list[dict], seed: int, multiple: int = 1) -> dict[str, list[dict]]:
    """CPU batches of each layout, collated as training collates them (right padding, the padded lengths a
    multiple of ``multiple``; a causal LM's batches carry their labelled-row counts, so the labelled-rows head
    reads none from the device)."""
    idx = layout_indices([len(it["input_ids"]) for it in items], case.batch, seed)
    collate = {name: collator(lay, PAD_ID, case.task, case.max_length, multiple=multiple, counts=True)
               for name, lay in LAYOUTS.items()}
    return {lay: [collate[lay]([items[i] for i in b]) for b in idx[lay]] for lay in LAYOUTS}


def layout_padding(lengths: list[int], case: ModelCase, seed: int, packed_backend: str,
                   multiple: int = 1) -> dict[str, float]:
    """Padding share of each layout on the pool's batches (packed by varlen: 0, one flattened row; padded lengths
    a multiple of ``multiple``)."""
    out = {lay: padding_share(lengths, case.batch, case.max_length, lay, seed, multiple=multiple) for lay in LAYOUTS}
    if packed_backend == "varlen":
        out.update({name: 0.0 for name, lay in LAYOUTS.items() if lay.packed})
    return {k: round(v, 4) for k, v in out.items()}


# ------------------------------------------------------------------------------------------------ the limit


@dataclass
class Geometry:
    """What a batch's FLOPs depend on: ``rows`` x ``length`` token slots as the model runs them, the real
    length of each sequence and how many of its rows the loss reads (labelled tokens; 1 for a classifier)."""

    rows: int
    length: int
    seq_lens: list[int]
    read: list[int]
    varlen: bool = False  # attention per sequence (one flattened row), not over each row


def geometry(batch: dict, task: str, packed_backend: str) -> Geometry:
    """The :class:`Geometry` of a collated batch (before it goes to the device)."""
    if "cu_seqlens" in batch:
        cu = batch["cu_seqlens"].tolist()
        lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        if task == "classification":
            read = [1] * len(lens)
        else:
            labelled = (batch["labels"].reshape(-1)[batch["flat_index"]] != -100).long()
            read = [int(labelled[a:b].sum()) for a, b in zip(cu[:-1], cu[1:])]
        if packed_backend == "varlen":
            return Geometry(1, sum(lens), lens, read, varlen=True)
        return Geometry(*batch["input_ids"].shape, lens, read)
    b, length = batch["input_ids"].shape
    lens = batch["attention_mask"].sum(1).tolist()
    read = [1] * b if task == "classification" else (batch["labels"] != -100).sum(1).tolist()
    return Geometry(b, length, lens, read)


def _layer_linears(cfg) -> tuple[list[tuple[str, int, int]], int]:
    """(role, in, out) of one layer's linears (``q`` the queries, ``kv`` keys and values, ``row`` the rest) and
    the attention width heads x head_dim."""
    d, inter, heads = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or d // heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    lin = [("q", d, heads * hd), ("kv", d, kv * hd), ("kv", d, kv * hd), ("row", heads * hd, d),
           ("row", d, inter), ("row", inter, d)]
    if getattr(cfg, "model_type", "") != "bert":
        lin.append(("row", d, inter))  # gate and up
    return lin, heads * hd


def backward_flops(cfg, geo: Geometry, head: str, causal_kernel: bool) -> dict:
    """Backward matmul FLOPs of one batch: ``total`` (linears and attention), ``linear`` and ``inactive`` (the
    linears' FLOPs on rows whose dL/dY is zero), for ``head`` ``full`` (every row computed) or ``labelled``
    (the last layer's queries and everything after them on the rows the loss reads only, the queries laid out
    per sequence padded to the longest such list; the LM head on the labelled rows). ``causal_kernel``:
    attention is causal without a mask (half the pairs)."""
    lin, width = _layer_linears(cfg)
    n_layers = cfg.num_hidden_layers
    slots, real, read = geo.rows * geo.length, sum(geo.seq_lens), sum(geo.read)
    pairs = sum(n * n for n in geo.seq_lens) if geo.varlen else geo.rows * geo.length ** 2
    full_pairs = pairs * (0.5 if causal_kernel else 1.0)
    # the last layer's kept queries: per sequence padded to the longest list (one flattened row: all at once)
    q_rows = read if geo.rows == 1 else len(geo.read) * max(geo.read)
    total = inactive = 0.0
    for layer in range(n_layers):
        last = layer == n_layers - 1
        for role, n_in, n_out in lin:
            m, active = slots, real
            if last and role != "kv":
                m = slots if head == "full" else q_rows if role == "q" else read
                active = read
            total += 4 * m * n_in * n_out
            inactive += 4 * (m - active) * n_in * n_out
    if getattr(cfg, "model_type", "") != "bert":  # LM head
        m = read if head == "labelled" else slots
        total += 4 * m * cfg.hidden_size * cfg.vocab_size
        inactive += 4 * (m - read) * cfg.hidden_size * cfg.vocab_size
    linear = total
    last_pairs = q_rows * geo.length if head == "labelled" else full_pairs
    total += 10 * width * (full_pairs * (n_layers - 1) + last_pairs)
    return {"total": total, "linear": linear, "inactive": inactive}


def limit_ms(forward_ms: float, backward_ms: float, inactive_share: float) -> float:
    """The step time with the backward's inactive-row GEMMs removed (see the module docstring)."""
    return forward_ms + backward_ms * (1.0 - inactive_share)


def layout_limits(runs: dict, failed: dict, info: dict) -> list[dict]:
    """Per layout, head and timing with both a dense and an SEBP entry: the limit (batch by batch, from dense's
    forward/backward split of that batch) and SEBP's speedup and share of the limit's speedup. ``runs``:
    (layout, method, head, timing) -> per-batch times; ``failed``: entries that did not finish; ``info``: the
    layouts' ``flops`` per head and batch and their ``inactive_share``."""
    out = []
    for (layout, method, head, timing), dense in runs.items():
        sebp = runs.get((layout, "sebp", head, timing))
        if method != "dense" or not dense or not sebp or {(layout, m, head, timing) for m in ("dense", "sebp")} & {
                *failed}:
            continue
        flops = info["layouts"][layout]["flops"][head]
        lim = statistics.fmean(limit_ms(r["forward_ms"], r["backward_ms"], f["inactive"] / f["total"])
                               for r, f in zip(dense, flops))
        d_ms = statistics.fmean(r["step_ms"] for r in dense)
        s_ms = statistics.fmean(r["step_ms"] for r in sebp)
        out.append({"layout": layout, "head": head, "timing": timing,
                    "inactive_share": info["layouts"][layout]["inactive_share"][head],
                    "dense_ms": round(d_ms, 3), "sebp_ms": round(s_ms, 3), "limit_ms": round(lim, 3),
                    "sebp_speedup": round(d_ms / s_ms, 3), "limit_speedup": round(d_ms / lim, 3),
                    "sebp_of_limit": round(lim / s_ms, 3)})
    return out


def summarize(rows: list[dict], auto_methods: tuple[str, ...] = ("dense", "sebp")) -> dict:
    """Per timing (:data:`TIMINGS`) and over ``all`` of them: the fastest dense entry, the fastest
    non-SEBP one (dense, Cut-Cross-Entropy or Liger: the bar SEBP must clear), the fastest of all, and what
    ``--padding auto`` would pick (among ``auto_methods``: dense or SEBP with the head that measured faster,
    and on a GPU the Cut-Cross-Entropy head too, which ``--padding auto`` times there, except as CUDA graphs; the
    picks over ``all`` name their timing). Each row also gets its speedup over dense on its layout, head and
    timing, and over the fastest non-SEBP entry of every timing."""
    out = {}
    for timing in (*TIMINGS, "all"):
        rs = [r for r in rows if timing in ("all", r["timing"])]
        if not rs:
            continue
        keys = ("layout", "method", "head", "ms") + (("timing",) if timing == "all" else ())

        def best(keep):
            pick = min((r for r in rs if keep(r)), key=lambda r: r["ms"], default=None)
            return pick and {k: pick[k] for k in keys}

        out[timing] = {"fastest_dense": best(lambda r: r["method"] == "dense"),
                       "fastest_baseline": best(lambda r: r["method"] != "sebp"),
                       "fastest": best(lambda r: True),
                       "auto_pick": best(lambda r: r["method"] in auto_methods
                                         and not (r["method"] == "cce" and "graphs" in r["timing"]))}
    base = out.get("all", {}).get("fastest_baseline")
    dense = {(r["layout"], r["head"], r["timing"]): r["ms"] for r in rows if r["method"] == "dense"}
    for r in rows:
        d = dense.get((r["layout"], r["head"], r["timing"]))
        r["vs_dense_same_layout"] = round(d / r["ms"], 3) if d else None
        r["vs_fastest_baseline"] = round(base["ms"] / r["ms"], 3) if base else None
    return out
