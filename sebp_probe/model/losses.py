"""The training loss of one batch, whatever its layout and head: the one call the loop, calibration and timing
make (:func:`batch_loss`).

Three heads (``FinetuneConfig.head``):

- ``full``: the model's own loss, ``model(**batch).loss`` (packed batches through
  :func:`~sebp_probe.model.packing.packed_forward`);
- ``labelled``: the rows no loss reaches are left out where that is exact (:mod:`.heads`): causal LM and masked
  LM run the head and the last layer's position-wise work on the labelled rows only; BERT/RoBERTa classifiers
  run their last layer on the [CLS] rows only (padded batches; packed ones run the full last layer). The same
  loss and gradients;
- ``cce``: causal LMs, the backbone on every row, then Apple's Cut-Cross-Entropy on the labelled rows
  (:mod:`.cce_head`; the optional package ``cut-cross-entropy``), the head a user adds to a compiled model.

A run sets its choice on the model (:func:`set_head`), so every caller of :func:`batch_loss` computes the loss
the same way without passing it around; ``labelled_head`` overrides it for one call (the benchmark).
"""
from __future__ import annotations

import contextlib

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
_ATTR = "_sebp_head_task"
_THROUGH_FORWARD = "causal-lm:forward"  # _ATTR's value for the labelled head through the model's own forward
_TASK_OF_CLASS = (("ForMaskedLM", "mlm"), ("ForCausalLM", "causal-lm"), ("ForSequenceClassification", "classification"))


def batch_loss(model: torch.nn.Module, batch: dict, labelled_head: bool | None = None) -> torch.Tensor:
    """The loss of ``batch``: the model's own, or the labelled-rows head path where :func:`set_head` chose it
    (``labelled_head`` True or False: that head for this call; True on a packed classifier batch raises)."""
    packed = "cu_seqlens" in batch
    if labelled_head is None:
        task = getattr(unwrap(model), _ATTR, None)
        if packed and task == "classification":  # the [CLS]-rows last layer reads padded rows
            task = None
        if task == "cce":
            return cce_loss(model, batch)
        if task == _THROUGH_FORWARD:
            return forward_kept_loss(model, batch)
    else:
        task = _task_of(model) if labelled_head else None
    targets = (batch["n_targets"], batch["max_row_targets"]) if "n_targets" in batch else None
    if task is None:
        if packed:
            return packed_forward(model, batch).loss
        inputs = {k: v for k, v in batch.items() if k not in HOST_COUNTS}
        return model(**inputs, **no_cache(model)).loss
    if not packed:
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


def use_head(model: torch.nn.Module, task: str, head: str) -> str | None:
    """Make :func:`batch_loss` compute ``model``'s loss with ``head`` (see the module docstring); returns why the
    labelled-rows path cannot run on this model (then the full head runs), or None."""
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; choose one of {', '.join(HEADS)}")
    base = unwrap(model)
    setattr(base, _ATTR, None)
    if head == "full":
        return None
    if head == "cce":
        why = cce_problem(model, task)
        if why is None:
            setattr(base, _ATTR, "cce")
        return why
    try:
        kept_rows_family(getattr(base, "base_model", None), cls_rows=task == "classification")
        if task != "classification":
            resolve_head(model, task)
    except (HeadError, ValueError) as e:
        return str(e)
    install_kept_rows(base.base_model)  # now, not in a compiled step's first call (the next would recompile)
    setattr(base, _ATTR, task)
    return None


def compiled_head_problem(task: str, padding: str) -> str | None:
    """Why the labelled-rows head stays out of a compiled step (``torch.compile(batch_loss)``) on ``padding``
    batches, or None: on masked-LM batches it counts its labelled rows on the device (a host ``nonzero``), which
    would break the graph; causal-LM batches of a compiled run carry that count as Python ints
    (:func:`~sebp_probe.data.batching.target_counts`), and a classifier's [CLS] rows need no count. ``auto``: None
    (each layout is judged when it is timed)."""
    if task == "mlm" and padding not in ("packed", "auto"):
        return (f"under --compile on --padding {padding} masked-LM batches it counts the labelled rows on the "
                "device (a host nonzero), which breaks the compiled step")
    return None


def set_head(model: torch.nn.Module, task: str, head: str, processes: int = 1, graphs: bool = False,
             compiled: bool = False, padding: str | None = None,
             through_forward: bool = True) -> tuple[str, str | None]:
    """The head a run uses (set on ``model``) and why it is not the one asked for: the labelled-rows path (and the
    Cut-Cross-Entropy head) runs in one process (it calls the backbone itself, past DDP's forward) and without
    CUDA graphs (it reads the labelled-row count on the host); in several processes a causal LM's labelled head
    goes through the model's own forward instead (:func:`~.heads.forward_kept_loss`: the output layer on the
    labelled positions, the last layer on every row; ``through_forward`` False: the model's own loss there, for
    a caller that replaces the loss with the labelled-rows path itself). ``compiled``: the run compiles the whole
    step's loss on ``padding`` batches (the run's layout; tests/probe/test_compile_graphs.py), the head with it,
    except where :func:`compiled_head_problem` says."""
    if compiled and padding is None:
        raise ValueError("set_head(compiled=True) needs the run's padding")
    if processes > 1 and through_forward and head == "labelled" and not graphs and task == "causal-lm" \
            and takes_logits_to_keep(model):
        setattr(unwrap(model), _ATTR, _THROUGH_FORWARD)
        note(f"--head labelled in {processes} processes: the output layer on the labelled positions through the "
             "model's own forward (logits_to_keep), the last layer on every row")
        return head, None
    why = ("it calls the backbone past DDP's forward: one process only" if processes > 1 else
           "CUDA graphs cannot hold its host-side row count" if graphs else
           compiled_head_problem(task, padding) if compiled else None)
    if head in ROWS_HEADS and why is None:
        why = use_head(model, task, head)
        if why is not None:
            note(f"--head {head} runs as --head full (the model's own loss): {why}")
    if head in ROWS_HEADS and why is not None:
        use_head(model, task, "full")
        return "full", why
    use_head(model, task, head)
    return head, None


def auto_heads(model: torch.nn.Module, task: str, head: str, device: torch.device,
               processes: int = 1) -> tuple[str | None, ...]:
    """The heads ``--padding auto`` times each layout with, given the run's head as :func:`set_head` set it:
    ``labelled`` against the model's own (the labelled path may lose) and, on a GPU where Cut-Cross-Entropy can
    compute this model's loss, against ``cce`` too; ``cce`` against the model's own; ``full`` alone (None: the
    head set on the model). In several processes the run's head alone: the others would not run there as
    timed (one process times the layouts, on the model as it is before the run wraps it)."""
    if processes > 1:
        return (None,)
    if head == "labelled":
        cce = ("cce",) if device.type == "cuda" and cce_problem(model, task) is None else ()
        return ("labelled", "full", *cce)
    return ("cce", "full") if head == "cce" else (None,)


def calls_backbone(model: torch.nn.Module) -> bool:
    """Whether the head set on ``model`` calls its backbone itself, around the model's forward (the labelled-rows
    head in one process, the CCE head), rather than the model's own forward (the model's own loss, the labelled
    head of several processes)."""
    return getattr(unwrap(model), _ATTR, None) not in (None, _THROUGH_FORWARD)


def head_of(model: torch.nn.Module) -> str:
    """The head :func:`batch_loss` computes for ``model`` now: ``labelled``, ``cce`` or ``full``."""
    task = getattr(unwrap(model), _ATTR, None)
    return "full" if task is None else "cce" if task == "cce" else "labelled"


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
