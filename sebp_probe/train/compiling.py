"""``--compile``: ``torch.compile`` of the training model in place, layer by layer (``--compile-scope layers``,
:func:`compile_layers_or_eager`) or whole with the run's step loss (``model``, :func:`compile_or_eager`), or,
where it cannot run, one line saying why and the run goes on eagerly.

Two things can stop it: Inductor cannot compile anything here (no C compiler for CPU code, a Python or torch
that Dynamo does not support, no Triton for a GPU), found by compiling and running a tiny function first; or
the code does not trace (an op without a shape-only implementation, say), found at its first call, which then
runs eagerly, as every later one does (and every other callable compiled for the same run).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from sebp_kernels.registry import keys_as_inputs

from ..families import layer_stack, unwrapped
from ..model.last_layer import computes_kept_rows
from ..model.patch import bound_pad_rows
from ..notes import note

_PROBED: dict[str, str | None] = {}  # device type -> why Inductor cannot run there (None: it can)


def dynamo_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) by Dynamo in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def distinct_sizes(compiled: Callable) -> Callable:
    """``compiled`` (a ``torch.compile`` result) run without duck shaping: sizes that happen to be equal in the
    first call (a packed row as long as the hidden size, the sequence-length bound and the token count) get
    symbols of their own, so that one specializing (a weight's size, a kernel's int) does not pin the other
    and recompile at the next batch.

    Side effects in a gradient-checkpointed forward are traced once, not replayed in the backward's recompute
    (Dynamo's ``skip_fwd_side_effects_in_bwd_under_checkpoint``): with ``kernels`` installed, transformers wraps
    an attention's forward (``use_kernelized_func``) in one that sets and then resets a global, which Dynamo
    otherwise refuses inside ``torch.utils.checkpoint``: a graph break in every checkpointed layer, so a compiled
    layer ran eagerly. Replaying it would leave nothing changed either."""
    from torch._dynamo import config as dynamo_config
    from torch.fx.experimental import _config as fx_config

    def call(*args, **kwargs):
        with fx_config.patch(use_duck_shape=False), \
                dynamo_config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
            return compiled(*args, **kwargs)

    return call


def evaluating_eagerly(compiled: bool):
    """A context in which the run's compiled callables run eagerly (``torch.compiler.set_stance("force_eager")``)
    where ``compiled``: the held-out evaluation, which runs without gradients and in eval mode. Compiled, it
    would add graphs of its own to every compiled frame (Dynamo guards on both), and a decoder layer's frame
    that FSDP splits off reached Dynamo's recompile limit that way, leaving the training steps after it to run
    that layer eagerly."""
    return torch.compiler.set_stance("force_eager") if compiled else contextlib.nullcontext()


def _probe_fn(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x) * 2 + 1


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    text = lines[0].strip() if lines else ""
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def inductor_problem(device: torch.device) -> str | None:
    """Why Inductor cannot compile code for ``device`` here, or None: a tiny function compiled and run once per
    device type and process (a few seconds on a CPU the first time)."""
    if device.type in _PROBED:
        return _PROBED[device.type]
    why = None
    try:
        torch._dynamo.eval_frame.check_if_dynamo_supported()
        x = torch.linspace(-1, 1, 8, device=device)
        got = torch.compile(_probe_fn, backend="inductor", fullgraph=True)(x)
        if not torch.allclose(got, _probe_fn(x)):
            why = "a compiled test function computed wrong values"
    except Exception as e:  # whatever stops it, the run can still train eagerly
        why = _first_line(e)
    _PROBED[device.type] = why
    return why


class Fallback:
    """What the compiled callables of one run share: the first call that fails to compile logs one line, and
    from then on every one of them runs eagerly (``why``: that line's reason; None while they compile)."""

    def __init__(self, mode: str, flag: str | None = None):
        self.mode, self.why = mode, None
        self.flag = flag or f"--compile {mode}"  # what the line names as the setting that compiled
        self._undo: list[Callable[[], None]] = []

    def guard(self, compiled: Callable, eager: Callable, what: str) -> Callable:
        """``compiled``, or ``eager`` (with one line, then and after) once a call fails to compile."""

        def call(*args, **kwargs):
            if self.why is None:
                try:
                    return compiled(*args, **kwargs)
                except torch._dynamo.exc.TorchDynamoException as e:
                    self._fail(what, e)
            # the call runs again from the start, eagerly; one that fails eagerly too raises its own error
            return eager(*args, **kwargs)

        return call

    def compile(self, fn: Callable, what: str, **compile_kwargs) -> Callable:
        """``torch.compile(fn, **compile_kwargs)`` without duck shaping (:func:`distinct_sizes`), guarded:
        ``fn`` itself, eagerly, once a call fails to compile."""
        return self.guard(distinct_sizes(torch.compile(fn, **compile_kwargs)), fn, what)

    def _fail(self, what: str, e: BaseException) -> None:
        self.why = _first_line(e)
        note(f"{self.flag}: {what} did not compile ({self.why}); training eagerly")
        for undo in self._undo:
            undo()


def compile_layers(model: torch.nn.Module, fallback: Fallback | None = None, row_bound: int | None = None,
                   **kw) -> Callable[[], None]:
    """Each layer of ``model``'s stack (:func:`~sebp_probe.families.layer_stack`) compiled in place with the
    ``torch.compile`` options ``kw`` (PyTorch's regional compilation); returns what undoes it. The layers share
    their code, so Dynamo traces one and the others reuse its graphs (their parameters are the graphs' inputs,
    and SEBP layers name themselves by a tensor input, :func:`sebp_kernels.registry.keys_as_inputs`): a compile
    of one layer, not of the model. The last layer runs eagerly while it computes the labelled-rows head's kept
    rows: compiled as a graph of its own it made packed Qwen2.5-0.5B's step 82.0 ms on an H100 against compiled
    dense + Cut-Cross-Entropy's 63.3 in the same run, where the eager layer had taken 69.5 against 61.9 on
    another day; Llama-3.2-1B's step about the same (bench runs outside results/). Every layer runs eagerly
    in eval mode or without gradients (an evaluation, a ``generate``: compiled, they would add graphs of
    their own, as :func:`evaluating_eagerly` says, toward the recompile limit the training shares). Sizes stay apart
    (:func:`distinct_sizes`). ``fallback``: a layer call that fails to compile runs eagerly, with its one line
    (:meth:`Fallback.guard`). ``row_bound``: the most rows (batch size x length) a batch of the run has, for
    the SEBP layers' padding rows (:func:`~sebp_probe.model.patch.bound_pad_rows`: no recompile where batches
    cross the size at which their forward over the real rows pays); None: not known. ValueError where the model
    has no layer stack sebp-probe knows."""
    layers = layer_stack(model)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no layer stack to compile layer by layer")
    keys_as_inputs(layers)  # SEBP layers name themselves by a tensor input, not a constant per layer
    bound_pad_rows(model, row_bound)
    for layer in layers:
        layer.compile(**kw)
        compiled = distinct_sizes(layer._compiled_call_impl)
        if fallback is not None:
            compiled = fallback.guard(compiled, layer._call_impl, "a layer of the model")

        def call(*args, _compiled=compiled, _layer=layer, **kwargs):
            if computes_kept_rows(_layer) or not (_layer.training and torch.is_grad_enabled()):
                return _layer._call_impl(*args, **kwargs)
            return _compiled(*args, **kwargs)

        layer._compiled_call_impl = call

    def undo() -> None:
        keys_as_inputs(layers, on=False)
        bound_pad_rows(model, None)
        for layer in layers:
            layer._compiled_call_impl = None

    return undo


def training_layers(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose layer stack a run compiles: the transformers model inside DDP's and peft's wrappers
    (:func:`~sebp_probe.families.unwrapped`; FSDP2 leaves the model's own classes in place), else ``model``."""
    return unwrapped(model) or model


def compile_stack(model: torch.nn.Module, fallback: Fallback | None = None, **kw) -> Callable[[], None] | None:
    """:func:`compile_layers` on the layer stack of a training model (:func:`training_layers`: inside DDP's
    and peft's wrappers); what undoes it, or None where the model has no layer stack sebp-probe knows."""
    target = training_layers(model)
    return None if layer_stack(target) is None else compile_layers(target, fallback, **kw)


def compiles_whole(model: torch.nn.Module, scope: str) -> bool:
    """Whether a run compiles ``model`` whole (and, with the labelled-rows head, its whole step): ``--compile-scope
    model``, or ``layers`` on a model without a layer stack sebp-probe knows."""
    return scope == "model" or layer_stack(training_layers(model)) is None


def layer_compile_options(mode: str, one_shape: bool) -> dict:
    """The ``torch.compile`` options of a run's layers: ``mode``, and dynamic shapes from the first batch unless
    every batch has ``one_shape`` (``max_length``): else Dynamo compiles the first shape, then again with
    symbols at the second, a whole second compile (23 s of a 1B model's first 10 steps on an H200). With
    dynamic shapes, ``mode`` goes as its Inductor options (:func:`dynamic_options`)."""
    return {"mode": mode} if one_shape else {"options": dynamic_options(mode), "dynamic": True}


def dynamic_options(mode: str | None) -> dict:
    """Inductor's options of ``mode`` for a compile that meets batches of many shapes: ``mode``'s own, with the
    mix-order reduction fusion off where this torch has it. That fusion (a norm's backward: its sums over rows
    and over columns in one kernel) is decided by guards on the batch's row count (at least 4096 rows, at least
    5 Mi elements), so a layer compiled with dynamic shapes was compiled again whenever a batch crossed one:
    three times in a run of a Llama-1B shape on SFT batches with ``longest`` padding under FSDP2 (once on
    one process, twice on the other), and a process waited 15-41 s for the other's compile (as
    ``TORCH_LOGS=recompiles`` shows). Off, a norm's backward takes two reductions at every batch size, as it does
    below those sizes; what that costs a step on large batches is not measured."""
    from torch._inductor import config, list_mode_options

    opts = dict(list_mode_options(mode or "default"))  # (None would list every mode's)
    if hasattr(config.triton, "mix_order_reduction"):
        opts["triton.mix_order_reduction"] = False
    return opts


def compile_layers_or_eager(model: torch.nn.Module, mode: str, device: torch.device,
                            one_shape: bool = False, row_bound: int | None = None) -> str | None:
    """``--compile-scope layers``: each layer of the training model's stack compiled in place with ``mode``
    (:func:`compile_layers`; a layer call that fails to compile logs one line, and every layer runs eagerly
    from then on), with dynamic shapes unless every batch has ``one_shape``, and the batches' ``row_bound``
    (:func:`compile_layers`). Returns ``"layers"``;
    ``"model"`` where the model has no layer stack sebp-probe knows (the caller compiles the whole model
    instead); None, with one logged line, where Inductor cannot run."""
    if layer_stack(training_layers(model)) is None:
        return "model"
    if cannot_compile(mode, device):
        return None
    fallback = Fallback(mode)
    fallback._undo.append(compile_stack(model, fallback, row_bound=row_bound,
                                        **layer_compile_options(mode, one_shape)))
    return "layers"


def cannot_compile(mode: str, device: torch.device) -> bool:
    """Whether Inductor cannot run on ``device`` (:func:`inductor_problem`); if so, one logged line says so:
    ``--compile MODE: torch.compile cannot run here (why); training eagerly``."""
    why = inductor_problem(device)
    if why is not None:
        note(f"--compile {mode}: torch.compile cannot run here ({why}); training eagerly")
    return why is not None


def compile_fn(fn: Callable, mode: str, device: torch.device, what: str = "the training step",
               fallback: Fallback | None = None) -> Callable | None:
    """``torch.compile(fn, mode=mode)``, guarded by ``fallback`` (a new one by default: a call that fails to
    compile logs one line naming ``what`` and runs ``fn`` eagerly, then and after); None, with one logged
    line, where Inductor cannot run on ``device``. Each call of this makes a fresh compiled wrapper, but
    Dynamo keeps its compiled code on ``fn``'s code object: call ``torch._dynamo.reset()`` between
    candidates that must not share it."""
    if cannot_compile(mode, device):
        return None
    return (fallback or Fallback(mode)).compile(fn, what, mode=mode)


def compile_or_eager(model: torch.nn.Module, mode: str, device: torch.device,
                     step: Callable | None = None) -> Callable | None:
    """``model.compile(mode=mode)`` (in place: the module, its parameter names and checkpoints stay as they
    are) and, with ``step`` (the step's loss, a function of the model and a batch), ``torch.compile(step)``
    too, returned: it compiles the work around the forward as well (the labelled-rows head), the model's
    compiled forward inlined into its graph. Where Inductor cannot run on ``device``: one logged line, the
    model left eager, None. A call of either that fails to compile logs one line, and both run eagerly, then
    and after. Returns None without ``step``."""
    if cannot_compile(mode, device):
        return None
    fallback = Fallback(mode)
    model.compile(mode=mode)
    compiled = distinct_sizes(model._compiled_call_impl)  # what nn.Module.__call__ runs while it is set
    fallback._undo.append(lambda: setattr(model, "_compiled_call_impl", None))
    model._compiled_call_impl = fallback.guard(compiled, lambda *a, **k: model(*a, **k), "the model's forward")
    if step is None:
        return None
    return fallback.compile(step, "the training step", mode=mode)

