"""The training loss of one batch, whatever its layout and head: the :class:`Head` a run chooses and hands to
every caller of its loss (the loop, calibration, ``--padding auto``'s timing, the Trainer integration).

Three heads (``FinetuneConfig.head``):

- ``full``: the model's own loss, ``model(**batch).loss`` (packed batches through
  :func:`~sebp_probe.model.packing.packed_forward`; :func:`model_loss`);
- ``labelled``: the rows no loss reaches are left out where that is exact (:mod:`.heads`): causal LM and masked
  LM run the head and the last layer's position-wise work on the labelled rows only; BERT/RoBERTa classifiers
  run their last layer on the [CLS] rows only (padded batches; packed ones run the full last layer). The same
  loss and gradients (:func:`labelled_loss`);
- ``cce``: causal LMs, the backbone on every row, then Apple's Cut-Cross-Entropy on the labelled rows
  (:mod:`.cce_head`; the optional package ``cut-cross-entropy``), the head a user adds to a compiled model.

:func:`head_for` makes one for a model (the full head and why, where the asked one cannot run);
:func:`choose_head` is a run's choice, given its processes, CUDA graphs and compile setting. A head is a value:
nothing of it is set on the model, and ``torch.compile(head.loss)`` compiles that head's step.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..data.batching import HOST_COUNTS
from .cce_head import cce_loss, cce_problem
from .heads import HeadError, forward_kept_loss, head_loss, resolve_head, takes_logits_to_keep
from .last_layer import install_kept_rows, kept_rows_family
from ..notes import note
from .packing import CAUSAL_LMS, attention_backend, enable_varlen, packed_call, packed_forward, unwrap

HEADS = ("labelled", "full", "cce")
ROWS_HEADS = ("labelled", "cce")  # the heads that call the backbone themselves, on the labelled rows
# The labelled-rows head runs the last layer's position-wise work on the labelled rows too (:mod:`.last_layer`).
# Under compile that layer runs eagerly; with this off the last layer is compiled on every row instead, which
# timed within noise of it on packed Qwen2.5-0.5B and Llama-3.2-1B on an H100.
KEPT_ROWS_LAST_LAYER = True
_TASK_OF_CLASS = (("ForMaskedLM", "mlm"), ("ForCausalLM", "causal-lm"), ("ForSequenceClassification", "classification"))


@dataclass(frozen=True)
class Head:
    """The loss a run computes for each batch (:meth:`loss`): ``kind``, one of :data:`HEADS`, for the model's
    ``task`` (``causal-lm``, ``mlm``, ``classification``; None for ``full``). ``through_forward``: the labelled
    head of a causal LM in several processes, through the model's own forward
    (:func:`~.heads.forward_kept_loss`: the output layer on the labelled positions, the last layer on every
    row). Made by :func:`head_for` / :func:`choose_head`, which check that it runs on the model."""

    kind: str = "full"
    task: str | None = None
    through_forward: bool = False

    @property
    def calls_backbone(self) -> bool:
        """Whether the loss calls the model's backbone itself, around the model's forward (the labelled-rows head
        in one process, the CCE head), rather than the model's own forward."""
        return self.kind in ROWS_HEADS and not self.through_forward

    def loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        """The loss of ``batch``: the model's own, or this head's path (a packed classifier batch takes the
        model's own: the [CLS]-rows last layer reads padded rows)."""
        if self.kind == "cce":
            return cce_loss(model, batch)
        if self.kind == "full" or ("cu_seqlens" in batch and self.task == "classification"):
            return model_loss(model, batch)
        if self.through_forward:
            return forward_kept_loss(model, batch)
        return labelled_loss(model, batch, self.task)


FULL = Head()  # the model's own loss


def model_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The model's own loss of ``batch`` (packed batches through :func:`~.packing.packed_forward`)."""
    if "cu_seqlens" in batch:
        return packed_forward(model, batch).loss
    inputs = {k: v for k, v in batch.items() if k not in HOST_COUNTS}
    return model(**inputs, **no_cache(model)).loss


def labelled_loss(model: torch.nn.Module, batch: dict, task: str | None = None) -> torch.Tensor:
    """The labelled-rows path's loss of ``batch`` for ``task`` (None: the model's, from its class); on a packed
    classifier batch it raises HeadError (the [CLS]-rows last layer takes padded batches)."""
    task = task or _task_of(model)
    targets = (batch["n_targets"], batch["max_row_targets"]) if "n_targets" in batch else None
    if "cu_seqlens" not in batch:
        return head_loss(model, batch, task, last_layer_rows_only=KEPT_ROWS_LAST_LAYER, targets=targets).loss
    if task == "classification":
        raise HeadError("the [CLS]-rows last layer takes padded batches only, not packed ones")
    with packed_call(model, batch) as inputs:
        return head_loss(model, inputs, task, last_layer_rows_only=KEPT_ROWS_LAST_LAYER, targets=targets).loss


def no_cache(model: torch.nn.Module) -> dict:
    """``use_cache=False`` for a causal LM: training and held-out losses never read a KV cache, and the one
    transformers builds by default costs memory and, under ``torch.compile``, a recompile per layer (its
    guards read each layer's cache state)."""
    return {"use_cache": False} if type(unwrap(model)).__name__.endswith(CAUSAL_LMS) else {}


def _task_of(model: torch.nn.Module) -> str:
    name = type(unwrap(model)).__name__
    task = next((t for suffix, t in _TASK_OF_CLASS if name.endswith(suffix)), None)
    if task is None:
        raise HeadError(f"the labelled-rows head knows causal LMs, masked LMs and classifiers, not {name}")
    return task


def head_for(model: torch.nn.Module, task: str | None, kind: str) -> tuple[Head, str | None]:
    """The head ``kind`` for ``model`` (``task``: its task), and why the labelled-rows path (or CCE) cannot run on
    it, or None; where it cannot, the full head (:data:`FULL`). The labelled head's last-layer forward is
    installed now, not in a compiled step's first call (the next call would recompile)."""
    if kind not in HEADS:
        raise ValueError(f"unknown head {kind!r}; choose one of {', '.join(HEADS)}")
    if kind == "full":
        return FULL, None
    if kind == "cce":
        why = cce_problem(model, task)
        return (FULL, why) if why is not None else (Head("cce", task), None)
    base = unwrap(model)
    try:
        kept_rows_family(getattr(base, "base_model", None), cls_rows=task == "classification")
        if task != "classification":
            resolve_head(model, task)
    except (HeadError, ValueError) as e:
        return FULL, str(e)
    install_kept_rows(base.base_model)
    return Head("labelled", task), None


def compiled_head_problem(task: str, padding: str) -> str | None:
    """Why the labelled-rows head stays out of a compiled step (``torch.compile(head.loss)``) on ``padding``
    batches, or None: on masked-LM batches it counts its labelled rows on the device (a host ``nonzero``), which
    would break the graph; causal-LM batches of a compiled run carry that count as Python ints
    (:func:`~sebp_probe.data.batching.target_counts`), and a classifier's [CLS] rows need no count. ``auto``: None
    (each layout is judged when it is timed)."""
    if task == "mlm" and padding not in ("packed", "auto"):
        return (f"under --compile on --padding {padding} masked-LM batches it counts the labelled rows on the "
                "device (a host nonzero), which breaks the compiled step")
    return None


def choose_head(model: torch.nn.Module, task: str | None, head: str, processes: int = 1, graphs: bool = False,
                compiled: bool = False, padding: str | None = None,
                through_forward: bool = True) -> tuple[Head, str | None]:
    """The head a run uses and why it is not the one asked for: the labelled-rows path (and the Cut-Cross-Entropy
    head) runs in one process (it calls the backbone itself, past DDP's forward) and without CUDA graphs (it
    reads the labelled-row count on the host); in several processes a causal LM's labelled head goes through
    the model's own forward instead (``Head.through_forward``; ``through_forward`` False: the model's own loss
    there, for a caller that replaces the loss with the labelled-rows path itself). ``compiled``: the run
    compiles the whole step's loss on ``padding`` batches (the run's layout;
    tests/probe/test_compile_graphs.py), the head with it, except where :func:`compiled_head_problem` says."""
    if compiled and padding is None:
        raise ValueError("choose_head(compiled=True) needs the run's padding")
    if processes > 1 and through_forward and head == "labelled" and not graphs and task == "causal-lm" \
            and takes_logits_to_keep(model):
        note(f"--head labelled in {processes} processes: the output layer on the labelled positions through the "
             "model's own forward (logits_to_keep), the last layer on every row")
        return Head("labelled", task, through_forward=True), None
    why = ("it calls the backbone past DDP's forward: one process only" if processes > 1 else
           "CUDA graphs cannot hold its host-side row count" if graphs else
           compiled_head_problem(task, padding) if compiled else None)
    if head in ROWS_HEADS and why is None:
        chosen, why = head_for(model, task, head)
        if why is None:
            return chosen, None
        note(f"--head {head} runs as --head full (the model's own loss): {why}")
    if head in ROWS_HEADS:
        return FULL, why
    return head_for(model, task, head)[0], None


def auto_heads(model: torch.nn.Module, task: str, head: str, device: torch.device,
               processes: int = 1) -> tuple[str | None, ...]:
    """The heads ``--padding auto`` times each layout with, given the run's head (:func:`choose_head`'s kind):
    ``labelled`` against the model's own (the labelled path may lose) and, on a GPU where Cut-Cross-Entropy can
    compute this model's loss, against ``cce`` too; ``cce`` against the model's own; ``full`` alone (None: the
    run's own head). In several processes the run's head alone: the others would not run there as
    timed (one process times the layouts, on the model as it is before the run wraps it)."""
    if processes > 1:
        return (None,)
    if head == "labelled":
        cce = ("cce",) if device.type == "cuda" and cce_problem(model, task) is None else ()
        return ("labelled", "full", *cce)
    return ("cce", "full") if head == "cce" else (None,)


def ready_to_compile(model: torch.nn.Module, padding: str, autocast=contextlib.nullcontext) -> None:
    """Make before compiling the one-time switch a packed step would otherwise make inside the traced code,
    breaking its graph there: the model's attention to the varlen kernel, where it runs (a GPU, bf16/fp16)."""
    if padding == "packed":
        with autocast():
            if attention_backend(model) == "varlen":
                enable_varlen(model)


def token_counts(batch: dict) -> tuple[torch.Tensor, int]:
    """(real tokens as a device tensor, token slots) of a batch: what the loop logs as tokens and rows."""
    if "cu_seqlens" in batch:
        return batch["cu_seqlens"][-1], batch["input_ids"].numel()
    mask = batch["attention_mask"]
    return mask.sum(), mask.numel()


def has_no_target(batch: dict) -> torch.Tensor:
    """A device bool: every label of the batch is -100, so it trains nothing (causal LM batches hold -100 at
    each sequence's first token already, which no position predicts); no host sync."""
    labels = batch["labels"]
    if labels.dim() == 1:  # classification: one label per sequence
        return torch.zeros((), dtype=torch.bool, device=labels.device)
    return (labels != -100).sum() == 0
