"""The SEBP linear as an autograd Function.

A linear layer ``Y = X Wᵀ + b`` has three GEMMs. The forward is kept exactly as ``F.linear``; the backward
computes the other two (and the bias reduction) over the *active* rows of dL/dY only, with rows being all
leading dimensions flattened (M = batch x seq):

    dX = dY @ W          (M x out) @ (out x in)   -> rows of inactive dY are zero
    dW = dYᵀ @ X         (out x M) @ (M x in)     -> the sum runs over active rows only
    db = dY.sum(0)                                -> likewise

Which rows are active is set by :class:`SEBPConfig` (``exact``, ``threshold``, ``topk``; ``sampled`` draws them,
:mod:`.sampling`). Products whose
input does not need a gradient (``ctx.needs_input_grad``) are skipped: a frozen weight costs no dW at all,
and its input is not even saved.
"""
from __future__ import annotations

import functools
import importlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import registry, zero_rows
from .config import SEBPConfig
from .density import RowDensity
from .forward_rows import could_pay, linear_maybe_over_rows
from .library import plain_op
from .pad_rows import bind_traced, forward_rows_traced
from .registry import as_dtype, if_wanted, placeholder, settings
from .reference import records_grad, refuse_missing_triton, sebp_backward_torch
from .sampling import SampleState, sampled_backward_torch as sebp_sampled

_DEFAULT = SEBPConfig()


@functools.lru_cache(maxsize=1)
def _triton_backward():
    """The Triton backward launcher, or None where triton is not importable (looked up once: an import on
    every backward cost a few microseconds of host time per layer)."""
    try:
        from ._triton import sebp_backward_triton
    except ImportError:
        return None
    return sebp_backward_triton


@functools.lru_cache(maxsize=1)
def _triton_sampled():
    """Sampled mode's Triton backward (:mod:`._triton.sampled`; imported where :func:`_triton_backward` is)."""
    from ._triton.sampled import sampled_backward_triton

    return sampled_backward_triton


def resolve_backend(config: SEBPConfig, device: torch.device):
    """The backward implementation for ``config`` on ``device``."""
    if config.backend == "torch":
        return sebp_backward_torch
    triton_fn = _triton_backward() if (device.type == "cuda" or config.backend == "triton") else None
    if config.backend == "triton":
        refuse_missing_triton(config.backend, triton_fn)
        return triton_fn
    return triton_fn if (triton_fn is not None and device.type == "cuda") else sebp_backward_torch


class SEBPLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, config, state=None, hint=None, rows=None):
        ctx.config = config
        ctx.state = state
        ctx.hint = hint
        ctx.x_shape = x.shape
        need_dw = ctx.needs_input_grad[1]
        ctx.save_for_backward(x if need_dw else None, weight)
        return linear_maybe_over_rows(x, weight, bias, rows)  # rows: the real-token rows alone (.forward_rows)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        if not (need_dx or need_dw or need_db):
            return (None,) * 7
        dx, dw, db = linear_grads(dy, x, weight, ctx.config, need_dx, need_dw, need_db, ctx.state, ctx.hint,
                                  pool=True)
        if dx is not None:
            dx = dx.view(ctx.x_shape)
        return dx, dw, db, None, None, None, None


def linear_grads(dy, x, weight, config, need_dx, need_dw, need_db, state=None, hint=None, pool=False):
    """(dX as 2-D rows, dW, db) of the SEBP linear, None where not asked for (shared by the autograd Function
    and the compiled op :func:`linear_backward`). ``pool``: dX may come from :mod:`.zero_rows` (when it is enabled;
    never for the compiled op, whose output memory the compiled code may reuse)."""
    impl = resolve_backend(config, dy.device)
    if config.mode == "sampled":  # approximate (.sampling); the Triton path: ._triton.sampled
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1]) if x is not None else None
        if impl is sebp_backward_torch:
            return sebp_sampled(dy2, x2, weight, config, state, need_dx, need_dw, need_db)
        buf = zero_rows.pooled(dy2.shape[0], weight.shape[1], dy.dtype, dy.device) if pool and need_dx else None
        return _triton_sampled()(dy2, x2, weight, config, state, need_dx, need_dw, need_db, dx_buffer=buf)
    # rows of dy that can be non-zero, from the backward that wrote dy (an SEBP activation): no selection
    rows = (hint.take(dy) if hint is not None and config.mode == "exact" and impl is not sebp_backward_torch
            else None)
    dy2 = dy.reshape(-1, dy.shape[-1])
    x2 = x.reshape(-1, x.shape[-1]) if x is not None else None
    if impl is sebp_backward_torch:
        return impl(dy2, x2, weight, config, need_dx, need_dw, need_db)
    buf = zero_rows.pooled(dy2.shape[0], weight.shape[1], dy.dtype, dy.device) if pool and need_dx else None
    return impl(dy2, x2, weight, config, need_dx, need_dw, need_db, state=state, rows=rows, dx_buffer=buf)


# ------------------------------------------------------------------------- the compiled path (see .registry)

def _linear_backward(dy: Tensor, x: Optional[Tensor], weight: Tensor, need_dx: bool, need_dw: bool,
                     need_db: bool, key: Optional[Tensor], op_key: int, state_key: int, hint_key: int,
                     pad_perm: Optional[Tensor] = None, pad_count: Optional[Tensor] = None,
                     pad_real: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dX, dW, db) of the SEBP linear registered under ``key`` (a module's :func:`~.registry.key_tensor`), else
    under ``op_key`` (a constant of the graph: a module's int key, or a functional call's config's, negative;
    empty tensors where not asked for). A functional call's ``state_key`` / ``hint_key`` name its RowDensity /
    RowHint (0: none); a module's key brings the module's own. ``pad_perm``, ``pad_count``, ``pad_real``: the
    padding rows of the forward that saved them (:meth:`~.pad_rows.PadRows.traced`), taken as the module's
    :class:`~.pad_rows.PadRows` decides when this runs (checked first, as eagerly)."""
    obj = registry.lookup(key if key is not None else op_key)
    config, state, hint = settings(obj)
    if key is None and op_key < 0:
        state, hint = registry.lookup(state_key), registry.lookup(hint_key)
    elif pad_perm is not None:
        hint = bind_traced(getattr(obj, "_sebp_pad_rows", None), hint, dy.shape, pad_perm, pad_count, pad_real,
                           obj)
    dx, dw, db = linear_grads(dy, x, weight, config, need_dx, need_dw, need_db, state, hint)
    return (as_dtype(dx.view(*dy.shape[:-1], weight.shape[1]), dy.dtype) if need_dx else placeholder(dy),
            as_dtype(dw, weight.dtype) if need_dw else placeholder(dy),
            as_dtype(db, dy.dtype) if need_db else placeholder(dy))


def _linear_backward_fake(dy, x, weight, need_dx, need_dw, need_db, key, op_key, state_key, hint_key,
                          pad_perm=None, pad_count=None, pad_real=None):
    return (dy.new_empty((*dy.shape[:-1], weight.shape[1])) if need_dx else placeholder(dy),
            weight.new_empty(weight.shape) if need_dw else placeholder(dy),
            dy.new_empty(weight.shape[0]) if need_db else placeholder(dy))


linear_backward = plain_op(_linear_backward, _linear_backward_fake)


def _linear_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], key: Optional[Tensor], op_key: int,
                    pad_perm: Tensor, pad_count: Tensor, pad_real: Tensor) -> Tensor:
    """The forward of the SEBP linear registered under ``key`` (else ``op_key``) whose layer passed on its
    batch's padding rows: over the real-token rows alone where that module's :class:`~.pad_rows.PadRows` says so
    when this runs (:func:`~.pad_rows.forward_rows_traced`), else ``F.linear``."""
    pad = getattr(registry.lookup(key if key is not None else op_key), "_sebp_pad_rows", None)
    rows = forward_rows_traced(pad, x.shape, pad_perm, pad_count, pad_real)
    return linear_maybe_over_rows(x, weight, bias, rows)


def _linear_forward_fake(x, weight, bias, key, op_key, pad_perm, pad_count, pad_real):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


linear_forward = plain_op(_linear_forward, _linear_forward_fake)


class _Linear(torch.autograd.Function):
    """``F.linear`` traced into the graph (or, given its layer's padding rows, the opaque
    :func:`linear_forward`, which may compute the real-token rows alone); its backward is the opaque
    :func:`linear_backward`, or, given ``eps`` (a float), the ``triton_op`` of :mod:`._triton.traced`, whose
    kernels Inductor launches itself (see :func:`_traced_eps`)."""

    @staticmethod
    def forward(x, weight, bias, key, op_key, state_key, hint_key, pad_perm, pad_count, pad_real, eps, over_rows):
        if over_rows:  # decided by the caller, outside this Function (see _over_rows)
            return linear_forward(x, weight, bias, key, op_key, pad_perm, pad_count, pad_real)
        return F.linear(x, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, key, op_key, state_key, hint_key, pad_perm, pad_count, pad_real, eps, _ = inputs
        ctx.keys, ctx.has_bias, ctx.eps = (op_key, state_key, hint_key), bias is not None, eps
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight, key, pad_perm, pad_count, pad_real)

    @staticmethod
    def backward(ctx, dy):
        x, weight, key, *pad = ctx.saved_tensors
        nx, nw, nb = ctx.needs_input_grad[:3]
        nb = nb and ctx.has_bias
        if not (nx or nw or nb):
            return (None,) * 12
        if ctx.eps is None:
            dx, dw, db = linear_backward(dy, x, weight, nx, nw, nb, key, *ctx.keys, *pad)
        else:
            dx, dw, db = _grads_traced(dy, x, weight, nx, nw, nb, ctx.eps)
        return (if_wanted(dx, nx), if_wanted(dw, nw), if_wanted(db, nb)) + (None,) * 9


def _over_rows(x: Tensor, weight: Tensor, pad: tuple | None, row_bound: int | None = None) -> bool:
    """Whether a compiled layer given its padding rows calls the forward operator (which may compute the real
    rows alone) rather than tracing ``F.linear``: not where the shape can never pay
    (:func:`~.forward_rows.could_pay`) at ``row_bound`` rows, the most a batch of the run has
    (:attr:`~.pad_rows.PadRows.row_bound`; the operator itself decides each batch whether it pays). Without a
    bound it asks at this batch's rows: a symbolic row count then becomes a guard, and a batch on the other side
    of :data:`~.forward_rows.MIN_ROWS` compiles the layer again. Asked by the caller in the graph being traced:
    inside the autograd Function's forward Dynamo traces a subgraph, and there (torch 2.11 and 2.13) comparing
    that count with the float multiply-add line failed the compile."""
    rows = x.numel() // x.shape[-1] if row_bound is None else row_bound
    return pad is not None and bool(could_pay(rows, *weight.shape[::-1]))


def _grads_traced(dy, x, weight, need_dx, need_dw, need_db, eps):
    from ._triton.traced import linear_grads_traced

    rows = dy.reshape(-1, dy.shape[-1]).contiguous()
    xs = x.reshape(-1, x.shape[-1]).contiguous() if need_dw else rows
    dx, dw, db = linear_grads_traced(rows, xs, weight.contiguous(), need_dx, need_dw, need_db, eps)
    return (dx.view(*dy.shape[:-1], weight.shape[1]) if need_dx else dx), dw, db


def triton_op_available() -> bool:
    """Whether the ``triton_op`` backward can run here: triton imports, and torch has ``torch.library.triton_op``
    (2.6 and later)."""
    try:
        importlib.import_module(f"{__package__}._triton.traced")
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def _triton_op_here() -> bool:
    return triton_op_available()


@torch.compiler.assume_constant_result
def _kernels_take(dtype: torch.dtype, device: torch.device, weight_dtype: torch.dtype,
                  weight_device: torch.device) -> bool:
    """Whether the Triton kernels take rows of this dtype on this device with such a weight
    (:func:`._triton.backward.takes`; bf16 asks the GPU's compute capability). Called by Dynamo when it traces,
    its answer a constant."""
    from ._triton.backward import takes

    return weight_dtype == dtype and weight_device == device and takes(dtype, device)


def _traced_eps(config: SEBPConfig, x: Tensor, weight: Tensor) -> Optional[float]:
    """The threshold a compiled layer's ``triton_op`` backward selects rows with (0.0: exact), or None where the
    layer keeps the operator :func:`linear_backward`: ``config.triton_op`` off, top-N selection, the torch
    backend, inputs the kernels do not take (dtype, device, no rows), a torch without ``triton_op``. Read when
    the graph is traced: Dynamo guards on the config and the sizes it read."""
    if not config.triton_op or config.mode in ("topk", "sampled") or config.backend == "torch" or x.dim() < 2:
        return None
    if x.numel() == 0 or weight.numel() == 0 or not _triton_op_here():
        return None
    if not _kernels_take(x.dtype, x.device, weight.dtype, weight.device):
        return None
    return 0.0 if config.mode == "exact" else float(config.eps)


def traced_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], key: Optional[Tensor], op_key: int = 0,
                  state_key: int = 0, hint_key: int = 0, pad: tuple | None = None,
                  eps: Optional[float] = None, over_rows: bool = False) -> Tensor:
    """What a compiled SEBP linear runs: the module under ``key`` (a :func:`~.registry.key_tensor`) or ``op_key``
    (its int key), or a functional call (``key`` None, ``op_key`` its config's, with the keys of its RowDensity
    and RowHint, 0 for none). ``pad``: the (perm, count, real-token flags) of the forward's padding rows
    (:meth:`~.pad_rows.PadRows.traced`), inputs of the graph that its backward takes (a module's only);
    ``over_rows``: the forward is the operator over those rows (:func:`_over_rows`), else ``F.linear``."""
    return _Linear.apply(x, weight, bias, key, op_key, state_key, hint_key, *(pad or (None, None, None)), eps,
                         over_rows)


def sebp_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SEBPConfig | None = None,
    state: RowDensity | SampleState | None = None,
    hint=None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose backward works on the active rows of dL/dY only.

    The forward is ``F.linear``'s. The backward computes dX, dW and db over the rows of dL/dY that
    ``config`` calls active (all leading dimensions flattened into rows); a product whose input needs no
    gradient is skipped. Under autocast the inputs are cast the way autocast casts ``F.linear`` (fp32 master
    weights get fp32 gradients). Where autograd records nothing (``torch.no_grad()``, nothing requiring grad)
    it is ``F.linear`` itself.

    Args:
        x: the input, ``(..., in_features)``.
        weight: the weight, ``(out_features, in_features)``.
        bias: the bias, ``(out_features,)``, or None.
        config: how the backward picks its active rows (:class:`~sebp_kernels.config.SEBPConfig`);
            None: exact mode, every row with a non-zero element.
        state: the layer's :class:`~sebp_kernels.density.RowDensity`, kept across steps, with which the
            Triton backward in exact mode takes the dense GEMMs while nearly all rows are active; None:
            always SEBP. In ``sampled`` mode: the layer's :class:`~sebp_kernels.sampling.SampleState`
            (required).
        hint: a :class:`~sebp_kernels.activations.RowHint` through which the backward that writes dL/dY (an
            SEBP activation) names the rows that can be non-zero; the Triton backward in exact mode then
            skips its selection pass. None: the backward selects.

    Returns:
        ``x @ weight.T + bias``, of shape ``(..., out_features)``.
    """
    return linear_for_layer(x, weight, bias, config, state, hint)


def linear_for_layer(x: Tensor, weight: Tensor, bias: Optional[Tensor], config: SEBPConfig | None,
                     state: RowDensity | SampleState | None = None, hint=None, key: int | Tensor | None = None,
                     pad: tuple | None = None, rows: tuple | None = None, row_bound: int | None = None,
                     forward_rows: bool = True) -> Tensor:
    """:func:`sebp_linear` with what an :class:`~sebp_kernels.modules.SEBPLinear` adds (internal).

    ``key``: the :func:`.registry.register` key of the SEBPLinear calling this (or its
    :func:`~.registry.key_tensor`, see :func:`~.registry.keys_as_inputs`); inside ``torch.compile`` the layer
    then runs :func:`traced_linear` (one graph, no break): ``F.linear`` traced, and the backward as the
    operator ``sebp::linear_backward`` (:mod:`.library`), which reads that layer's settings, state and hint.
    ``pad``: that layer's padding rows of this forward inside ``torch.compile`` (graph inputs; eagerly they
    come as the hint, :meth:`~.pad_rows.PadRows.bind`). ``rows``: eagerly, the (perm, count) of the real-token
    rows the forward computes alone where that pays, and a recent share of real rows
    (:meth:`~.pad_rows.PadRows.forward_rows`; compiled, the forward reads them from ``pad`` when it runs).
    ``row_bound``: compiled, the most rows a batch of the run has (:attr:`~.pad_rows.PadRows.row_bound`), with
    which the layer decides whether to call the forward operator at all (:func:`_over_rows`); None: each
    batch's rows decide (a guard). ``forward_rows``: compiled, False keeps the forward on every row
    (:attr:`~.pad_rows.PadRows.forward_real_rows`).
    """
    if not records_grad(x, weight, bias):
        return F.linear(x, weight, bias)
    config = config or _DEFAULT
    dev = x.device.type
    if torch.is_autocast_enabled(dev) and x.dtype != torch.float64:  # autocast leaves fp64 alone too
        dt = torch.get_autocast_dtype(dev)
        x, weight = x.to(dt), weight.to(dt)
        bias = bias.to(dt) if bias is not None else None
        with torch.autocast(dev, enabled=False):
            return _apply(x, weight, bias, config, state, hint, key, pad, rows, row_bound, forward_rows)
    return _apply(x, weight, bias, config, state, hint, key, pad, rows, row_bound, forward_rows)


def _apply(x, weight, bias, config, state, hint, key, pad=None, rows=None, row_bound=None, forward_rows=True):
    if torch.compiler.is_compiling():
        eps = _traced_eps(config, x, weight)
        if key is not None:  # an SEBPLinear: its settings, density state and hint, read when the backward runs
            return traced_linear(x, weight, bias, *registry.op_keys(key, 0), pad=pad, eps=eps,
                                 over_rows=forward_rows and _over_rows(x, weight, pad, row_bound))
        state_key, hint_key = getattr(state, "key", 0), getattr(hint, "key", 0)
        if (state is None or state_key) and (hint is None or hint_key):  # a functional call: its own objects
            return traced_linear(x, weight, bias, None, config.op_key, state_key, hint_key, eps=eps)
    return SEBPLinearFunction.apply(x, weight, bias, config, state, hint, rows)
