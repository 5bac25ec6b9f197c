"""The SEBP layers' backward as ``torch.library`` custom ops, for ``torch.compile``.

Eager code runs the autograd Functions of :mod:`.functional`, :mod:`.norms` and :mod:`.activations`. Dynamo
cannot trace those Functions' backwards (Triton launches, per-layer Python state), so before this module it
broke the graph around every SEBP op: on an H100, BERT-base with SEBP linears, norms and activations compiled
into 38 graphs and stepped 1.8x slower than eager SEBP (``results/h100_compile_speed_before_ops.json``).

Here the backward of each SEBP layer is one opaque op with a fake (shape-only) implementation, so Dynamo and
AOTAutograd put everything into one graph and Inductor compiles the code between them. The linears and norms
are autograd Functions whose forward is plain torch code that Dynamo traces (Inductor fuses it with its
neighbours) and whose backward calls the op (:func:`linear_backward`, :func:`norm_backward`). The
activations are an op both ways (:func:`act`, whose forward also flags non-finite rows in the same pass).
The ops carry integer keys instead of Python objects: :func:`register` maps a key to the module (or
:class:`~.activations.RowHint`, :class:`~.density.RowDensity`) whose settings and state the backward reads
when it runs, so a compiled graph always uses the module's current config, density estimate and hints. The
modules (``SEBPLinear``, ``SEBPNorm``) and ``patch_activations`` take this path only while Dynamo traces
(``torch.compiler.is_compiling()``); eager runs are unchanged.
"""
from __future__ import annotations

import itertools
import math
import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

_OBJECTS: dict[int, weakref.ref] = {}
_KEYS = itertools.count(1)


def register(obj) -> int:
    """A new integer key for ``obj`` (held weakly; the key dies with it). 0 stands for None."""
    key = next(_KEYS)
    _OBJECTS[key] = weakref.ref(obj, lambda _, k=key: _OBJECTS.pop(k, None))
    return key


def lookup(key: int):
    """The object registered under ``key`` (None for 0; a negative key is an :class:`~.config.SEBPConfig`'s
    ``op_key``)."""
    if key == 0:
        return None
    if key < 0:
        from .config import CONFIG_OF_KEY

        return CONFIG_OF_KEY[key]
    ref = _OBJECTS.get(key)
    obj = ref() if ref is not None else None
    if obj is None:
        raise RuntimeError(f"sebp: the layer of compiled op key {key} no longer exists (recompile the model)")
    return obj


def _settings(obj):
    """(config, density state, row hint) of a registered module, or of a bare config (functional calls)."""
    from .config import SEBPConfig

    if isinstance(obj, SEBPConfig):
        return obj, None, None
    return obj.sebp_config, getattr(obj, "_sebp_density", None), getattr(obj, "_sebp_hint", None)


def _if_wanted(t: Tensor, wanted: bool):
    return t if wanted else None


def _placeholder(like: Tensor) -> Tensor:
    """The output of a gradient that was not asked for (custom ops return tensors, not None)."""
    return like.new_empty(0)


# ---------------------------------------------------------------------------------------------- linear


@torch.library.custom_op("sebp::linear_backward", mutates_args=())
def linear_backward(dy: Tensor, x: Optional[Tensor], weight: Tensor, need_dx: bool, need_dw: bool,
                    need_db: bool, key: int, state_key: int, hint_key: int) -> tuple[Tensor, Tensor, Tensor]:
    """(dX, dW, db) of the SEBP linear registered under ``key`` (empty tensors where not asked for). A
    functional call's key is its config's; then ``state_key`` / ``hint_key`` name its RowDensity / RowHint (0:
    none). A module's key brings the module's own."""
    from .functional import linear_grads

    config, state, hint = _settings(lookup(key))
    if key < 0:
        state, hint = lookup(state_key), lookup(hint_key)
    dx, dw, db = linear_grads(dy, x, weight, config, need_dx, need_dw, need_db, state, hint)
    return (dx.view(*dy.shape[:-1], weight.shape[1]).to(dy.dtype) if need_dx else _placeholder(dy),
            dw.to(weight.dtype) if need_dw else _placeholder(dy), db.to(dy.dtype) if need_db else _placeholder(dy))


@linear_backward.register_fake
def _(dy, x, weight, need_dx, need_dw, need_db, key, state_key, hint_key):
    return (dy.new_empty((*dy.shape[:-1], weight.shape[1])) if need_dx else _placeholder(dy),
            weight.new_empty(weight.shape) if need_dw else _placeholder(dy),
            dy.new_empty(weight.shape[0]) if need_db else _placeholder(dy))


class _Linear(torch.autograd.Function):
    """``F.linear`` traced into the graph; its backward is the opaque :func:`linear_backward`."""

    @staticmethod
    def forward(x, weight, bias, key, state_key, hint_key):
        return F.linear(x, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, key, state_key, hint_key = inputs
        ctx.keys, ctx.has_bias = (key, state_key, hint_key), bias is not None
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        nx, nw, nb = ctx.needs_input_grad[:3]
        nb = nb and ctx.has_bias
        if not (nx or nw or nb):
            return None, None, None, None, None, None
        dx, dw, db = linear_backward(dy, x, weight, nx, nw, nb, *ctx.keys)
        return _if_wanted(dx, nx), _if_wanted(dw, nw), _if_wanted(db, nb), None, None, None


def traced_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], key: int, state_key: int = 0,
                  hint_key: int = 0) -> Tensor:
    """What a compiled SEBP linear runs: the module under ``key``, or a functional call (``key`` its config's
    ``op_key``, with the keys of its RowDensity and RowHint, 0 for none)."""
    return _Linear.apply(x, weight, bias, key, state_key, hint_key)


# ---------------------------------------------------------------------------------------------- norms


@torch.library.custom_op("sebp::norm_backward", mutates_args=())
def norm_backward(dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Optional[Tensor], rstd: Tensor,
                  need_dx: bool, need_dw: bool, need_db: bool, n: int, key: int) -> tuple[Tensor, Tensor, Tensor]:
    """(dX, dW, db) of the SEBP norm registered under ``key`` over rows of ``n`` elements; dW and db flat."""
    from .norms import _backward

    config = _settings(lookup(key))[0]
    wdt = weight.dtype if weight is not None else dy.dtype  # of dW, and of db (the bias has the weight's)
    w = weight.reshape(-1) if weight is not None else None
    dx, dw, db = _backward(config, dy, x, w, mean, rstd, need_dx, need_dw, need_db, wdt if need_db else None, n)
    return (dx.to(x.dtype) if need_dx else _placeholder(dy), dw.to(wdt) if need_dw else _placeholder(dy),
            db.to(wdt) if need_db else _placeholder(dy))


@norm_backward.register_fake
def _(dy, x, weight, mean, rstd, need_dx, need_dw, need_db, n, key):
    wdt = weight.dtype if weight is not None else dy.dtype
    return (x.new_empty(x.shape) if need_dx else _placeholder(dy),
            dy.new_empty(n, dtype=wdt) if need_dw else _placeholder(dy),
            dy.new_empty(n, dtype=wdt) if need_db else _placeholder(dy))


class _LayerNorm(torch.autograd.Function):
    """``torch.native_layer_norm`` traced into the graph; its backward is the opaque :func:`norm_backward`."""

    @staticmethod
    def forward(x, weight, bias, normalized_shape, eps, key):
        return torch.native_layer_norm(x, normalized_shape, weight, bias, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, normalized_shape, eps, key = inputs
        _, mean, rstd = output
        ctx.mark_non_differentiable(mean, rstd)
        ctx.key, ctx.n, ctx.has_bias = key, math.prod(normalized_shape), bias is not None
        ctx.save_for_backward(x, weight, mean, rstd)

    @staticmethod
    def backward(ctx, dy, _dmean, _drstd):
        x, weight, mean, rstd = ctx.saved_tensors
        nx, nw, nb = ctx.needs_input_grad[:3]
        nb = nb and ctx.has_bias
        dx, dw, db = norm_backward(dy, x, weight, mean, rstd, nx, nw, nb, ctx.n, ctx.key)
        return (_if_wanted(dx, nx), dw.view(weight.shape) if nw else None,
                db.view(weight.shape) if nb else None, None, None, None)


class _RMSNorm(torch.autograd.Function):
    """The RMSNorm formula traced into the graph; its backward is the opaque :func:`norm_backward`."""

    @staticmethod
    def forward(x, weight, eps, key):
        from .norms import _rms_norm

        return _rms_norm(x, weight, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, eps, key = inputs
        _, rstd = output
        ctx.mark_non_differentiable(rstd)
        ctx.key = key
        ctx.save_for_backward(x, weight, rstd)

    @staticmethod
    def backward(ctx, dy, _drstd):
        x, weight, rstd = ctx.saved_tensors
        nx, nw = ctx.needs_input_grad[:2]
        dx, dw, _ = norm_backward(dy, x, weight, None, rstd, nx, nw, False, x.shape[-1], ctx.key)
        return _if_wanted(dx, nx), (dw.view(weight.shape) if nw else None), None, None


def traced_layer_norm(x, weight, bias, normalized_shape: list[int], eps: float, key: int) -> Tensor:
    return _LayerNorm.apply(x, weight, bias, normalized_shape, eps, key)[0]


def traced_rms_norm(x, weight, eps: float, key: int) -> Tensor:
    return _RMSNorm.apply(x, weight, eps, key)[0]


# ---------------------------------------------------------------------------------------------- activations


@torch.library.custom_op("sebp::act", mutates_args=())
def act(kind: str, a: Tensor, b: Optional[Tensor], backend: str, hint_key: int) -> tuple[Tensor, Tensor]:
    """(output, per-row NaN/Inf flags or an empty tensor) of the SEBP activation ``kind``."""
    from .activations import act_forward

    h, bad = act_forward(kind, a, b, backend)
    return h, (bad if bad is not None else _placeholder(a))


@act.register_fake
def _(kind, a, b, backend, hint_key):
    from .activations import _use_triton

    flags = _placeholder(a)
    if _use_triton(backend, *(t for t in (a, b) if t is not None)) is not None:
        flags = a.new_empty(math.prod(a.shape[:-1]), dtype=torch.int8)
    return a.new_empty(a.shape), flags


@torch.library.custom_op("sebp::act_backward", mutates_args=())
def act_backward(kind: str, dh: Tensor, a: Tensor, b: Optional[Tensor], bad: Tensor, need_a: bool,
                 need_b: bool, backend: str, hint_key: int) -> tuple[Tensor, Tensor]:
    """(dA, dB) of the SEBP activation (empty where not asked for); rows handed to the hint under ``hint_key``."""
    from .activations import act_grads

    da, db = act_grads(kind, dh, a, b, bad if bad.numel() else None, need_a, need_b, backend, lookup(hint_key))
    return (da.to(a.dtype) if need_a else _placeholder(dh)), (db.to(a.dtype) if need_b else _placeholder(dh))


@act_backward.register_fake
def _(kind, dh, a, b, bad, need_a, need_b, backend, hint_key):
    return (a.new_empty(a.shape) if need_a else _placeholder(dh),
            a.new_empty(a.shape) if need_b else _placeholder(dh))


def _act_setup(ctx, inputs, output):
    kind, a, b, backend, hint_key = inputs
    _, bad = output
    ctx.mark_non_differentiable(bad)
    ctx.kind, ctx.backend, ctx.has_b, ctx.hint_key = kind, backend, b is not None, hint_key
    ctx.save_for_backward(a, b, bad)


def _act_grad(ctx, dh, _dbad):
    a, b, bad = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[1], ctx.needs_input_grad[2] and ctx.has_b
    if not (need_a or need_b):
        return None, None, None, None
    da, db = act_backward(ctx.kind, dh, a, b, bad, need_a, need_b, ctx.backend, ctx.hint_key)
    return None, _if_wanted(da, need_a), _if_wanted(db, need_b), None, None


act.register_autograd(_act_grad, setup_context=_act_setup)
