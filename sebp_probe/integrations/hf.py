"""SEBP in a Hugging Face ``Trainer`` or TRL ``SFTTrainer``: one call applies what ``finetune`` applies.

    from sebp_probe.integrations.hf import apply_sebp

    trainer = SFTTrainer(model=model, args=SFTConfig(...), train_dataset=data, processing_class=tokenizer)
    sebp = apply_sebp(trainer)   # calibrates on the trainer's first batches, patches the model, takes the loss
    trainer.train()
    sebp.undo()                  # the plain model and the trainer's own loss again

What :func:`apply_sebp` does, as a ``finetune`` run does before its first step:

- the head (:mod:`sebp_probe.model.losses`): with ``head="labelled"`` the training loss of a causal LM (or masked LM)
  runs the output layer and the last transformer layer on the labelled rows only
  (:func:`sebp_probe.model.heads.head_loss`), with the trainer's ``num_items_in_batch`` (so gradient accumulation
  divides as the trainer does), its label smoothing, completion-only labels and TRL's padding-free batches
  (one flattened row, ``position_ids`` and ``cu_seq_lens_q``); a BERT/RoBERTa classifier's last layer computes
  its [CLS] rows only, under the trainer's own loss. Evaluation keeps the trainer's own loss. With
  ``head="cce"`` a causal LM's training loss is the backbone's, then Cut-Cross-Entropy on the labelled rows
  (:mod:`sebp_probe.model.cce_head`; no label smoothing: with it the trainer's own loss runs).
- the SEBP layers (:mod:`sebp_probe.train.calibration`): the candidates (``targets``, by default the attention and
  MLP projections, in exact mode; or each layer's setting from an ``analyze`` report) that the calibration on
  the trainer's first batches finds worth it, patched in place (same Parameters: an optimizer, peft LoRA and
  checkpoints see the same model).

- attention (``keep_cudnn_attention=False``): on a GPU, the training steps' sdpa attention runs without cuDNN's
  kernel (flash or memory-efficient attention compute the same). cuDNN builds an execution plan on the host
  for every new batch shape, and the trainer's padded batches change shape with nearly every step: on an H100
  that host work cost plain SFTTrainer more than its GPU time (docs/trainer.md).
- Liger-Kernel: with ``use_liger_kernel=True`` Liger patches its norm, activation and rotary kernels into the
  model when training starts; they compose with the SEBP layers and the labelled-rows loss.
- ``torch_compile=True``: the trainer compiles its model's forward, which the labelled-rows loss goes around
  (it calls the backbone itself). So, with the trainer's backend and mode, each layer of the model's stack
  compiles in place instead (``compile_scope="layers"``, the default: the layers share one compile, SEBP layers
  as ``sebp::`` operators in it; the embeddings, the last layer on the labelled rows and the head run eagerly),
  or the labelled-rows loss compiles as a whole (``compile_scope="loss"``: the labelled-row counts are read on
  the host before the call, one sync a step, so the graph has no break). A classifier keeps the compiled
  forward and the trainer's own loss.

Where the labelled-rows loss would not equal the trainer's (TRL's ``loss_type="dft"``, a MoE auxiliary loss,
peft prompt learning, several processes, a head the path does not know), the trainer's own loss runs with the
SEBP layers, and one warning line says why. A trainer whose loss is not the library's
(a subclass with its own ``compute_loss``, a ``compute_loss_func``), one that builds its model when training
starts (``model_init``), or a model without a known layer to patch, gets one warning line and runs unchanged.
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import islice

import torch

from sebp_kernels import SEBPConfig

from ..train import calibration as calib
from ..config import FinetuneConfig
from ..model.heads import HeadError, head_loss, host_targets, unwrap
from ..model.last_layer import KeptRows, last_layer_on_rows
from ..model.sdpa import without_cudnn_attention
from ..model.cce_head import cce_loss
from ..model.losses import FULL, HEADS, ROWS_HEADS, Head, _task_of, choose_head
from ..model.patch import PatchError, patched_activations, unpatch_model
from ..model.sampled import reset_samplers
from .grad_stats import GradStatsCallback, add_grad_stats  # noqa: F401  (gradient statistics: exported here)

log = logging.getLogger(__name__)
_HANDLE = "_sebp_handle"  # on the trainer: the handle of the call that changed it
COMPILE_SCOPES = ("layers", "loss")


@dataclass
class SEBPTrainer:
    """What :func:`apply_sebp` did to ``trainer``: ``applied`` (False: it runs unchanged, ``reason`` says why),
    the ``head`` its training loss runs (``labelled``, ``cce`` or ``full``; ``reason`` says why not the one asked
    for),
    and the ``calibration`` (which layers run SEBP, their measured densities, step and backward times)."""

    trainer: object
    applied: bool
    head: str | None = None
    reason: str | None = None
    calibration: calib.Calibration | None = None
    task: str | None = None
    cudnn_attention: bool = True  # False: the training steps' sdpa runs without cuDNN's attention
    compile_scope: str | None = None  # under torch_compile=True: how the labelled-rows loss compiles
    _uncompile: Callable[[], None] | None = field(default=None, repr=False)
    _compiling: object | None = field(default=None, repr=False)  # its Fallback: why it went eager, if it did

    @property
    def compile_failed(self) -> str | None:
        """Why the compiled layers or loss run eagerly since a call failed to compile (None: they compile)."""
        return getattr(self._compiling, "why", None)

    @property
    def layers(self) -> dict[str, SEBPConfig]:
        """Module name -> SEBP setting of every layer that runs SEBP."""
        return dict(self.calibration.layers) if self.calibration is not None else {}

    def undo(self) -> None:
        """Put back the plain model (nn.Linear, norms and activations, same Parameters) and the trainer's own
        loss. A second call does nothing."""
        if not self.applied:
            return
        trainer = self.trainer
        vars(trainer).pop("compute_loss", None)
        vars(trainer).pop("training_step", None)
        if self._uncompile is not None:
            self._uncompile()
            self._uncompile = None
        unpatch_model(trainer.model)
        vars(trainer).pop(_HANDLE, None)
        self.applied = False

    def to_dict(self) -> dict:
        return {"applied": self.applied, "head": self.head, "reason": self.reason,
                "cudnn_attention": self.cudnn_attention, "compile_scope": self.compile_scope,
                "compile_failed": self.compile_failed,
                "calibration": self.calibration.to_dict() if self.calibration is not None else None}


def apply_sebp(trainer, *, report: str | os.PathLike | Mapping | None = None, targets: list[str] | None = None,
               head: str = "labelled", calibrate: bool = True, calib_batches: int = 2, dense_fallback: float = 0.9,
               fallback_if_slower: bool = True, norms: bool = False, acts: bool = False,
               backend: str = "auto", keep_cudnn_attention: bool = False,
               compile_scope: str = "layers", mode: str = "exact", budget: float | str | None = None,
               sample_dx: bool = False, sample_warmup: int = 0, variance_tau: float = 0.025) -> SEBPTrainer:
    """Apply SEBP to a Hugging Face ``Trainer`` or TRL ``SFTTrainer``, in place, before ``train()``.

    The trainer's model gets the SEBP layers that pay on its own first batches, and its training loss the
    chosen head; the trainer's own loop then trains (see the module docstring). Calling it again on the same
    trainer returns the first call's handle.

    Args:
        trainer: a ``transformers.Trainer`` or ``trl.SFTTrainer``, not yet trained.
        report: an ``analyze`` report (a path or the loaded dict) giving each layer's setting; None: the
            ``targets`` run exact SEBP.
        targets: layer names, suffixes or regexes to patch; None: the model family's attention and MLP
            projections.
        head: ``labelled`` (the loss over the labelled rows: LM head and last layer there, where exact),
            ``cce`` (a causal LM's backbone, then Cut-Cross-Entropy on the labelled rows) or ``full`` (the
            trainer's own loss).
        calibrate: measure on the first ``calib_batches`` batches of the trainer's training data which
            candidates pay; False patches every candidate.
        calib_batches: batches calibration measures on (>= 1).
        dense_fallback: a layer whose share of active rows is larger stays dense.
        fallback_if_slower: a model whose SEBP step calibration measures slower than dense stays dense.
        norms: the LayerNorms/RMSNorms get the SEBP backward too.
        acts: the MLP activations (SwiGLU, GELU) get the SEBP backward too.
        backend: the SEBP kernels: ``auto``, ``triton`` or ``torch``.
        keep_cudnn_attention: leave sdpa's choice of kernel alone (by default a GPU's training steps run it
            without cuDNN's attention; see the module docstring).
        compile_scope: under ``torch_compile=True`` with the labelled-rows head, ``layers`` compiles each layer
            of the model's stack in place and runs the rest of the loss eagerly (one layer's compile, not the
            model's); ``loss`` compiles that loss as a whole.
        mode: ``exact`` (the default) or ``sampled`` (approximate, experimental; with ``targets``, not a
            report): each layer keeps the ``budget`` share of its non-zero rows of dL/dY for dW in
            expectation, rescaled so the gradient is unbiased (:mod:`sebp_kernels.sampling`), its draws from
            the trainer's seed. The trainer's checkpoints do not hold the layers' cutoffs and draw counters: a
            resumed trainer draws afresh (sebp-probe's own ``finetune --resume`` continues them).
        budget: ``sampled``: ``"auto"`` (None: the default; per layer, the fewest rows whose added variance
            stays under ``variance_tau`` of the SGD variance) or the expected share of each layer's non-zero rows kept, in
            (0, 1]. The exact-gradient guard of ``finetune --guard-every`` does not run under a Trainer.
        sample_dx: ``sampled``: dX from the sample too (default: dX exact; at budget 0.3 it lost 10 points of
            held-out accuracy on MiniLM/tweets, docs/method.md).
        sample_warmup: ``sampled``: exact optimizer steps before sampling starts.
        variance_tau: ``sampled`` with budget ``"auto"``: each layer's variance budget, a share of the SGD
            variance of its dW (VCAS's 0.025; larger keeps fewer rows).

    Returns:
        An :class:`SEBPTrainer`: whether SEBP was applied (and why not), the head the loss runs, the
        calibration; its :meth:`SEBPTrainer.undo` restores the plain model and loss.

    Raises:
        ValueError: an unknown ``head`` or ``compile_scope``, or ``calib_batches`` < 1.
    """
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; choose one of {', '.join(HEADS)}")
    if compile_scope not in COMPILE_SCOPES:
        raise ValueError(f"unknown compile_scope {compile_scope!r}; choose one of {', '.join(COMPILE_SCOPES)}")
    if mode not in ("exact", "sampled"):
        raise ValueError(f"apply_sebp mode must be exact or sampled, got {mode!r} (a report sets threshold/topk)")
    if mode == "sampled" and report is not None:
        raise ValueError("apply_sebp(mode='sampled') samples the targets' rows; a report sets threshold/topk layers")
    if not isinstance(calib_batches, int) or calib_batches < 1:
        raise ValueError(f"calib_batches must be an integer >= 1, got {calib_batches!r}")
    done = vars(trainer).get(_HANDLE)
    if done is not None and done.applied:
        return done
    why = _unchanged_because(trainer)
    model = getattr(trainer, "model", None)
    cands = {}
    if why is None:
        sampling = {} if mode == "exact" else {
            "mode": mode, "budget": budget, "sample_dx": sample_dx, "sample_warmup": sample_warmup,
            "variance_tau": variance_tau,
            "seed": trainer.args.seed, "grad_accum": trainer.args.gradient_accumulation_steps}
        cands, why = _candidates(model, report, targets, backend, sampling)
    if why is not None:
        log.warning(f"sebp_probe: the trainer runs unchanged: {why}")
        return SEBPTrainer(trainer, applied=False, reason=why)

    try:
        task = _task_of(model)
    except HeadError as e:
        task, blocker = None, str(e)
    else:
        blocker = _loss_blocker(trainer, model)
    if blocker is None and task == "classification" and trainer.args.torch_compile:
        blocker = "under torch_compile=True the [CLS]-rows last layer would change the compiled model's layer"
    if blocker is None and head == "cce" and _smoothing(trainer):
        blocker = "Cut-Cross-Entropy has no label smoothing (label_smoothing_factor > 0)"
    used, reason = choose_head(model, task, head if blocker is None else "full", trainer.accelerator.num_processes,
                               through_forward=False)  # the trainer's loss is replaced by the labelled-rows path
    reason = blocker if head in ROWS_HEADS and blocker is not None else reason
    if reason is not None:
        what = "labelled-rows" if head == "labelled" else "Cut-Cross-Entropy"
        log.warning(f"sebp_probe: the {what} head is off ({reason}); the trainer's own loss runs")
    try:
        c = _calibrate(trainer, model, cands, calibrate, calib_batches, dense_fallback, fallback_if_slower,
                       norms, acts, used)
    except BaseException:
        unpatch_model(model)
        raise
    cudnn = keep_cudnn_attention or not _sdpa_on_gpu(model)
    handle = SEBPTrainer(trainer, applied=True, head=used.kind, reason=reason, calibration=c, task=task,
                         cudnn_attention=cudnn)
    if used.kind in ROWS_HEADS:
        handle.compile_scope, handle._uncompile, handle._compiling = _take_loss(trainer, task, compile_scope,
                                                                                cce=used.kind == "cce")
    if not cudnn:
        _steps_without_cudnn_attention(trainer)
    setattr(trainer, _HANDLE, handle)
    return handle


def _is_sft(cls: type) -> bool:
    return cls.__name__ == "SFTTrainer" and cls.__module__.split(".")[0] == "trl"


def _loss_owner(trainer) -> type:
    return next(c for c in type(trainer).__mro__ if "compute_loss" in vars(c))


def _unchanged_because(trainer) -> str | None:
    """Why the integration cannot make ``trainer`` exact at all, or None."""
    from transformers import Trainer

    if not isinstance(trainer, Trainer):
        return f"apply_sebp takes a transformers Trainer or TRL SFTTrainer, not {type(trainer).__name__}"
    owner = _loss_owner(trainer)
    if "compute_loss" in vars(trainer) or not (owner is Trainer or _is_sft(owner)):
        return f"{type(trainer).__name__} computes its own loss (compute_loss of {owner.__name__})"
    if getattr(trainer, "compute_loss_func", None) is not None:
        return "a compute_loss_func computes the loss"
    if getattr(trainer, "model_init", None) is not None:
        return "model_init builds a new model when training starts"
    return None


def _loss_blocker(trainer, model) -> str | None:
    """Why the labelled-rows loss would not equal ``trainer``'s own, or None."""
    if _is_sft(_loss_owner(trainer)):
        loss_type = getattr(trainer.args, "loss_type", "nll")
        if loss_type != "nll":
            return f"SFTTrainer's loss_type {loss_type!r}"
        if getattr(trainer, "aux_loss_enabled", False):
            return "the MoE router's auxiliary loss"
    if getattr(getattr(model, "active_peft_config", None), "is_prompt_learning", False):
        return "peft prompt learning adds virtual tokens"
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    if pc is not None and (getattr(pc, "sp_enabled", False) or getattr(pc, "cp_enabled", False)):
        return "sequence or context parallelism splits the sequences"
    return None


def _candidates(model, report, targets: list[str] | None, backend: str,
                sampling: dict | None = None) -> tuple[dict[str, SEBPConfig], str | None]:
    """The layers calibration chooses from (those of ``report``, else ``targets`` in exact mode, or sampled with
    ``sampling``: FinetuneConfig's settings of that mode), or why the model has none it knows. A bad report or
    ``targets`` naming nothing raise: the caller's mistake."""
    report_layers = None
    if report is not None:
        from ..analysis.report import check_report_for_model, layer_configs_from_report, load_report, validate_report

        report = validate_report(dict(report)) if isinstance(report, Mapping) else load_report(report)
        check_report_for_model(report, model)
        report_layers = layer_configs_from_report(report, backend=backend)
    cfg = FinetuneConfig(targets=tuple(targets) if targets else None, backend=backend, **(sampling or {}))
    try:
        return calib.candidate_layers(model, cfg, report_layers), None
    except PatchError as e:
        if targets:
            raise
        return {}, str(e)


def _first_batches(trainer, n: int) -> list[dict]:
    """The first ``n`` training batches of ``trainer`` in dataset order, collated as its training loop collates
    them and on its device. Built beside the trainer's own loader: preparing one through accelerate would
    register it with the accelerator, and drawing from a shuffled one would move the training's RNG."""
    dataset, collator = trainer.train_dataset, trainer.data_collator
    if dataset is None:
        raise ValueError("apply_sebp(calibrate=True) measures on the trainer's train_dataset, which is None: "
                         "give the trainer one, or pass calibrate=False")
    import datasets

    if isinstance(dataset, datasets.Dataset):
        dataset = trainer._remove_unused_columns(dataset, description="calibration")
    else:
        collator = trainer._get_collator_with_removed_columns(collator, description="calibration")
    loader = torch.utils.data.DataLoader(dataset, batch_size=trainer.args.per_device_train_batch_size,
                                         collate_fn=collator)
    device = trainer.args.device
    return [{k: v.to(device) if torch.is_tensor(v) else v for k, v in b.items()} for b in islice(loader, n)]


def _calibrate(trainer, model, cands: dict[str, SEBPConfig], measure: bool, n: int, dense_fallback: float,
               if_slower: bool, norms: bool, acts: bool, head: Head = FULL) -> calib.Calibration:
    if not measure:
        c = calib.Calibration({}, None, None, cands, [], norms=calib.apply_sebp(model, cands, norms, acts))
    else:
        batches = _first_batches(trainer, n)
        was_training = model.training
        model.train()  # dropout as in training, and the hooks see gradients
        try:
            c = calib.calibrate(model, batches, cands, dense_fallback, trainer.args.device,
                                trainer.accelerator.autocast, if_slower=if_slower, norms=norms, acts=acts,
                                head=head)
        finally:
            model.train(was_training)
        c = calib.take_main_choice(model, c, cands)  # several processes: all take the main one's layers
    reset_samplers(model)  # sampled mode: the draws start at the first training step
    c.acts = patched_activations(model)
    return c


def _sdpa_on_gpu(model) -> bool:
    cfg = getattr(unwrap(model), "config", None)
    return getattr(cfg, "_attn_implementation", None) == "sdpa" and any(p.is_cuda for p in model.parameters())


def _take_loss(trainer, task: str, compile_scope: str,
               cce: bool = False) -> tuple[str | None, Callable[[], None] | None, object]:
    """Make ``trainer``'s training loss the labelled-rows one (``cce``: the backbone and Cut-Cross-Entropy on the
    labelled rows, :func:`~sebp_probe.model.cce_head.cce_loss`, eager around the layers compiled in place) (an
    instance attribute over the class's ``compute_loss``, which still computes evaluation and anything asking
    for the outputs). Under
    ``torch_compile=True`` each layer of the model compiles in place (``compile_scope="layers"``,
    :func:`_compiled_layers`) or the labelled-rows loss compiles as a whole (``loss``, and where the model has
    no layer stack: :func:`_compiled_labelled_loss`). Returns the scope that compiles (None: eager), what
    undoes the layers' compile, and the :class:`~sebp_probe.train.compiling.Fallback` of the compiled calls
    (None: eager)."""
    from ..train.compiling import Fallback

    own = trainer.compute_loss
    sft = _is_sft(_loss_owner(trainer))
    fallback = uncompile = None
    kwargs: dict = {}
    if trainer.args.torch_compile:
        kwargs = _compile_kwargs(trainer)
        fallback = Fallback(kwargs.get("mode") or "default", flag="torch_compile=True")
        if compile_scope == "layers" or cce:
            uncompile = _compiled_layers(trainer, fallback, kwargs)
    compiled = fallback is not None and uncompile is None and not cce  # the whole loss compiled
    labelled = _cce_loss if cce else _compiled_labelled_loss(fallback, kwargs) if compiled else _labelled_loss
    scope = "loss" if compiled else "layers" if uncompile is not None else None

    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs or not model.training or inputs.get("labels") is None:
            return own(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if task == "classification":
            with _cls_rows(model, inputs):
                return own(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        smoothing = _smoothing(trainer)
        with trainer.accelerator.autocast():  # the trainer's forward runs under it (accelerate wraps it)
            loss = labelled(_uncompiled(model), inputs, task, num_items_in_batch, smoothing,
                            host_targets(inputs, task) if compiled else None)  # eagerly: counted in the loss
        if sft:
            _count_tokens(trainer, inputs)
        return loss

    trainer.compute_loss = compute_loss
    return scope, uncompile, fallback


def _smoothing(trainer) -> float:
    """The trainer's label smoothing (0.0: none)."""
    smoother = getattr(trainer, "label_smoother", None)
    return smoother.epsilon if smoother is not None else 0.0


def _cce_loss(model, inputs: dict, task: str, num_items_in_batch, smoothing: float,
              targets: tuple[int, int] | None) -> torch.Tensor:
    """``head="cce"``'s training loss (``smoothing`` is 0: apply_sebp leaves the head off otherwise)."""
    return cce_loss(model, {**inputs, "num_items_in_batch": num_items_in_batch})


def _labelled_loss(model, inputs: dict, task: str, num_items_in_batch, smoothing: float,
                   targets: tuple[int, int] | None) -> torch.Tensor:
    return head_loss(model, inputs, task, num_items_in_batch=num_items_in_batch, label_smoothing=smoothing,
                     last_layer_rows_only=True, targets=targets).loss


def _uncompiled(model):
    """The module inside a ``torch.compile`` wrapper (accelerate compiles the model's forward for
    ``torch_compile=True``, which the labelled-rows path goes around: it calls the backbone itself)."""
    return getattr(model, "_orig_mod", model)


def _compiled_labelled_loss(fallback, kwargs: dict):
    """The labelled-rows loss compiled as a whole (backbone, last layer on the labelled rows, head and loss)
    with the trainer's own compile settings (``kwargs``, :func:`_compile_kwargs`), the
    labelled-row counts given as Python ints (:func:`~sebp_probe.model.heads.host_targets`: no graph break),
    sizes that are equal by chance kept apart (no recompile when a batch is as long as the hidden size). A
    call that fails to compile says so in one line (``fallback``), and the training goes on with the eager
    loss."""
    return fallback.compile(_labelled_loss, "the labelled-rows loss", **kwargs)


def _compiled_layers(trainer, fallback, kwargs: dict) -> Callable[[], None] | None:
    """Each layer of the trainer's model compiled in place with the trainer's compile settings (``kwargs``)
    (:func:`~sebp_probe.train.compiling.compile_stack`; a layer call that fails to compile says so in one line,
    ``fallback``, and runs eagerly); what undoes it, or None where the model has no layer stack sebp-probe
    knows. Under TRL's SFTTrainer, whose ``max_length`` truncates every sequence, the layers know a batch's most
    rows (:func:`_row_bound`)."""
    from ..train.compiling import compile_stack

    return compile_stack(trainer.model, fallback, row_bound=_row_bound(trainer.args), **kwargs)


def _row_bound(args) -> int | None:
    """The most rows (sequences x length) of a training batch where the arguments bound it: a per-device batch
    size and a ``max_length`` (TRL's SFTConfig truncates to it); None elsewhere (transformers' own arguments
    name no length)."""
    length = getattr(args, "max_length", None)
    return args.per_device_train_batch_size * length if isinstance(length, int) and length > 0 else None


def _compile_kwargs(trainer) -> dict:
    """``torch.compile``'s arguments as the trainer compiles its model: its accelerator's dynamo plugin's, else
    ``torch_compile_backend`` and ``torch_compile_mode``."""
    plugin = getattr(trainer.accelerator.state, "dynamo_plugin", None)
    kwargs = plugin.to_kwargs() if plugin is not None else {}
    if kwargs.get("backend") is None:
        kwargs.update(backend=trainer.args.torch_compile_backend or "inductor", mode=trainer.args.torch_compile_mode)
    return kwargs


def _steps_without_cudnn_attention(trainer) -> None:
    """``trainer``'s training steps (forward, backward, and a checkpointed layer's recomputation in it) with sdpa
    off cuDNN's attention: an instance attribute over the class's ``training_step``."""
    own = trainer.training_step

    def training_step(*args, **kwargs):
        with without_cudnn_attention():
            return own(*args, **kwargs)

    trainer.training_step = training_step


@contextlib.contextmanager
def _cls_rows(model, inputs: dict) -> Iterator[None]:
    """A padded classifier batch: the last layer computes the [CLS] rows only (what the pooler and the loss
    read). A flattened (padding-free) batch runs the whole layer."""
    ids = inputs.get("input_ids")
    if ids is None or ids.dim() != 2 or "cu_seq_lens_q" in inputs or (
            "position_ids" in inputs and "attention_mask" not in inputs):
        yield
        return
    with last_layer_on_rows(unwrap(model).base_model, KeptRows.first_rows(*ids.shape, ids.device)):
        yield


def _count_tokens(trainer, inputs: dict) -> None:
    """SFTTrainer's ``num_tokens`` metric, counted as its own compute_loss counts it (its ``entropy`` and
    ``mean_token_accuracy`` need the logits, which the labelled-rows head never forms)."""
    metrics, total = getattr(trainer, "_metrics", None), getattr(trainer, "_total_train_tokens", None)
    if metrics is None or total is None:
        return
    if "attention_mask" in inputs:
        n = inputs["attention_mask"].sum()
    else:
        n = torch.tensor(inputs["input_ids"].size(1), device=inputs["input_ids"].device)
    n = trainer.accelerator.gather_for_metrics(n).sum().item()
    trainer._total_train_tokens = total + n // getattr(trainer, "_tp_size", 1)
    metrics["train"]["num_tokens"] = [trainer._total_train_tokens]
