"""Swap nn.Linear modules (and transformers' Conv1D, :mod:`.linears`) of a model for SEBPLinear in place, sharing
their Parameters.

Target matching (peft style): a pattern matches a module name exactly, as a dotted suffix
(``"q_proj"`` matches ``model.layers.0.self_attn.q_proj``), or as a regex (``re.fullmatch``). The special
pattern ``"all-linear"`` matches every nn.Linear except the output head. A peft LoRA layer's
``base_layer`` is matched under the name of its wrapper, so SEBP goes onto the frozen base weight.
"""
from __future__ import annotations

import re
import types
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from sebp_kernels import SEBPConfig, SEBPLinear, SEBPNorm, norm_kind
from sebp_kernels.activations import RowHint, sebp_gelu, sebp_swiglu
from sebp_kernels.interpret import triton_runs_on
from sebp_kernels.pad_rows import CHECKING, OFF, ON, PadRows
from sebp_kernels.sampling import layer_key

from ..families import Family, family_of, model_type, unwrapped
from .embed_rows import patch_embeddings, unpatch_embeddings
from .experts import patch_experts, unpatch_experts
from .linears import is_linear, left_dense, to_sebp
from ..notes import note

# Output heads: left dense by "all-linear" unless named explicitly.
HEAD_NAMES: tuple[str, ...] = ("classifier", "classification_head", "lm_head", "score", "qa_outputs", "cls",
                               "head", "pooler")

FilterFn = Callable[[nn.Module, str], bool]


class PatchError(ValueError):
    """A patching request that cannot be honoured (bad pattern, wrong module type, unknown layer)."""


def _logical_name(name: str) -> str:
    """The name a user targets: a peft ``...q_proj.base_layer`` is addressed as ``...q_proj``."""
    return name[: -len(".base_layer")] if name.endswith(".base_layer") else name


def _is_head(name: str) -> bool:
    return any(p in HEAD_NAMES for p in name.split("."))


def _names_exactly(name: str, pattern: str) -> bool:
    return name == pattern or name.endswith("." + pattern)


def name_matches(name: str, pattern: str) -> bool:
    """Exact name, dotted suffix, or full regex match."""
    if _names_exactly(name, pattern):
        return True
    try:
        return re.fullmatch(pattern, name) is not None
    except re.error:
        return False


def _as_list(patterns: Iterable[str] | str | None) -> list[str]:
    return [patterns] if isinstance(patterns, str) else list(patterns or [])


def _is_plain_linear(m: nn.Module) -> bool:
    """A linear that targets can name (:func:`.linears.is_linear`: nn.Linear or Conv1D, plain or swapped)."""
    return is_linear(m)


def _as_config(value: SEBPConfig | Mapping, where: str) -> SEBPConfig:
    if isinstance(value, SEBPConfig):
        return value
    if isinstance(value, Mapping):
        try:
            return SEBPConfig.from_dict(dict(value))
        except (TypeError, ValueError) as e:
            raise PatchError(f"layer {where}: {e}") from None
    raise PatchError(f"layer {where}: expected SEBPConfig or dict, got {type(value).__name__}")


def find_targets(
    model: nn.Module,
    target_modules: Iterable[str] | str | None = None,
    exclude_modules: Iterable[str] | str | None = None,
    filter_fn: FilterFn | None = None,
) -> list[str]:
    """Full names of the linear modules that patching would swap (checked, see :func:`patch_model`)."""
    explicit = target_modules is not None
    family = None if explicit else family_of(model)
    patterns = _as_list(target_modules) if explicit else list(family.targets) if family else []
    excludes = _as_list(exclude_modules)
    modules = dict(model.named_modules())
    linear_names = [n for n, m in modules.items() if _is_plain_linear(m)]

    chosen: list[str] = []
    for pattern in patterns:
        if pattern == "all-linear":
            hits = [n for n in linear_names if not _is_head(_logical_name(n))]
        else:
            named = [n for n in modules if n and name_matches(n, pattern)]
            hits = []
            for n in named:
                m = modules[n]
                base = getattr(m, "base_layer", None)
                if _is_plain_linear(m):
                    hits.append(n)
                elif isinstance(base, nn.Module) and _is_plain_linear(base):
                    hits.append(f"{n}.base_layer")
                elif explicit and _names_exactly(n, pattern) and not any(
                        c for c in m.modules() if c is not m and _is_plain_linear(c)):
                    raise PatchError(
                        f"target {pattern!r} matches {n!r}, a {type(m).__name__}, not an nn.Linear"
                    )
        if explicit and not hits:
            sample = ", ".join(linear_names[:8]) + (" ..." if len(linear_names) > 8 else "")
            raise PatchError(f"target {pattern!r} matches no linear layer; linear layers are: {sample}")
        chosen.extend(h for h in hits if h not in chosen)

    if not explicit and not chosen and any(not _is_head(_logical_name(n)) for n in linear_names):
        # a family without an entry, or whose projections have other names
        chosen = [n for n in linear_names if not _is_head(_logical_name(n))]
        what = f"model type {model_type(model)!r} has no entry" if family is None else \
            f"none of the {family.name} projections is in this model"
        kinds = sorted({_layer_kind(_logical_name(n)) for n in chosen})
        dense = sorted({f"{_layer_kind(n)} ({t})" for n, t in left_dense(model, chosen).items()})
        note(f"{what}: SEBP targets every linear but the output head ({', '.join(kinds)}); left dense: "
             f"{', '.join(dense) or 'none'}; choose with --targets")
    chosen = [n for n in chosen if not any(name_matches(_logical_name(n), p) or name_matches(n, p)
                                           for p in excludes)]
    if filter_fn is not None:
        chosen = [n for n in chosen if filter_fn(modules[n], _logical_name(n))]
    if not explicit and not chosen and not excludes and filter_fn is None:
        raise PatchError("this model has no nn.Linear layer but its output head (SEBP swaps nn.Linear and Conv1D "
                         "layers); name the layers with --targets")
    return chosen


def _layer_kind(name: str) -> str:
    """A module name without the part up to its layer index (``h.3.attn.c_attn`` -> ``attn.c_attn``)."""
    parts = name.split(".")
    idx = [i for i, p in enumerate(parts) if p.isdigit()]
    return ".".join(parts[idx[-1] + 1:]) if idx and idx[-1] + 1 < len(parts) else name


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def patch_model(
    model: nn.Module,
    config: SEBPConfig | None = None,
    target_modules: Iterable[str] | str | None = None,
    exclude_modules: Iterable[str] | str | None = None,
    filter_fn: FilterFn | None = None,
    layer_configs: Mapping[str, SEBPConfig | Mapping] | None = None,
    pad_rows: bool = True,
    forward_rows: bool = True,
) -> list[str]:
    """Swap matching nn.Linear modules of ``model`` for SEBPLinear, in place.

    Parameters are shared, so state_dict keys, data pointers and an optimizer built before patching stay
    valid. Patching an already patched layer only updates its config. :func:`unpatch_model` undoes it.

    Without ``target_modules``, a mixture-of-experts family's fused experts get the SEBP experts backward too
    (:mod:`.experts`; not among the names returned, see :func:`~.experts.patched_experts`).

    Args:
        model: the model to patch (a Hugging Face model, a peft wrapper or any nn.Module).
        config: the settings of every patched layer (:class:`~sebp_kernels.config.SEBPConfig`); None: exact mode.
        target_modules: module name patterns to patch (a name, a suffix such as ``"q_proj"``, ``"all-linear"``, or a list);
            None: the model family's default targets, or the layers ``layer_configs`` names.
        exclude_modules: module name patterns left out of the targets.
        filter_fn: ``filter_fn(module, name)``, False leaves that layer out.
        layer_configs: module name -> SEBPConfig or a dict with mode/eps/top_n (a report's per-layer
            settings), overriding ``config`` per layer; with no ``target_modules``, only these layers are patched.
        pad_rows: the SEBP linears take the rows of a batch's padding from its attention mask instead of
            selecting them, once a first backward has checked that those rows get no gradient
            (:mod:`sebp_kernels.pad_rows`; exact mode only), and the model's embeddings then leave those rows
            out of their backward (:mod:`sebp_kernels.embedding`).
        forward_rows: with ``pad_rows``, once checked, a linear's forward may compute the real-token rows alone
            where that pays (:mod:`sebp_kernels.forward_rows`); False keeps every forward on all rows (for a
            model that reads padding rows through a path without gradient).

    Returns:
        The names of the patched layers, in module order.

    Raises:
        PatchError: a config that is not an SEBPConfig, or per-layer settings naming a layer that is missing,
            not an nn.Linear, or left out by the targets.
    """
    if config is not None and not isinstance(config, SEBPConfig):
        raise PatchError(f"config must be an SEBPConfig, got {type(config).__name__}")
    config = config or SEBPConfig()
    per_layer: dict[str, SEBPConfig] = {}
    if layer_configs:
        names = dict(model.named_modules())
        for name, value in layer_configs.items():
            real = f"{name}.base_layer" if f"{name}.base_layer" in names else name
            if real not in names:
                raise PatchError(f"layer {name!r} from the per-layer settings is not in this model")
            if not _is_plain_linear(names[real]):
                raise PatchError(f"layer {name!r} is a {type(names[real]).__name__}, not an nn.Linear")
            per_layer[real] = _as_config(value, name)

    if per_layer and target_modules is None:  # exactly the named layers, not their names used as patterns
        excludes = _as_list(exclude_modules)
        targets = [n for n in per_layer
                   if not any(name_matches(_logical_name(n), p) for p in excludes)
                   and (filter_fn is None or filter_fn(names[n], _logical_name(n)))]
    else:
        targets = find_targets(model, target_modules, exclude_modules, filter_fn)
        missed = sorted(set(per_layer) - set(targets))
        if missed:
            raise PatchError(f"per-layer settings name layers that the targets leave out: {', '.join(missed[:5])}")
    patched = []
    for name in targets:
        module = model.get_submodule(name)
        cfg = per_layer.get(name, config)
        if isinstance(module, SEBPLinear):
            module.sebp_config = cfg
        else:
            _set_submodule(model, name, to_sebp(module, cfg, sample_key=layer_key(name)))
        patched.append(name)
    if target_modules is None and patched:  # the family's default: its fused experts with its projections
        patch_experts(model, family_of(model), note)
    if pad_rows and patched:
        pad = install_pad_rows(model, forward_rows)
        for name in patched:
            model.get_submodule(name)._sebp_pad_rows = pad
        patch_embeddings(model, pad)
    return patched


def patch_sebp(model: nn.Module, config: SEBPConfig | None = None, *,
               target_modules: Iterable[str] | str | None = None,
               layer_configs: Mapping[str, SEBPConfig | Mapping] | None = None, norms: bool = False,
               acts: bool = False, pad_rows: bool = True, forward_rows: bool = True) -> dict[str, list[str]]:
    """Everything SEBP puts into ``model``, in the order it needs: the linears (:func:`patch_model`; none when
    ``layer_configs`` is given but empty), the MLP activations (:func:`patch_activations`, which hand their
    rows to the SEBP linears present), the norms (:func:`patch_norms`). Returns the names patched now, by
    kind ("linears", "acts", "norms")."""
    linears = [] if layer_configs is not None and not layer_configs else patch_model(
        model, config, target_modules, layer_configs=layer_configs, pad_rows=pad_rows, forward_rows=forward_rows)
    return {"linears": linears, "acts": patch_activations(model) if acts else [],
            "norms": patch_norms(model) if norms else []}


def _backbone(model: nn.Module) -> nn.Module:
    """The module that takes the batch's input_ids and attention_mask: the backbone of a Hugging Face model
    (also inside a peft wrapper), which the labelled-rows head calls directly; ``model`` otherwise."""
    get_base = getattr(model, "get_base_model", None)
    inner = get_base() if callable(get_base) else model
    base = getattr(inner, "base_model", None)
    return base if isinstance(base, nn.Module) else inner


def _triton_backward_on(device: torch.device) -> bool:
    """Whether the SEBP linears' backward on ``device`` can be the Triton one (which takes rows): a GPU, or
    the CPU under the Triton interpreter."""
    return triton_runs_on(device)


def _pad_rows_hook(module, args, kwargs):
    pad = vars(module).get("_sebp_pad_rows")
    if pad is None:
        return
    if torch.compiler.is_compiling():  # traced with the model: the rows of an earlier batch must not be read
        pad.clear()
        return
    mask = kwargs.get("attention_mask")
    if torch.is_tensor(mask) and not _triton_backward_on(mask.device):
        pad.clear()  # the torch backward (CPU) selects its rows itself: nothing to work out
        return
    ids = kwargs.get("input_ids", args[0] if args else None)
    if (torch.is_grad_enabled() and torch.is_tensor(mask) and torch.is_tensor(ids) and mask.dim() == 2
            and mask.shape == ids.shape):
        pad.set(mask)
    else:
        pad.clear()


def install_pad_rows(model: nn.Module, forward_rows: bool = True) -> PadRows:
    """The :class:`~sebp_kernels.pad_rows.PadRows` of ``model``, with the forward pre-hook on its backbone
    that sets it from each batch's attention mask. One made before (and its check's verdict) is kept, given
    ``forward_rows`` (:attr:`~sebp_kernels.pad_rows.PadRows.forward_real_rows`)."""
    base = _backbone(model)
    pad = vars(base).get("_sebp_pad_rows")
    if pad is None:
        pad = base._sebp_pad_rows = PadRows()
    pad.forward_real_rows = forward_rows
    if _pad_rows_hook not in base._forward_pre_hooks.values():
        base.register_forward_pre_hook(_pad_rows_hook, with_kwargs=True)
    return pad


def _unwrapped(model: nn.Module) -> nn.Module:
    """The transformers model inside ``model``'s peft, DDP/FSDP and ``torch.compile`` wrappers
    (:func:`~sebp_probe.families.unwrapped`); another model inside a DDP wrapper."""
    return unwrapped(model) or getattr(model, "module", model)


def pad_rows_of(model: nn.Module) -> PadRows | None:
    """The :class:`~sebp_kernels.pad_rows.PadRows` of ``model`` (also inside a DDP wrapper or a compiled
    module), or None."""
    return vars(_backbone(_unwrapped(model))).get("_sebp_pad_rows")


def bound_pad_rows(model: nn.Module, rows: int | None) -> None:
    """Tell ``model``'s padding rows (if it has them) the most rows a batch of this run has (batch size x the
    longest length; None: not known), so that its compiled SEBP layers decide once whether their forward over the
    real rows could ever pay, not at a guard on each batch's rows (:attr:`~sebp_kernels.pad_rows.PadRows.row_bound`)."""
    pad = pad_rows_of(model)
    if pad is not None:
        pad.row_bound = rows


def pad_rows_summary(model: nn.Module) -> dict | None:
    """Whether ``model``'s padding rows passed their check (``state``: on / off / checking), how many linear
    backwards took them (``taken``) and how many linears select their own rows instead (``own``: their dY was
    far sparser than the padding, :data:`~sebp_kernels.pad_rows.OWN_BELOW`); None where it has none or never
    checked them (the CPU's torch backward, batches without a padding mask)."""
    pad = pad_rows_of(model)
    if pad is None or (pad.state == CHECKING and pad.violations is None):
        return None
    return {"state": pad.state, "taken": pad.taken, "own": len(pad_rows_own(model))}


def pad_rows_verdict(model: nn.Module) -> str | None:
    """The verdict of ``model``'s padding-row check (``on`` / ``off``; one checked but not yet decided is decided
    now), None while nothing was checked or without them: what a checkpoint keeps for :func:`restore_pad_rows`."""
    pad = pad_rows_of(model)
    return None if pad is None else pad.verdict()


_WRAPPER_SEGMENTS = frozenset(("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"))


def _plain_name(name: str) -> str:
    """A module's name without the segments wrappers insert (FSDP1, activation checkpointing, a compiled
    module), wherever they stand: the same before and after ``accelerate.prepare``."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def pad_rows_own(model: nn.Module) -> list[str]:
    """The linears of ``model`` that select their own rows where SEBP runs, by name (the check found their dY far
    sparser than the padding; after :func:`unpatch_model` the plain linears keep the mark): what a checkpoint
    keeps beside the verdict, for :func:`restore_pad_rows`, and what a run's summary counts."""
    return sorted(_plain_name(n) for n, m in _unwrapped(model).named_modules() if vars(m).get("sebp_own_rows"))


def restore_pad_rows(model: nn.Module, verdict: str | None, own: Iterable[str] = ()) -> None:
    """A resumed run's padding rows take the verdict its process had reached (:func:`pad_rows_verdict`), and the
    linears named in ``own`` (:func:`pad_rows_own`) select their own rows again. Checked again instead, the
    first backwards after the resume would have the linears select their rows themselves, and their sums run
    over the rows in another order than the uninterrupted run's: values an ulp apart, not the same bits."""
    pad = pad_rows_of(model)
    if pad is not None and verdict in (ON, OFF):
        pad.state = verdict
        names = set(own)
        for name, module in _unwrapped(model).named_modules():
            if _plain_name(name) in names and isinstance(module, SEBPLinear):
                module.sebp_own_rows = True


def remove_pad_rows(model: nn.Module) -> None:
    """Take the hook of :func:`install_pad_rows` off (the PadRows stays, with its verdict, for a later patch). A
    check that awaits its verdict is decided first, so that the linears that select their own rows are marked
    while they are still the model's (:func:`unpatch_model` hands the mark on to the plain linears, and a later
    patch back to the SEBP ones)."""
    base = _backbone(model)
    pad = vars(base).get("_sebp_pad_rows")
    if pad is not None:
        pad.verdict()
    for key in [k for k, h in base._forward_pre_hooks.items() if h is _pad_rows_hook]:
        del base._forward_pre_hooks[key]
        base._forward_pre_hooks_with_kwargs.pop(key, None)
    pad = vars(base).get("_sebp_pad_rows")
    if pad is not None:
        pad.clear()


def unpatch_model(model: nn.Module) -> list[str]:
    """Put plain nn.Linear modules (same Parameters) back in place of every SEBPLinear, the original norm
    modules in place of every SEBPNorm (:func:`patch_norms`), and the original activations into the MLPs
    (:func:`patch_activations`) and their own forward into the experts (:mod:`.experts`); return their names."""
    acts = unpatch_activations(model) + unpatch_experts(model)
    remove_pad_rows(model)
    unpatch_embeddings(model)
    names = [n for n, m in model.named_modules() if isinstance(m, (SEBPLinear, SEBPNorm))]
    for name in names:
        m = model.get_submodule(name)
        _set_submodule(model, name, m.to_linear() if isinstance(m, SEBPLinear) else m.original())
    return names + acts


def patch_norms(model: nn.Module, config: SEBPConfig | None = None) -> list[str]:
    """Swap every LayerNorm and every RMSNorm its family's entry lists (:mod:`.families`) of ``model`` for an
    SEBPNorm (same Parameters; exact mode: the same gradients), whose backward skips the zero rows of dL/dY;
    return their names. Already swapped norms are left as they are."""
    family = family_of(model)
    rms = family.rms_norms if family else ()
    names = [n for n, m in model.named_modules() if n and norm_kind(m, rms) is not None]
    for name in names:
        _set_submodule(model, name, SEBPNorm(model.get_submodule(name), config, rms))
    return names


def patched_layers(model: nn.Module) -> dict[str, SEBPConfig]:
    """Module name -> SEBPConfig of every SEBPLinear in ``model``."""
    return {n: m.sebp_config for n, m in model.named_modules() if isinstance(m, SEBPLinear)}


def _linear_of(m: nn.Module) -> nn.Module:
    """The module that runs the GEMM: a peft LoRA layer's base layer, else ``m`` itself."""
    return getattr(m, "base_layer", m)


def activation_kind(module: nn.Module, family: Family | None) -> str | None:
    """``swiglu`` for a gated MLP of ``family``'s entry with SiLU, ``gelu`` for a BERT-like intermediate of its
    entry (a ``dense`` linear, then erf GELU), else None."""
    name = type(module).__name__
    if family is None:
        return None
    if name in family.gated_mlps:
        act = getattr(module, "act_fn", None)
        if (type(act).__name__ in ("SiLUActivation", "SiLU")
                and all(isinstance(_linear_of(getattr(module, p, None)), nn.Linear)
                        for p in ("gate_proj", "up_proj", "down_proj"))):
            return "swiglu"
    if name in family.gelu_mlps and isinstance(_linear_of(getattr(module, "dense", None)), nn.Linear):
        act = getattr(module, "intermediate_act_fn", None)
        if type(act).__name__ == "GELUActivation" and getattr(act, "act", None) is F.gelu:
            return "gelu"
    return None


def _swiglu_forward(self, x):
    return self.down_proj(sebp_swiglu(self.gate_proj(x), self.up_proj(x), self._sebp_act_rows))


def _gelu_forward(self, hidden_states):
    return sebp_gelu(self.dense(hidden_states), self._sebp_act_rows)


def _hinted(module: nn.Module, kind: str) -> list[nn.Module]:
    names = ("gate_proj", "up_proj") if kind == "swiglu" else ("dense",)
    return [_linear_of(getattr(module, n)) for n in names]


def patch_activations(model: nn.Module) -> list[str]:
    """Give every known MLP activation of ``model`` (:func:`activation_kind`) the SEBP activation: the same
    forward values, a backward over the non-zero rows of dL/dH, and its SEBP linears before it (gate/up, or
    the intermediate dense) take the rows it finds instead of selecting again (exact mode). Parameters and
    state_dict keys do not change. Call it after :func:`patch_model` (it hands the rows to the SEBPLinears
    present now; an MLP without any does not work them out); calling it again refreshes that. Returns the MLP
    modules' names."""
    names, family = [], family_of(model)
    for name, module in model.named_modules():
        kind = activation_kind(module, family)
        if kind is None:
            continue
        hint = vars(module).get("_sebp_act_hint")
        if hint is None:
            hint = RowHint()
            module._sebp_act_hint = hint
            module.forward = types.MethodType(_swiglu_forward if kind == "swiglu" else _gelu_forward, module)
        readers = [lin for lin in _hinted(module, kind) if isinstance(lin, SEBPLinear)]
        for lin in readers:
            lin._sebp_hint = hint
        module._sebp_act_rows = hint if readers else None  # no SEBP linear to read them: rows not worked out
        names.append(name)
    return names


def unpatch_activations(model: nn.Module) -> list[str]:
    """Undo :func:`patch_activations`; return the MLP modules' names."""
    names, family = [], family_of(model)
    for name, module in model.named_modules():
        if "_sebp_act_hint" not in vars(module):
            continue
        kind = activation_kind(module, family)
        del module._sebp_act_hint
        vars(module).pop("_sebp_act_rows", None)
        vars(module).pop("forward", None)
        for lin in _hinted(module, kind) if kind else []:
            if isinstance(lin, SEBPLinear):
                lin._sebp_hint = None
        names.append(name)
    return names


def patched_activations(model: nn.Module) -> list[str]:
    """Names of the MLP modules that run the SEBP activation."""
    return [n for n, m in model.named_modules() if "_sebp_act_hint" in vars(m)]
