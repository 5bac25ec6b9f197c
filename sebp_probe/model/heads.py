"""The loss of a language-model head computed over the labelled rows only.

``model(**batch).loss`` runs the output projection (and for masked LM the head's transform) on every position,
although positions whose label is -100 (SFT prompts, ~85% of MLM positions, padding) get no loss. Here the
backbone runs as usual, the labelled rows of its last hidden state are gathered, and the head runs on those
rows alone, with the projection and cross-entropy fused in chunks (:func:`sebp_kernels.linear_cross_entropy`).
Same loss and gradients as the model's own (mean over labelled tokens).

Tasks: ``causal-lm`` (labels shifted by one as the model's loss does; a ``shift_labels`` batch key is taken as
already shifted; a Gemma logit softcap or a Granite logit divisor applied as the model does) and ``mlm`` (the
masked-LM heads of the model-family registry, :mod:`sebp_probe.families`: transform, then the decoder tied to
the word embeddings, plus its bias). With ``last_layer_rows_only`` the last transformer
layer too runs its position-wise work on the labelled rows only (:mod:`sebp_probe.model.last_layer`); for
``classification`` (BERT-like encoders) that is the head path's only change: the last layer computes the [CLS] rows,
and the loss is the model's own.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sebp_kernels import label_checks, linear_cross_entropy
from sebp_kernels.linear_ce import labelled_rows

from ..data.batching import HOST_COUNTS
from ..families import FAMILIES, family_of
from .last_layer import KeptRows, LastLayerError, kept_rows_family, last_layer_on_rows

IGNORE_INDEX = -100
HEAD_TASKS = ("causal-lm", "mlm", "classification")
# config fields that put more than a linear between the last hidden state and the logits
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier",
                     "lm_head_multiplier")
_NOT_BACKBONE_KEYS = ("labels", "shift_labels", "num_items_in_batch", "use_cache", "return_dict", *HOST_COUNTS)


class HeadError(ValueError):
    """A model or batch the head path cannot take; the message is one line."""


@dataclass
class HeadOutput:
    """``loss``: the head's loss (0 for a batch without a labelled token); ``labelled``: how many tokens carried
    a label (count the batches where it is 0: they train nothing)."""

    loss: torch.Tensor
    labelled: int


@dataclass
class _Head:
    """What the gathered rows go through: ``transform`` (identity for causal LM), then the linear ``decoder``."""

    backbone: nn.Module
    decoder: nn.Linear
    transform: Callable[[torch.Tensor], torch.Tensor] | None
    softcap: float | None = None  # logits = tanh(logits / softcap) * softcap (Gemma)


def unwrap(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a peft wrapper (its LoRA layers stay in place); ``model`` otherwise."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def resolve_head(model: nn.Module, task: str) -> _Head:
    """The backbone, the linear decoder and the transform before it, of ``model`` for ``task``; HeadError for a
    head this path would not compute exactly."""
    if task not in HEAD_TASKS[:2]:
        raise HeadError(f"the linear head path takes task {' or '.join(HEAD_TASKS[:2])}, not {task!r}")
    lm = unwrap(model)
    cfg = getattr(lm, "config", None)
    family = family_of(lm)
    softcap = divisor = None
    for c in (cfg, getattr(cfg, "text_config", None)):
        for name in _LOGIT_TRANSFORMS:
            value = getattr(c, name, None)
            if value is None or value == 1 or value is False:
                continue
            if task == "causal-lm" and family is not None and family.logit_softcap \
                    and name == "final_logit_softcapping":
                softcap = float(value)
            elif task == "causal-lm" and family is not None and name == family.logit_divisor:
                divisor = float(value)
            else:
                raise HeadError(f"{type(lm).__name__} transforms its logits ({name} = {value}); the head path "
                                "computes a plain linear head only")
    if task == "causal-lm" and getattr(cfg, "output_router_logits", False):
        raise HeadError(f"{type(lm).__name__} adds its routers' load-balancing loss (output_router_logits), over "
                        "every row's routing; the head path computes the labelled rows' loss only")
    backbone = getattr(lm, "base_model", None)
    decoder = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if backbone is None or backbone is lm or type(decoder) is not nn.Linear:
        raise HeadError(f"{type(lm).__name__} has no backbone with a plain nn.Linear output layer (a LoRA or "
                        "otherwise wrapped head is not supported)")
    if task == "causal-lm":
        if divisor is not None and decoder.bias is not None:
            raise HeadError(f"{type(lm).__name__} divides the logits of a head with a bias; the head path "
                            "computes a plain linear head only")
        # (h / d) W^T = (h W^T) / d: the divisor goes onto the rows before the fused head
        return _Head(backbone, decoder, None if divisor is None else lambda h: h / divisor, softcap)
    return _Head(backbone, decoder, _mlm_transform(lm, decoder))


def _mlm_transform(lm: nn.Module, decoder: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    family = family_of(lm)
    transform = family.mlm(lm, decoder) if family is not None and family.mlm is not None else None
    if transform is None:
        known = [f.name for f in FAMILIES.values() if f.mlm is not None]
        raise HeadError(f"{type(lm).__name__}: the head path knows the masked-LM heads of "
                        f"{', '.join(known[:-1])} and {known[-1]} only")
    return transform


def backbone_inputs(batch: Mapping) -> dict:
    """The batch without its labels and loss settings, for the backbone (extra keys such as position_ids
    stay)."""
    return {k: v for k, v in batch.items() if k not in _NOT_BACKBONE_KEYS}


def target_labels(batch: Mapping, task: str) -> torch.Tensor:
    """The label of each position of the last hidden state: for causal LM the next token's (``shift_labels``
    when the batch has them), -100 at the last position."""
    if task == "causal-lm" and batch.get("shift_labels") is not None:
        return batch["shift_labels"]
    if batch.get("labels") is None:
        raise HeadError("the batch has no labels")
    labels = batch["labels"]
    if task == "causal-lm":
        return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
    return labels


def host_targets(batch: Mapping, task: str) -> tuple[int, int]:
    """(labelled rows, the most of them in one row of the labels) of ``batch`` as Python ints, read from the
    device once: the ``targets`` of :func:`head_loss` for a caller whose batches do not carry them (a Trainer's
    collator), so that a compiled head_loss traces without a graph break."""
    per_row = (target_labels(batch, task) != IGNORE_INDEX).sum(-1).reshape(-1)
    if per_row.numel() == 0:
        return 0, 0
    n, most = torch.stack([per_row.sum(), per_row.max()]).tolist()
    return int(n), int(most)


def head_loss(
    model: nn.Module,
    batch: Mapping,
    task: str = "causal-lm",
    *,
    num_items_in_batch: int | torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    chunk_rows: int | None = None,
    last_layer_rows_only: bool = False,
    targets: tuple[int, int] | None = None,
) -> HeadOutput:
    """The loss of ``model(**batch)`` (mean over labelled tokens) with the head run on the labelled rows only.

    ``batch``: the model's keyword arguments (input_ids, attention_mask, position_ids, ...) and ``labels``.
    ``num_items_in_batch``: the labelled tokens of the whole accumulated step (as the Trainer passes): the loss is
    then the sum over this batch divided by it. ``label_smoothing`` as in F.cross_entropy. Works under
    ``torch.autocast`` and for peft-wrapped models (LoRA in the backbone; the output layer frozen or trained).
    ``last_layer_rows_only``: the last layer as well computes the labelled rows only (its keys and values all).
    ``targets``: (labelled rows, the most of them in one row of ``labels``) as Python ints, when the caller
    knows them (a packed batch's ``n_targets`` and ``max_row_targets``): then no step reads them from the device,
    and ``torch.compile`` traces the head without a graph break; without them they are counted on the device.
    """
    if task == "classification":
        return _classification(model, batch, last_layer_rows_only)
    head = resolve_head(model, task)
    labels = target_labels(batch, task)
    num_items = batch.get("num_items_in_batch", num_items_in_batch)
    flat = labels.reshape(-1).to(head.decoder.weight.device)
    n, most = targets if targets is not None else (None, None)
    rows = labelled_rows(flat, head.decoder.out_features, IGNORE_INDEX, count=n)
    inputs = backbone_inputs(batch)
    if last_layer_rows_only:
        b, t = labels.shape[-2:]
        most = n if b == 1 else most  # one row (a flattened packed batch) holds them all
        with last_layer_on_rows(head.backbone, KeptRows.from_rows(rows, b, t, most=most)):
            hidden = head.backbone(**inputs, use_cache=False)[0]  # (1, n, d): the labelled rows
        h = hidden.reshape(-1, hidden.shape[-1])
    else:
        hidden = head.backbone(**inputs, use_cache=False)[0]  # the last hidden state
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
    return _decode(head, h, flat.index_select(0, rows), num_items, label_smoothing, chunk_rows)


def per_item(total: torch.Tensor, num_items: int | torch.Tensor) -> torch.Tensor:
    """A summed loss over ``num_items`` (a Trainer's labelled tokens of the whole accumulated step: an int or a
    tensor, on any device)."""
    return total / (num_items.to(total.device) if torch.is_tensor(num_items) else num_items)


def takes_logits_to_keep(model: nn.Module) -> bool:
    """Whether ``model``'s forward (the transformers model inside its wrappers) takes ``logits_to_keep``."""
    import inspect

    return "logits_to_keep" in inspect.signature(type(unwrap(model)).forward).parameters


def forward_kept_loss(model: nn.Module, batch: Mapping, num_items_in_batch: int | torch.Tensor | None = None
                      ) -> torch.Tensor:
    """A causal LM's loss through the model's own forward, its output layer on the labelled positions only: for
    callers whose model must be called as a whole (a DDP or FSDP wrapper, whose forward gathers and syncs).
    ``logits_to_keep`` holds the positions at which some row has a label (a packed batch's one flattened row:
    exactly its labelled rows); the cross-entropy runs over those logits (at least fp32, as the model's own loss). The
    same loss as the model's own: the mean over labelled tokens, or their sum over ``num_items_in_batch`` (the
    batch's, else the argument). Its last layer runs on every row. Reads the positions on the host (one sync)."""
    from .packing import packed_call

    num_items = batch.get("num_items_in_batch", num_items_in_batch)

    def loss(inputs: Mapping) -> torch.Tensor:
        labels = target_labels(inputs, "causal-lm")
        keep = labels != IGNORE_INDEX
        positions = keep.reshape(-1, keep.shape[-1]).any(0).nonzero().squeeze(1)
        call = {k: v for k, v in inputs.items() if k not in _NOT_BACKBONE_KEYS}
        logits = model(**call, logits_to_keep=positions, use_cache=False).logits
        y = label_checks.safe(labels.index_select(-1, positions), logits.shape[-1], IGNORE_INDEX)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least fp32, as the model's loss
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1).to(logits.device),
                                ignore_index=IGNORE_INDEX, reduction="sum")
        if num_items is None:
            return total / keep.sum().clamp(min=1).to(total.device)  # no labelled token: 0, not 0 / 0
        return per_item(total, num_items)

    if "cu_seqlens" not in batch:
        return loss(batch)
    with packed_call(model, batch) as inputs:
        return loss(inputs)


def _classification(model: nn.Module, batch: Mapping, last_layer_rows_only: bool) -> HeadOutput:
    """The model's own loss; with ``last_layer_rows_only`` its last layer computes the [CLS] rows only."""
    if batch.get("labels") is None:
        raise HeadError("the batch has no labels")
    n = int(batch["labels"].shape[0])
    if not last_layer_rows_only:
        return HeadOutput(model(**batch).loss, n)
    backbone = getattr(unwrap(model), "base_model", None)
    try:
        kept_rows_family(backbone, cls_rows=True)
    except LastLayerError as e:
        raise HeadError(f"the [CLS]-rows last layer for classification: {e}") from None
    b, t = batch["input_ids"].shape
    with last_layer_on_rows(backbone, KeptRows.first_rows(b, t, batch["input_ids"].device)):
        return HeadOutput(model(**batch).loss, n)


def _decode(head: _Head, h: torch.Tensor, labels: torch.Tensor, num_items, label_smoothing: float,
            chunk_rows: int | None) -> HeadOutput:
    """The head on the gathered rows ``h`` (all labelled)."""
    if head.transform is not None:
        h = head.transform(h)
    reduction = "mean" if num_items is None else "sum"
    if head.softcap is not None:  # not a linear head: the capped logits of the labelled rows, as the model's loss
        logits = head.decoder(h)
        logits = torch.tanh(logits / head.softcap) * head.softcap
        labels = label_checks.safe(labels, logits.shape[-1], IGNORE_INDEX)  # (linear_cross_entropy does its own)
        loss = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction=reduction,
                               label_smoothing=label_smoothing)
    else:
        loss = linear_cross_entropy(h, head.decoder.weight, labels, head.decoder.bias, ignore_index=IGNORE_INDEX,
                                    label_smoothing=label_smoothing, reduction=reduction, chunk_rows=chunk_rows,
                                    labelled=labels.numel())
    if num_items is not None:
        loss = per_item(loss, num_items)
    return HeadOutput(loss, labels.numel())
