"""The loss of a packed batch (:class:`~sebp_probe.data.batching.PackedCollator`), equal to that of the same
sequences padded: attention never crosses a sequence, positions restart for each sequence.

Two attention layouts (``backend``), for decoders' causal LMs and encoders' classifiers alike (the families of
:mod:`sebp_probe.families` marked ``packed``):

- ``varlen``: the rows' real tokens flattened into one row, attention per sequence by flash attention's
  variable-length kernel (``torch.nn.attention.varlen.varlen_attn``) given the sequences' offsets, causal for
  decoders and in both directions for encoders (each attention module's ``is_causal``); no padding and no mask
  at all. Chosen by default where it runs the model exactly (:func:`varlen_blocker`): CUDA, bf16/fp16, no
  attention dropout while training (the kernel has none), no sliding window.
- ``mask``, everywhere else: the collator's rows. Decoders get ``position_ids`` and no attention mask:
  transformers then builds a causal mask per sequence from where the positions restart (only without a cache,
  hence ``use_cache=False``). Encoders get an additive 4-D mask, 0 within a sequence and the dtype's minimum
  elsewhere (a boolean 4-D mask would be added as 0/1 by eager attention): attention then runs over every pair
  of a row, across sequences too, and the mask throws most of it away.

A classifier's loss is over sequences: each sequence's first token ([CLS], <s>) is what the model's own pooler
(BERT) or classification head (RoBERTa, ELECTRA) reads (the registry's ``first_token`` module), gathered by a
hook on that module (at the sequences' offsets in the flattened row under ``varlen``, at their places in the
rows under ``mask``), so the model's head and loss run unchanged on one row per sequence.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator

import torch

from ..data.batching import PackingError
from ..families import FAMILIES, family_of, names
from ..layouts import PADDED

VARLEN = "sebp_varlen"  # the attention implementation name under which varlen runs (sdpa for other calls)
# the padded layouts, nearest to packed first
OTHER_LAYOUTS = f"use --padding {', '.join(PADDED[:0:-1])} or {PADDED[0]}"


def _find_kernel() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


VARLEN_KERNEL: Callable | None = _find_kernel()  # replaceable: tests put a per-sequence sdpa here


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside peft, DDP/FSDP and ``torch.compile`` wrappers."""
    # from the submodule: Dynamo in torch 2.11 cannot trace an import from transformers' lazy top-level
    # module, and this runs inside compiled steps (a graph break there, or the whole frame left eager)
    from transformers.modeling_utils import PreTrainedModel

    m = model
    while not isinstance(m, PreTrainedModel):
        if hasattr(m, "get_base_model"):
            m = m.get_base_model()
        elif isinstance(getattr(m, "module", None), torch.nn.Module):
            m = m.module
        elif isinstance(getattr(m, "_orig_mod", None), torch.nn.Module):
            m = m._orig_mod
        else:
            raise PackingError(f"padding 'packed' needs a transformers model, not {type(model).__name__}")
    return m


CAUSAL_LMS = ("ForCausalLM", "LMHeadModel")  # the class names of causal LMs (GPT-2's is GPT2LMHeadModel)


def _kind(base: torch.nn.Module) -> str:
    family, name = family_of(base), type(base).__name__
    # a packed family without a first-token module is a decoder family (Llama-like, or GPT-2)
    if family is not None and family.packed and not family.first_token and name.endswith(CAUSAL_LMS):
        return "decoder"
    if family is not None and family.packed and family.first_token and name.endswith("ForSequenceClassification"):
        return "encoder"
    decoders = names(lambda f: f.packed and not f.first_token)
    encoders = names(lambda f: f.packed and f.first_token)
    raise PackingError(f"padding 'packed' runs exactly only on {', '.join(decoders)} causal LMs and "
                       f"{', '.join(encoders)} classifiers, not {name}; {OTHER_LAYOUTS}")


def check_packable(model: torch.nn.Module, task: str) -> None:
    """Raise :class:`PackingError` (one line) unless packed batches of ``task`` run exactly on ``model``."""
    base = unwrap(model)
    kind = _kind(base)
    if (kind == "decoder") != (task == "causal-lm"):
        raise PackingError(f"padding 'packed' cannot train {type(base).__name__} for {task}; {OTHER_LAYOUTS}")
    attn = base.config._attn_implementation
    if attn not in ("sdpa", "eager", VARLEN):
        raise PackingError(f"padding 'packed' needs the 'sdpa' or 'eager' attention, not {attn!r}; load the "
                           f"model with one of them, or {OTHER_LAYOUTS}")


def _attention_dropout(config) -> float:
    return float(getattr(config, "attention_dropout", 0.0) or getattr(config, "attention_probs_dropout_prob", 0.0))


def _sliding(config) -> bool:
    types = getattr(config, "layer_types", None)
    if types:
        return any(t != "full_attention" for t in types)
    return getattr(config, "sliding_window", None) is not None  # Mistral: one window for every layer


def varlen_blocker(config, device: str, dtype: torch.dtype, training: bool) -> str | None:
    """Why flash attention's varlen kernel cannot run packed rows of a model of ``config`` exactly (None: it
    can), the model on ``device`` (a device type) computing in ``dtype`` (the autocast dtype where autocast is
    on), in training mode or not. The kernel needs CUDA, bf16/fp16 and the sdpa attention; it has no dropout
    (``varlen_attn`` takes no ``dropout_p``), so a model that trains with attention dropout (BERT's configs ship
    ``attention_probs_dropout_prob`` 0.1) keeps the block mask, whose sdpa call draws it; it runs no sliding
    window here. Decoders and encoders alike: the kernel runs causal or not as each attention module says."""
    if VARLEN_KERNEL is None:
        return "this torch has no torch.nn.attention.varlen"
    if device != "cuda":
        return "flash attention's varlen kernel needs a CUDA GPU"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"flash attention computes in bf16 or fp16, not {str(dtype).removeprefix('torch.')}"
    if config._attn_implementation not in ("sdpa", VARLEN):
        return f"varlen replaces the 'sdpa' attention, not {config._attn_implementation!r}"
    if training and _attention_dropout(config) > 0:
        return f"varlen_attn has no attention dropout (the model trains with {_attention_dropout(config):g})"
    if _sliding(config):
        return "varlen attention runs no sliding window"
    return None


def attention_backend(model: torch.nn.Module) -> str:
    """``varlen`` where flash attention's varlen kernel can run the model exactly (:func:`varlen_blocker`:
    CUDA, bf16/fp16 compute, sdpa attention, no attention dropout while training, no sliding window), else
    ``mask``."""
    base = unwrap(model)
    p = next(base.parameters())
    device = p.device.type
    autocast = device == "cuda" and torch.is_autocast_enabled("cuda")
    dtype = torch.get_autocast_dtype("cuda") if autocast else p.dtype
    return "mask" if varlen_blocker(base.config, device, dtype, base.training) else "varlen"


# ------------------------------------------------------------------------------------------- varlen backend


_flat = {"active": False}  # set while a flattened batch runs: its mask builder then builds no mask


@contextlib.contextmanager
def _flat_call() -> Iterator[None]:
    _flat["active"] = True
    try:
        yield
    finally:
        _flat["active"] = False


def _varlen_mask(*args, **kwargs):
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    # Without this, transformers would expand the flattened row's restarting positions into a [T, T] mask.
    return None if _flat["active"] else ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)


@functools.lru_cache(maxsize=8)
def _params_of(fn: Callable) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


@torch.compiler.assume_constant_result
def _kernel_params() -> tuple[str, ...]:
    """The parameter names of ``VARLEN_KERNEL``. Under ``torch.compile`` Dynamo runs this once per trace, outside
    the graph, and takes the result as a constant (``inspect`` inside traced code would break the graph); a
    kernel swapped later fails the guard on ``VARLEN_KERNEL`` and retraces."""
    return _params_of(VARLEN_KERNEL)


def _run_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
                scale: float | None, causal: bool) -> torch.Tensor:
    """``VARLEN_KERNEL`` on [T, heads, dim] tensors, across the signatures torch's versions gave it. ``max_len``:
    a Python int (the collator's ``max_seqlen``), so that no traced code reads it from a tensor."""
    fn = VARLEN_KERNEL
    params = _kernel_params()
    kw = {}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:  # query head h reads key/value head h // group, as transformers' repeat_kv lays them out
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if "scale" in params:
        kw["scale"] = scale
    elif scale is not None and scale != q.shape[-1] ** -0.5:
        q = q * (scale * q.shape[-1] ** 0.5)
    if "window_size" in params:
        kw["window_size"] = (-1, 0) if causal else (-1, -1)
    elif "is_causal" in params:
        kw["is_causal"] = causal
    elif causal:
        raise PackingError("this torch's varlen_attn has no causal mode; pass backend='mask'")
    return fn(q, k, v, cu, cu, max_len, max_len, **kw)


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """A transformers attention function: per sequence of ``cu_seq_lens_q`` when given (one flattened row of
    [1, heads, T, dim]), else sdpa attention."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    if dropout > 0:
        raise PackingError("varlen attention has no attention dropout; set it to 0 or pass backend='mask'")
    # Mistral's attention has no sliding_window of its own: its config's holds for every layer
    if getattr(module, "sliding_window", getattr(getattr(module, "config", None), "sliding_window", None)):
        raise PackingError("varlen attention has no sliding window; pass backend='mask'")
    if query.shape[0] != 1 or attention_mask is not None:
        raise PackingError("varlen attention takes one flattened row and no attention mask")
    device = query.device.type
    # Under autocast, rotary embeddings leave query and key in fp32 while value is in the autocast dtype.
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else value.dtype
    q, k, v = (t[0].transpose(0, 1).to(dtype).contiguous() for t in (query, key, value))
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = _run_kernel(q, k, v, cu, kwargs["max_length_q"], scaling, causal)
    return out.unsqueeze(0), None


def enable_varlen(model: torch.nn.Module) -> None:
    """Switch ``model`` (sdpa attention) to :func:`varlen_attention`; calls without sequence offsets still run
    sdpa, with the usual masks."""
    from transformers.modeling_utils import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    base = unwrap(model)
    attn = base.config._attn_implementation
    if attn == VARLEN:
        return
    if attn != "sdpa":
        raise PackingError(f"varlen attention replaces the 'sdpa' attention, not {attn!r}; pass backend='mask'")
    AttentionInterface.register(VARLEN, varlen_attention)
    AttentionMaskInterface.register(VARLEN, _varlen_mask)
    base.set_attn_implementation(VARLEN)


# ------------------------------------------------------------------------------------------------ the loss


def _gather_first_tokens(module: torch.nn.Module, args: tuple) -> tuple | None:
    index = module.__dict__.get("_sebp_first_tokens")
    if index is None:
        return None
    hidden = args[0]
    return (hidden.reshape(-1, hidden.shape[-1])[index].unsqueeze(1), *args[1:])


@contextlib.contextmanager
def _first_tokens(base: torch.nn.Module, index: torch.Tensor | None) -> Iterator[None]:
    """While set, the module that reads token 0 of each row reads each sequence's first token instead. The hook
    stays installed (a no-op between calls) so that a compiled model does not see its hooks change."""
    if index is None:
        yield
        return
    head = base
    for name in FAMILIES[base.config.model_type].first_token:
        head = getattr(head, name)
    if not head.__dict__.get("_sebp_gather_hook"):
        head.register_forward_pre_hook(_gather_first_tokens)
        head._sebp_gather_hook = True
    head._sebp_first_tokens = index
    try:
        yield
    finally:
        head._sebp_first_tokens = None


def block_mask(sequence_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive [rows, 1, L, L] mask of packed rows: 0 where query and key are of the same sequence."""
    same = sequence_ids[:, None, :, None] == sequence_ids[:, None, None, :]
    return torch.zeros(same.shape, dtype=dtype, device=same.device).masked_fill_(~same, torch.finfo(dtype).min)


@contextlib.contextmanager
def packed_call(model: torch.nn.Module, batch: dict, backend: str | None = None, **kwargs) -> Iterator[dict]:
    """The keyword arguments that run ``model`` on a packed batch (on the model's device), valid inside the block
    (varlen: no mask is built; classifiers: the head reads each sequence's first token). ``labels`` among them
    are per token of the rows (``mask``) or of the flattened row (``varlen``) for causal LMs. ``backend``:
    ``mask`` or ``varlen``, default :func:`attention_backend`. ``kwargs`` go to the model."""
    base = unwrap(model)
    kind = _kind(base)
    backend = backend or attention_backend(model)
    ids, pos, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
    cu, flat = batch["cu_seqlens"], batch["flat_index"]
    if FAMILIES[base.config.model_type].position_offset:  # RoBERTa: positions count from padding_idx + 1
        pos = pos + (base.config.pad_token_id + 1)
    if backend == "varlen":
        enable_varlen(base)
        ids, pos = ids.reshape(-1)[flat][None], pos.reshape(-1)[flat][None]
        if kind == "decoder":
            labels = labels.reshape(-1)[flat][None]
        m = batch["max_seqlen"]
        if torch.is_tensor(m):  # reading it would wait for the device, and break a compiled graph
            raise PackingError("a packed batch's max_seqlen must be a Python int, as PackedCollator gives it")
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=m, max_length_k=m)
        first, ctx = cu[:-1].long(), _flat_call()
    elif backend == "mask":
        if kind == "encoder":
            kwargs["attention_mask"] = block_mask(batch["sequence_ids"], base.get_input_embeddings().weight.dtype)
        first, ctx = flat[cu[:-1].long()], contextlib.nullcontext()
    else:
        raise ValueError(f"unknown packed attention backend {backend!r}; choose 'mask' or 'varlen'")
    if kind == "decoder":
        kwargs["use_cache"] = False  # with a cache, transformers builds no per-sequence mask
    with ctx, _first_tokens(base, first if kind == "encoder" else None):
        yield dict(input_ids=ids, position_ids=pos, labels=labels, **kwargs)


def packed_forward(model: torch.nn.Module, batch: dict, backend: str | None = None, **kwargs):
    """The model's output on a packed batch (on the model's device): ``loss`` as for the same sequences padded;
    ``logits`` per sequence in layout order (classifiers) or per token of the rows (``mask``) or of the
    flattened row (``varlen``) for causal LMs. ``backend`` and ``kwargs`` as for :func:`packed_call`."""
    with packed_call(model, batch, backend, **kwargs) as inputs:
        return model(**inputs)


def packed_loss(model: torch.nn.Module, batch: dict, task: str) -> torch.Tensor:
    """The loss of a packed batch, for the training loop: classification the mean over sequences, causal LM
    the mean over label tokens, as for the same sequences padded."""
    check_packable(model, task)
    return packed_forward(model, batch).loss
