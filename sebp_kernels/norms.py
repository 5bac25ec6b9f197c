"""LayerNorm and RMSNorm whose backward skips the zero rows of dL/dY (exact mode only).

The forward is computed exactly as before (``torch.native_layer_norm``, the op behind ``F.layer_norm``; for
RMSNorm the Llama/Qwen/Mistral formula, op for op). The backward runs over the rows of dY that hold a
non-zero: in a padded batch the padding rows of a norm's dY are exactly zero, like those of the linear
layers around it, so their dX rows are zero and they add nothing to dW and db. The gradients are the dense
ones (up to summation order). On CUDA one Triton pass does it (:mod:`._triton.norm`); elsewhere the torch
reference (:func:`.reference.norm_backward_torch`).

Only exact mode: a norm's backward is memory-bound, so dropping small rows would save little and change
the gradients.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Collection
from typing import Optional

import torch
from torch import Tensor, nn

from . import registry, zero_rows
from .config import SEBPConfig
from .modules import _take_over
from .library import plain_op
from .registry import as_dtype, if_wanted, placeholder, settings
from .reference import norm_backward_torch, records_grad, refuse_missing_triton, unit_col_stride

# Hugging Face RMSNorm classes whose forward is exactly sebp_rms_norm's formula (checked against transformers 5.x);
# the default of norm_kind / SEBPNorm (sebp_probe passes its model-family registry's classes instead).
RMS_NORM_CLASSES = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")


@functools.lru_cache(maxsize=1)
def _triton_norm():
    """(interpreter?, widest row, the Triton launcher, SM count of a device), or None without triton. Looked
    up once: imports on every backward cost host time."""
    try:
        from ._triton import backward as tb
        from ._triton.norm import MAX_N, norm_backward_triton
        from ._triton.select import _sm_count
    except ImportError:
        return None
    return tb.INTERPRET, MAX_N, norm_backward_triton, _sm_count


def _backward(config, dy, x, weight, mean, rstd, need_dx, need_dw, need_db, bias_dtype, n, pool=False):
    """Gradients over rows of ``n`` elements (the normalized dimensions flattened). ``pool``: dX may come from
    :mod:`.zero_rows` (when it is enabled; not for the compiled op)."""
    dy2, x2 = unit_col_stride(dy.reshape(-1, n)), unit_col_stride(x.reshape(-1, n))
    mean2 = mean.reshape(-1) if mean is not None else None
    tri = None if config.backend == "torch" else _triton_norm()
    refuse_missing_triton(config.backend, tri)
    if tri is not None and dy.device.type == ("cpu" if tri[0] else "cuda") and n <= tri[1] and dy2.shape[0]:
        interpret, _, launch, sm_count = tri
        keep = zero_rows.pooled(dy2.shape[0], n, x.dtype, dy.device) if pool and need_dx else None
        dx, dw, db = launch(dy2, x2, weight, mean2, rstd.reshape(-1), need_dx, need_dw, need_db,
                            sm_count(dy.device), interpret, bias_dtype, keep=keep)
    else:
        dx, dw, db = norm_backward_torch(dy2, x2, weight, mean2, rstd.reshape(-1), need_dx, need_dw, need_db)
        if db is not None and bias_dtype is not None:
            db = db.to(bias_dtype)
    return (dx.view(x.shape) if dx is not None else None), dw, db


class SEBPLayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, normalized_shape, eps, config):
        out, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        ctx.config = config
        ctx.normalized_shape = normalized_shape
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.save_for_backward(x, weight, mean, rstd)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        nx, nw, nb = ctx.needs_input_grad[:3]
        w = weight.reshape(-1) if weight is not None else None
        dx, dw, db = _backward(ctx.config, dy, x, w, mean, rstd, nx, nw, nb and ctx.bias_dtype is not None,
                               ctx.bias_dtype, math.prod(ctx.normalized_shape), pool=True)
        return (dx, dw.view(weight.shape) if dw is not None else None,
                db.view(weight.shape) if db is not None else None, None, None, None)


def _rms_norm(x, weight, eps):
    """(output, fp32 rstd) of Hugging Face's RMSNorm formula."""
    xf = x.to(torch.float32)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (xf * rstd).to(x.dtype), rstd


class SEBPRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, config):
        out, rstd = _rms_norm(x, weight, eps)
        ctx.config = config
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw, _ = _backward(ctx.config, dy, x, weight, None, rstd, ctx.needs_input_grad[0],
                              ctx.needs_input_grad[1], False, None, x.shape[-1], pool=True)
        return dx, dw, None, None


_EXACT = SEBPConfig()


# ------------------------------------------------------------------------- the compiled path (see .registry)

def _norm_backward(dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Optional[Tensor], rstd: Tensor,
                   need_dx: bool, need_dw: bool, need_db: bool, n: int, key: Optional[Tensor],
                   op_key: int) -> tuple[Tensor, Tensor, Tensor]:
    """(dX, dW, db) of the SEBP norm registered under ``key`` (a module's :func:`~.registry.key_tensor`), else
    under ``op_key`` (a module's int key, or a functional call's config's) over rows of ``n`` elements; dW and
    db flat."""
    config = settings(registry.lookup(key if key is not None else op_key))[0]
    wdt = weight.dtype if weight is not None else dy.dtype  # of dW, and of db (the bias has the weight's)
    w = weight.reshape(-1) if weight is not None else None
    dx, dw, db = _backward(config, dy, x, w, mean, rstd, need_dx, need_dw, need_db, wdt if need_db else None, n)
    return (as_dtype(dx, x.dtype) if need_dx else placeholder(dy), as_dtype(dw, wdt) if need_dw else placeholder(dy),
            as_dtype(db, wdt) if need_db else placeholder(dy))


def _norm_backward_fake(dy, x, weight, mean, rstd, need_dx, need_dw, need_db, n, key, op_key):
    wdt = weight.dtype if weight is not None else dy.dtype
    return (x.new_empty(x.shape) if need_dx else placeholder(dy),
            dy.new_empty(n, dtype=wdt) if need_dw else placeholder(dy),
            dy.new_empty(n, dtype=wdt) if need_db else placeholder(dy))


norm_backward = plain_op(_norm_backward, _norm_backward_fake)


class _LayerNorm(torch.autograd.Function):
    """``torch.native_layer_norm`` traced into the graph; its backward is the opaque :func:`norm_backward`."""

    @staticmethod
    def forward(x, weight, bias, normalized_shape, eps, key, op_key):
        return torch.native_layer_norm(x, normalized_shape, weight, bias, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, normalized_shape, eps, key, op_key = inputs
        _, mean, rstd = output
        ctx.mark_non_differentiable(mean, rstd)
        ctx.n, ctx.has_bias, ctx.op_key = math.prod(normalized_shape), bias is not None, op_key
        ctx.save_for_backward(x, weight, mean, rstd, key)

    @staticmethod
    def backward(ctx, dy, _dmean, _drstd):
        x, weight, mean, rstd, key = ctx.saved_tensors
        nx, nw, nb = ctx.needs_input_grad[:3]
        nb = nb and ctx.has_bias
        dx, dw, db = norm_backward(dy, x, weight, mean, rstd, nx, nw, nb, ctx.n, key, ctx.op_key)
        return (if_wanted(dx, nx), dw.view(weight.shape) if nw else None,
                db.view(weight.shape) if nb else None, None, None, None, None)


class _RMSNorm(torch.autograd.Function):
    """The RMSNorm formula traced into the graph; its backward is the opaque :func:`norm_backward`."""

    @staticmethod
    def forward(x, weight, eps, key, op_key):
        return _rms_norm(x, weight, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, eps, key, op_key = inputs
        _, rstd = output
        ctx.mark_non_differentiable(rstd)
        ctx.op_key = op_key
        ctx.save_for_backward(x, weight, rstd, key)

    @staticmethod
    def backward(ctx, dy, _drstd):
        x, weight, rstd, key = ctx.saved_tensors
        nx, nw = ctx.needs_input_grad[:2]
        dx, dw, _ = norm_backward(dy, x, weight, None, rstd, nx, nw, False, x.shape[-1], key, ctx.op_key)
        return if_wanted(dx, nx), (dw.view(weight.shape) if nw else None), None, None, None


def traced_layer_norm(x, weight, bias, normalized_shape: list[int], eps: float, key: Optional[Tensor],
                      op_key: int) -> Tensor:
    """A compiled SEBP LayerNorm: its module's ``key``, or (a functional call) None and its config's ``op_key``."""
    return _LayerNorm.apply(x, weight, bias, normalized_shape, eps, key, op_key)[0]


def traced_rms_norm(x, weight, eps: float, key: Optional[Tensor], op_key: int) -> Tensor:
    """A compiled SEBP RMSNorm (keys as :func:`traced_layer_norm`'s)."""
    return _RMSNorm.apply(x, weight, eps, key, op_key)[0]


def _check(config: SEBPConfig | None) -> SEBPConfig:
    config = config or _EXACT
    if config.mode != "exact":
        raise ValueError(f"SEBP norms support exact mode only, got {config.mode!r}")
    return config


def sebp_layer_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, eps: float = 1e-5,
                    config: SEBPConfig | None = None, _key: int | torch.Tensor | None = None) -> torch.Tensor:
    """``F.layer_norm`` whose backward skips the zero rows of dL/dY. Under CUDA autocast it runs in fp32, as
    autocast runs ``layer_norm`` there (CPU autocast leaves it in the input's dtype, and so does this).
    ``_key``: the calling SEBPNorm's key (:mod:`.registry`; inside ``torch.compile``: the custom op's)."""
    config = _check(config)
    shape = tuple(normalized_shape) if not isinstance(normalized_shape, int) else (normalized_shape,)
    dev = x.device.type
    if dev == "cuda" and torch.is_autocast_enabled(dev) and x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
        weight = weight.float() if weight is not None else None
        bias = bias.float() if bias is not None else None
        with torch.autocast(dev, enabled=False):
            return _layer_norm(x, weight, bias, shape, eps, config, _key)
    return _layer_norm(x, weight, bias, shape, eps, config, _key)


def _layer_norm(x, weight, bias, shape, eps, config, key):
    if not records_grad(x, weight, bias):  # no backward to come: the Function's own op without the Function
        return torch.native_layer_norm(x, shape, weight, bias, eps)[0]
    if torch.compiler.is_compiling():
        return traced_layer_norm(x, weight, bias, list(shape), eps, *registry.op_keys(key, config.op_key))
    return SEBPLayerNormFunction.apply(x, weight, bias, shape, eps, config)


def sebp_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                  config: SEBPConfig | None = None, _key: int | torch.Tensor | None = None) -> torch.Tensor:
    """The Llama/Qwen RMSNorm (``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``, statistics in fp32),
    whose backward skips the zero rows of dL/dY."""
    config = _check(config)
    if not records_grad(x, weight):  # no backward to come: the formula alone
        return _rms_norm(x, weight, eps)[0]
    if torch.compiler.is_compiling():
        return traced_rms_norm(x, weight, eps, *registry.op_keys(_key, config.op_key))
    return SEBPRMSNormFunction.apply(x, weight, eps, config)


def norm_kind(module: nn.Module, rms_classes: Collection[str] = RMS_NORM_CLASSES) -> str | None:
    """``layer`` for an nn.LayerNorm over the last dimension, ``rms`` for an RMSNorm of one of the class names
    ``rms_classes`` (their forward: :func:`sebp_rms_norm`'s formula), else None."""
    if type(module) is nn.LayerNorm and len(module.normalized_shape) == 1:
        return "layer"
    w = getattr(module, "weight", None)
    if (type(module).__name__ in rms_classes and isinstance(w, nn.Parameter) and w.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", None), float)):
        return "rms"
    return None


class SEBPNorm(nn.Module):
    """A LayerNorm or RMSNorm (see :func:`norm_kind`) with the SEBP backward, holding the *same* Parameters as
    the module it replaces (same state_dict keys); :meth:`original` gives that module back."""

    _sebp_key_input = False  # the key as a tensor input of compiled graphs (.registry.keys_as_inputs)

    def __init__(self, original: nn.Module, config: SEBPConfig | None = None,
                 rms_classes: Collection[str] = RMS_NORM_CLASSES):
        super().__init__()
        kind = norm_kind(original, rms_classes)
        if kind is None:
            raise TypeError(f"expected an nn.LayerNorm or one of {', '.join(rms_classes)}, "
                            f"got {type(original).__name__}")
        self.kind = kind
        self.sebp_config = _check(config)
        object.__setattr__(self, "_original", original)  # not a submodule: the state_dict keys stay
        self.weight = original.weight
        if kind == "layer":
            self.bias = original.bias
            self.normalized_shape = tuple(original.normalized_shape)
            self.eps = original.eps
        else:
            self.eps = original.variance_epsilon
        _take_over(self, original)
        registry.name_module(self)  # names this norm inside compiled graphs

    def __setstate__(self, state):  # copies (deepcopy, pickle) get a key of their own
        super().__setstate__(state)
        registry.name_module(self)

    def original(self) -> nn.Module:
        """The module this one replaced, holding this one's current Parameters (a wrapper such as FSDP may have
        swapped them since)."""
        m = self._original
        for name in ("weight", "bias") if self.kind == "layer" else ("weight",):
            p = getattr(self, name)
            if isinstance(p, nn.Parameter):
                setattr(m, name, p)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = registry.graph_key(self)
        if self.kind == "layer":
            return sebp_layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps, self.sebp_config, key)
        return sebp_rms_norm(x, self.weight, self.eps, self.sebp_config, key)

    def extra_repr(self) -> str:
        n = self.weight.shape[0] if self.weight is not None else math.prod(self.normalized_shape)
        return f"{self.kind}, {n}, eps={self.eps}"
