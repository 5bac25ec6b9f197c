"""Why rows of dL/dY are inactive, and which padding layout to train with.

Every row of a layer's dL/dY (one per token) falls into exactly one cause, per batch:

* ``padding``: a pad position of the batch (attention mask 0), whatever its values;
* ``label_less``: a real token that no loss term reads directly, and whose row is exactly zero: a causal LM's
  positions whose shifted label is -100 (the prompt, each sequence's last token), a classifier's tokens other
  than the pooled one, a masked LM's unmasked tokens. Such a row reaches the loss only through attention in
  later layers, so it is exactly zero in the last layer's position-wise linears and usually not earlier;
  a label-less row that is not zero counts as ``near_zero`` or ``active`` by its size;
* ``other_zero``: exactly zero for another reason (e.g. a decoder's first query under left padding, which
  attends to itself only: its softmax is constant);
* ``near_zero``: not padding, not zero, max |row| <= the layer's eps (what ``threshold`` mode skips on top);
* ``active``: not padding, max |row| > eps.

The collector (:mod:`sebp_probe.analysis.hooks`) is told which rows are padding and which label-less
(:func:`row_groups`) and keeps an octave histogram of each group's row max, so the split is exact at every eps
that is 0 or a power of two (as the knee detector's are). Two diagnostics come with it: ``label_less_positions``
(label-less rows, zero or not) and ``padding_not_zero`` (pad rows that are not exactly zero: a loss that reads a
pad position, e.g. a left-padded [CLS] classifier).

The layout advice (:func:`layout_advice`) takes the padding every layout leaves on the analysed samples
(:func:`sebp_probe.data.batching.padding_share`) and assumes every real token's row is skipped by SEBP as often as
measured: on a layout leaving padding share p, SEBP skips p + (1 - p) * (share of the real rows' backward FLOPs
that are label-less, other zero or near zero).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from ..data.batching import PackingError, padding_share
from .grad_records import ROW_GROUPS, LayerStats
from .knee import backward_gemm_flops, rows_above
from ..layouts import LAYOUTS

CAUSES = ("padding", "label_less", "other_zero", "near_zero", "active")
SKIPPED = ("label_less", "other_zero", "near_zero")  # what SEBP skips among the real tokens' rows
PADDING, LABEL_LESS = (ROW_GROUPS.index(g) + 1 for g in ("padding", "label_less"))
IGNORE_INDEX = -100
# Stacking SEBP is worth it from 10% of the backward GEMM FLOPs skipped: finetune's default --dense-fallback
# (0.9) keeps a layer dense under that share of skippable rows.
SEBP_WORTH = 0.10
# A layout must leave a point less padding than a simpler one (earlier in LAYOUTS) to be recommended.
LAYOUT_TIE = 0.01
_TEXT = {"padding": "the padding left", "label_less": "label-less rows", "other_zero": "other exactly-zero rows",
         "near_zero": "rows below eps"}


# ------------------------------------------------------------------------------------ rows of a batch


def classifier_pooling(model: nn.Module) -> str:
    """Which token a sequence classifier's loss reads: ``last`` for decoder classifiers (a ``score`` head on the
    rightmost non-pad token, as transformers' ``*ForSequenceClassification`` of causal LMs do), else
    ``first`` ([CLS], <s>)."""
    return "last" if any(n.rsplit(".", 1)[-1] == "score" for n, _ in model.named_modules()) else "first"


def _read_by_loss(batch: dict, task: str | None, pooling: str, pad_token_id: int | None,
                  shape: torch.Size, device: torch.device) -> torch.Tensor:
    """(B, T) bool: the positions a loss term reads directly (all of them when that is unknown)."""
    labels = batch.get("labels")
    if labels is None or task not in ("causal-lm", "mlm", "classification"):
        return torch.ones(shape, dtype=torch.bool, device=device)
    if task == "mlm":
        return labels != IGNORE_INDEX
    read = torch.zeros(shape, dtype=torch.bool, device=device)
    if task == "causal-lm":  # position t predicts token t + 1: its loss term is the label one step on
        read[:, :-1] = labels[:, 1:] != IGNORE_INDEX
        return read
    ids = batch.get("input_ids")
    if pooling == "first":
        pos = torch.zeros(shape[0], dtype=torch.long, device=device)
    elif ids is not None and pad_token_id is not None:  # transformers' rule: the rightmost non-pad token
        pos = (torch.arange(shape[1], device=device) * (ids != pad_token_id)).argmax(dim=1)
    else:
        pos = torch.full((shape[0],), shape[1] - 1, dtype=torch.long, device=device)
    return read.scatter_(1, pos.unsqueeze(1), True)  # (indexing with tensors would sync: index_put_)


def row_groups(batch: dict, task: str | None, pooling: str = "first",
               pad_token_id: int | None = None) -> torch.Tensor | None:
    """int8 group of every token of a padded batch, flattened as the rows of dL/dY (batch-major): PADDING
    (attention mask 0), LABEL_LESS (a real token no loss term reads directly), 0 otherwise; None for a batch
    without (batch, seq) tokens. On the batch's device, without host syncs."""
    mask, ids = batch.get("attention_mask"), batch.get("input_ids")
    ref = mask if mask is not None else ids
    if ref is None or ref.dim() != 2:
        return None
    real = mask.bool() if mask is not None else torch.ones(ref.shape, dtype=torch.bool, device=ref.device)
    read = _read_by_loss(batch, task, pooling, pad_token_id, ref.shape, ref.device)
    groups = torch.where(real, torch.where(read, 0, LABEL_LESS), PADDING)
    return groups.to(torch.int8).reshape(-1)


def grouper(model: nn.Module, task: str | None) -> Callable[[dict], torch.Tensor | None]:
    """batch -> :func:`row_groups` for ``model`` trained on ``task`` (None: from the batch, classification when
    labels are per sequence, masked LM for a ``*MaskedLM`` model, else causal LM)."""
    pooling = classifier_pooling(model)
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    masked = "MaskedLM" in type(model).__name__

    def groups(batch: dict) -> torch.Tensor | None:
        labels = batch.get("labels")
        t = task
        if t is None and labels is not None:
            t = "classification" if labels.dim() == 1 else "mlm" if masked else "causal-lm"
        return row_groups(batch, t, pooling, pad)

    return groups


# ---------------------------------------------------------------------------------------- the split


def cause_counts(layer: LayerStats, eps: float) -> dict[str, np.ndarray]:
    """Rows per cause in each seen batch (see the module docstring), and the two diagnostics."""
    octaves = layer.octaves().astype(np.int64)
    groups = layer.group_octaves_seen().astype(np.int64)
    pad, label_less = groups[:, PADDING - 1], groups[:, LABEL_LESS - 1]
    real = octaves - pad
    active = rows_above(real, eps)
    return {
        "padding": pad.sum(axis=1),
        "label_less": label_less[:, 0],
        "other_zero": octaves[:, 0] - pad[:, 0] - label_less[:, 0],
        "near_zero": real[:, 1:].sum(axis=1) - active,
        "active": active,
        "label_less_positions": label_less.sum(axis=1),
        "padding_not_zero": pad[:, 1:].sum(axis=1),
    }


def layer_causes(layer: LayerStats, eps: float) -> dict:
    """A layer's report entries: ``rows_by_cause`` (fractions of its rows, avg over batches; they add up to 1),
    the diagnostics (the same), and ``backward_flops_by_cause`` (its backward GEMM FLOPs over all batches)."""
    counts = cause_counts(layer, eps)
    rows = np.asarray(layer.rows)[layer.seen]
    avg = {k: float(np.mean(v / rows)) for k, v in counts.items()}
    return {
        "rows_by_cause": {c: avg[c] for c in CAUSES},
        "label_less_positions": avg["label_less_positions"],
        "padding_not_zero": avg["padding_not_zero"],
        "backward_flops_by_cause": {c: backward_gemm_flops(counts[c], layer.in_features, layer.out_features)
                                    for c in CAUSES},
    }


def cause_totals(layers: dict[str, dict]) -> dict:
    """All layers together, weighted by backward GEMM FLOPs: FLOPs per cause and their shares of the dense."""
    flops = {c: sum(e["stats"]["backward_flops_by_cause"][c] for e in layers.values()) for c in CAUSES}
    dense = sum(flops.values()) or 1.0
    return {"backward_flops_by_cause": flops, "share_by_cause": {c: f / dense for c, f in flops.items()}}


def type_causes(stats: list[dict]) -> dict:
    """The rows by cause of a layer type: the mean of its layers' (avg over batches)."""
    return {c: float(np.mean([s["rows_by_cause"][c] for s in stats])) for c in CAUSES}


# ----------------------------------------------------------------------------------------- layouts


def packed_issue(model: nn.Module, task: str) -> str | None:
    """Why ``packed`` cannot run ``model`` exactly for ``task`` (one line), or None when it can."""
    from ..model.packing import check_packable

    try:
        check_packable(model, task)
    except PackingError as e:
        return str(e).split(";")[0]
    return None


def _block(name: str) -> int | str:
    """The layer index of a module name (its last numeric part), else the name."""
    digits = [p for p in name.split(".") if p.isdigit()]
    return int(digits[-1]) if digits else name


def _where(layers: dict[str, dict], cause: str) -> str:
    """Where a cause's FLOPs are: ``of the last layer`` (80% of them or more in one), else ``over 30 layers,
    22% in the last layer``."""
    by_block: dict[int | str, float] = {}
    for name, e in layers.items():
        key = _block(name)
        by_block[key] = by_block.get(key, 0.0) + e["stats"]["backward_flops_by_cause"][cause]
    top = max(by_block, key=by_block.get)
    last = max((k for k in by_block if isinstance(k, int)), default=None)
    label = "the last layer" if top == last else f"layer {top}" if isinstance(top, int) else top
    share = by_block[top] / (sum(by_block.values()) or 1.0)
    if share >= 0.8:
        return f"of {label}"
    return f"over {sum(f > 0 for f in by_block.values())} layers, {share:.0%} in {label}"


def layout_advice(summary: dict, lengths: np.ndarray, batch_size: int, max_length: int,
                  packed_reason: str | None) -> dict:
    """Per layout: the padding it leaves on these samples, its dense backward GEMM FLOPs against
    ``max_length``'s, and what SEBP would skip on top of it (shares of that layout's backward GEMM FLOPs, by
    cause); then the layout to use and whether SEBP is worth stacking on it."""
    share = summary["totals"]["share_by_cause"]
    real = 1.0 - share["padding"]
    skip_real = {c: share[c] / real if real > 0 else 0.0 for c in SKIPPED}
    lens = [int(n) for n in lengths]
    pad_max = padding_share(lens, batch_size, max_length, "max_length")
    table = {}
    for layout in LAYOUTS:
        if LAYOUTS[layout].packed and packed_reason:
            table[layout] = {"applies": False, "reason": packed_reason}
            continue
        p = padding_share(lens, batch_size, max_length, layout)
        by = {"padding": p, **{c: (1 - p) * v for c, v in skip_real.items()}}
        table[layout] = {"applies": True, "padding_share": p, "dense_backward_vs_max_length": (1 - pad_max) / (1 - p),
                         "sebp_skips": sum(by.values()), "sebp_skips_by_cause": by}
    best = next(iter(LAYOUTS))
    for layout in LAYOUTS:
        if table[layout]["applies"] and table[layout]["padding_share"] < table[best]["padding_share"] - LAYOUT_TIE:
            best = layout
    pick = table[best]
    top = max(pick["sebp_skips_by_cause"], key=pick["sebp_skips_by_cause"].get)
    why = _TEXT[top] if top == "padding" else f"{_TEXT[top]} {_where(summary['layers'], top)}"
    worth = pick["sebp_skips"] >= SEBP_WORTH
    text = (f"{best}: {pick['padding_share']:.1%} padding left; SEBP would still skip {pick['sebp_skips']:.0%} of "
            f"the backward GEMM FLOPs (mostly {why}): "
            + ("stack SEBP on it" if worth else f"SEBP adds little on top (under {SEBP_WORTH:.0%})")
            + (f"; packed does not apply: {packed_reason}" if packed_reason else ""))
    return {"samples": len(lens), "batch_size": batch_size, "max_length": max_length, "layouts": table,
            "recommended": best, "stack_sebp": worth, "recommendation": text}
