"""A causal LM's loss by its backbone and Apple's Cut-Cross-Entropy on the labelled rows (``--head cce``).

The backbone runs every layer on every row, as a user's ``torch.compile(model.model)`` + CCE does; the labelled
rows of its last hidden state (the next token's label not -100, the same rows as the labelled-rows head of
:mod:`.heads`) go through ``cut_cross_entropy.linear_cross_entropy``, which computes the loss and its gradients
without the logits in memory. On a GPU in bf16 or fp16 (the model's, or autocast's) its Triton kernels
(``impl="cce"``), elsewhere its ``torch_compile`` implementation (on a CPU a check, not a speed). The same
function is the whole-model benchmark's CCE entry (:mod:`sebp_probe.bench.bench_peers`), so what
``--padding auto`` times is what the bench timed.

Left to the caller: the package is optional (:func:`cce_problem` says why it cannot run), and its gradient
filtering (``filter_eps``, on by default) skips the softmax entries below bf16's resolution in the backward.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

IGNORE_INDEX = -100


def cce_import_problem() -> str | None:
    """Why ``cut_cross_entropy`` does not import here, or None."""
    try:
        import cut_cross_entropy  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure is the reason
        return (f"cut_cross_entropy does not import ({type(e).__name__}: {' '.join(str(e).split())[:120]}; "
                "pip install 'sebp-probe[cce]')")
    return None


def cce_problem(model: torch.nn.Module | None, task: str) -> str | None:
    """Why the Cut-Cross-Entropy head cannot compute ``model``'s loss for ``task`` exactly, or None (``model``
    None: the task and the package only)."""
    if task == "classification":
        return "Cut-Cross-Entropy computes a language model's loss: a classifier has no LM head"
    if task != "causal-lm":
        return f"Cut-Cross-Entropy here computes a causal language model's loss, not task {task!r}"
    why = cce_import_problem()
    if why is not None or model is None:
        return why
    from .heads import HeadError

    try:
        _plain_head(model)
    except HeadError as e:
        return str(e)
    return None


def _plain_head(model: torch.nn.Module):
    """``model``'s causal-LM head (:func:`~.heads.resolve_head`); HeadError unless a plain linear one."""
    from .heads import HeadError, resolve_head

    head = resolve_head(model, "causal-lm")
    if head.transform is not None or head.softcap is not None or head.decoder.bias is not None:
        raise HeadError(f"{type(model).__name__}'s LM head transforms its logits or has a bias; Cut-Cross-Entropy "
                        "takes a plain linear head")
    return head


def _operands(h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
    """The hidden rows and output weight in the dtype the output layer would compute in (autocast's where it is
    on, as ``F.linear`` under autocast casts them; the gradient reaches the weight in its own dtype), and the
    implementation that takes them: the Triton kernels on a GPU in bf16/fp16 (their backward takes no other),
    else CCE's ``torch_compile`` one (the CPU; an fp32 run on a GPU without autocast)."""
    dtype = torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else h.dtype
    h, w = h.to(dtype), w.to(dtype)
    return h, w, "cce" if h.is_cuda and dtype in (torch.bfloat16, torch.float16) else "torch_compile"


def cce_loss(model: torch.nn.Module, batch: Mapping) -> torch.Tensor:
    """The causal-LM loss of ``batch`` (padded or packed): the model's own (mean over labelled tokens; the sum
    over them divided by ``num_items_in_batch`` where the batch carries it, as a Trainer's accumulated step),
    by the backbone and Cut-Cross-Entropy over the labelled rows. A batch's ``n_targets`` (its collator's count)
    spares the host a read of the labels."""
    from cut_cross_entropy import linear_cross_entropy
    from sebp_kernels import label_checks
    from sebp_kernels.linear_ce import labelled_rows

    from .heads import backbone_inputs, per_item, target_labels
    from .packing import packed_call

    head = _plain_head(model)
    num_items = batch.get("num_items_in_batch")

    def loss(inputs: Mapping, count: int | None) -> torch.Tensor:
        flat = target_labels(inputs, "causal-lm").reshape(-1).to(head.decoder.weight.device)
        rows = labelled_rows(flat, head.decoder.out_features, IGNORE_INDEX, count=count)
        hidden = head.backbone(**backbone_inputs(inputs), use_cache=False)[0]
        if rows.numel() == 0:  # nothing to learn from: a zero loss that still reaches every parameter used
            return hidden.sum() * 0.0
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
        # checks held on the device (label_checks.deferred): a label past the vocabulary reaches no kernel
        y = label_checks.safe(flat.index_select(0, rows), head.decoder.out_features, IGNORE_INDEX)
        reduction = "mean" if num_items is None else "sum"
        h, w, impl = _operands(h, head.decoder.weight)
        out = linear_cross_entropy(h, w, y, impl=impl, reduction=reduction)
        return out if num_items is None else per_item(out, num_items)

    if "cu_seqlens" not in batch:
        return loss(batch, batch.get("n_targets"))
    with packed_call(model, batch) as inputs:
        return loss(inputs, batch.get("n_targets"))
