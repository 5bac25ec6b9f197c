"""The activation between an MLP's linears (SwiGLU ``silu(g) * u``, or GELU) with a row-skipping backward.

In a padded batch the padding rows of dL/dH (the gradient of the activation's output, written by the SEBP
backward of the linear after it) are exactly zero, and so are those rows of the activation's input
gradients: 0 times a finite number. Hugging Face's activation runs two or three elementwise kernels over
every row in the backward; this one runs one pass that loads the saved inputs only where dL/dH is non-zero
(rows whose inputs hold a NaN/Inf, flagged in the forward, are computed in full, so they reach the gradients
as in the dense backward). The forward gives the same values as Hugging Face's (SwiGLU: one Triton pass,
checked bit for bit on an H100; GELU: torch's own, plus a pass that writes the flags).

The pass also finds which rows of the input gradients can be non-zero, and hands them (permutation and
device-side count, as the selection pass gives them) to the SEBP linears that read those gradients, through
a :class:`RowHint`: those layers then skip their own selection pass over dL/dY, a full read of it. Exact mode
only: the hint names a superset of the non-zero rows, which gives the same gradients.

On CUDA one Triton kernel does each direction (:mod:`._triton.act`); elsewhere (and for other dtypes) the
torch formula, without hints.
"""
from __future__ import annotations

import functools
import math
import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import registry, zero_rows
from .library import plain_op
from .registry import as_dtype, graph_key, if_wanted, name_module, op_keys, placeholder
from .reference import records_grad, refuse_missing_triton

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class RowHint:
    """Rows that can be non-zero in a gradient tensor, handed from the backward that wrote it to the SEBP
    linear whose backward reads it (shared by the activation and the linears before it).

    An entry is found by the tensor itself: the same memory, shape, strides and device, alive (a weak
    reference) and not modified since (its version counter), so a hint never applies to other data.
    ``offered`` and ``taken`` count the hand-overs (tests and diagnostics)."""

    _sebp_key_input = False  # the key as a tensor input of compiled graphs (.registry.keys_as_inputs)

    def __init__(self):
        self._items: dict = {}
        self.offered = 0
        self.taken = 0
        name_module(self)  # names it inside compiled graphs (see .registry)

    @property
    def key(self) -> int:
        return self._sebp_key

    def __getstate__(self):  # a copy starts with no hints and a key of its own, passed as its original's is
        return {"offered": self.offered, "taken": self.taken, "key_input": self._sebp_key_input}

    def __setstate__(self, state):
        self.__init__()
        self.offered, self.taken = state["offered"], state["taken"]
        if state.get("key_input"):
            self._sebp_key_input = True

    def offer(self, t: torch.Tensor, perm: torch.Tensor, count: torch.Tensor) -> None:
        self._items = {k: v for k, v in self._items.items() if v[0]() is not None}
        self._items[t.data_ptr()] = (weakref.ref(t), t._version, t.shape, t.stride(), t.device, perm, count)
        self.offered += 1

    def take(self, t: torch.Tensor):
        """(perm, count) for ``t``, or None. The entry goes (each gradient is read once): nothing outlives the
        backward, which a CUDA-graph pool that checks for untracked allocations (``torch.compile``'s
        ``reduce-overhead``) requires."""
        item = self._items.pop(t.data_ptr(), None)
        if item is None:
            return None
        ref, version, shape, stride, device, perm, count = item
        src = ref()
        if (src is None or src._version != version or t._version != version or t.shape != shape
                or t.stride() != stride or t.device != device):
            return None
        self.taken += 1
        return perm, count


@functools.lru_cache(maxsize=1)
def _triton_act():
    """(interpreter?, forward launcher, backward launcher), or None without triton (looked up once)."""
    try:
        from ._triton import backward as tb
        from ._triton.act import act_backward_triton, act_forward_triton
    except ImportError:
        return None
    return tb.INTERPRET, act_forward_triton, act_backward_triton


def _use_triton(backend: str, *tensors) -> tuple | None:
    if backend == "torch":
        return None
    tri = _triton_act()
    refuse_missing_triton(backend, tri)
    if tri is None:
        return None
    t0 = tensors[0]
    ok = (t0.device.type == ("cpu" if tri[0] else "cuda") and t0.dtype in DTYPES and t0.numel() > 0
          and all(t.dtype == t0.dtype and t.device == t0.device and t.shape == t0.shape for t in tensors))
    return tri if ok else None


def act_forward(kind: str, a: torch.Tensor, b: torch.Tensor | None, backend: str, flags: bool = True):
    """(output, per-row NaN/Inf flags) on the Triton path; (output, None) on the torch path or without
    ``flags`` (a forward with no backward to come)."""
    tri = _use_triton(backend, *(t for t in (a, b) if t is not None))
    if tri is None or (kind == "gelu" and not flags):
        return (F.gelu(a) if kind == "gelu" else F.silu(a) * b), None
    n = a.shape[-1]
    a2 = a.reshape(-1, n)
    if kind == "gelu":  # torch's values; the pass reads the input for its flags only
        h = F.gelu(a2)
        bad = tri[1](kind, a2, None, True, tri[0], store_h=False)[1]
    else:
        h, bad = tri[1](kind, a2, b.reshape(-1, n), flags, tri[0])
    return h.view(a.shape), bad


def _triton_grads(kind, dh, a, b, bad, need_a, need_b, backend, hint, pool=False):
    """(dA, dB) by the Triton pass over the non-zero rows of ``dh``, handing their rows to ``hint``; None where
    the Triton path does not take these tensors. ``pool``: dA / dB may come from :mod:`.zero_rows` (when it is
    enabled; not for the compiled op, whose output memory the compiled code may reuse)."""
    tri = _use_triton(backend, dh, a)
    if tri is None:
        return None
    n = a.shape[-1]
    need_b = need_b and b is not None
    keep = {}
    if pool:
        m = dh.numel() // n
        keep_a = zero_rows.pooled(m, n, dh.dtype, dh.device) if need_a else None
        held = keep_a.dx if keep_a is not None else None  # in use: the next request gets another buffer
        keep = {"keep_a": keep_a, "keep_b": zero_rows.pooled(m, n, dh.dtype, dh.device) if need_b else None}
        del held
    da, db, rows = tri[2](kind, dh.reshape(-1, n), a.reshape(-1, n), b.reshape(-1, n) if b is not None else None,
                          bad, need_a, need_b, hint is not None, tri[0], **keep)
    da = da.view(a.shape) if da is not None else None
    db = db.view(a.shape) if db is not None else None
    if rows is not None:
        for t in (da, db):
            if t is not None:
                hint.offer(t, *rows)
    return da, db


def _torch_grads(kind, dh, a, b, act, need_a, need_b):
    """The kernels autograd runs for Hugging Face's ops (mul, then silu; or gelu); ``act``: silu(a)."""
    if kind == "gelu":
        return (torch.ops.aten.gelu_backward(dh, a) if need_a else None), None
    da = torch.ops.aten.silu_backward(dh * b, a) if need_a else None
    db = dh * act if need_b else None
    return da, db


def act_grads(kind: str, dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, bad: torch.Tensor | None,
              need_a: bool, need_b: bool, backend: str, hint: RowHint | None):
    """(dA, dB) (None where not asked for) of an activation whose forward gave ``bad`` (None: the torch path)."""
    if bad is not None:
        out = _triton_grads(kind, dh, a, b, bad, need_a, need_b, backend, hint)
        if out is not None:
            return out
    return _torch_grads(kind, dh, a, b, F.silu(a) if b is not None else None, need_a, need_b)


class SEBPActFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kind, a, b, hint, backend):
        ctx.kind, ctx.hint, ctx.backend = kind, hint, backend
        tri = _use_triton(backend, *(t for t in (a, b) if t is not None))
        ctx.triton = tri is not None
        if tri is None:  # Hugging Face's ops; silu(a) kept for the backward, as autograd keeps it
            if kind == "gelu":
                ctx.save_for_backward(a, None, None)
                return F.gelu(a)
            act = F.silu(a)
            ctx.save_for_backward(a, b, act)
            return act * b
        h, bad = act_forward(kind, a, b, backend)
        ctx.save_for_backward(a, b, bad)
        return h

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dh):
        need_a, need_b = ctx.needs_input_grad[1:3]
        if not (need_a or need_b):
            return None, None, None, None, None
        if ctx.triton:
            a, b, bad = ctx.saved_tensors
            out = _triton_grads(ctx.kind, dh, a, b, bad, need_a, need_b, ctx.backend, ctx.hint, pool=True)
            if out is not None:
                return None, *out, None, None
            act = F.silu(a) if b is not None else None
        else:
            a, b, act = ctx.saved_tensors
        return None, *_torch_grads(ctx.kind, dh, a, b, act, need_a, need_b), None, None


# ------------------------------------------------------------------------- the compiled path (see .registry)

@torch.library.custom_op("sebp::act", mutates_args=())
def act(kind: str, a: Tensor, b: Optional[Tensor], backend: str, hint_t: Optional[Tensor],
        hint_key: int) -> tuple[Tensor, Tensor]:
    """(output, per-row NaN/Inf flags or an empty tensor) of the SEBP activation ``kind``; its row hint is named
    by ``hint_t`` (its key tensor, :func:`~.registry.keys_as_inputs`), else by ``hint_key`` (0: none)."""
    h, bad = act_forward(kind, a, b, backend)
    return h, (bad if bad is not None else placeholder(a))


@act.register_fake
def _(kind, a, b, backend, hint_t, hint_key):
    flags = placeholder(a)
    if _use_triton(backend, *(t for t in (a, b) if t is not None)) is not None:
        flags = a.new_empty(math.prod(a.shape[:-1]), dtype=torch.int8)
    return a.new_empty(a.shape), flags


def _act_backward(kind: str, dh: Tensor, a: Tensor, b: Optional[Tensor], bad: Tensor, need_a: bool,
                  need_b: bool, backend: str, hint_t: Optional[Tensor], hint_key: int) -> tuple[Tensor, Tensor]:
    """(dA, dB) of the SEBP activation (empty where not asked for); rows handed to the hint named by ``hint_t``
    or ``hint_key``."""
    da, db = act_grads(kind, dh, a, b, bad if bad.numel() else None, need_a, need_b, backend,
                       registry.lookup(hint_t if hint_t is not None else hint_key))
    return (as_dtype(da, a.dtype) if need_a else placeholder(dh)), (as_dtype(db, a.dtype) if need_b else placeholder(dh))


def _act_backward_fake(kind, dh, a, b, bad, need_a, need_b, backend, hint_t, hint_key):
    return (a.new_empty(a.shape) if need_a else placeholder(dh),
            a.new_empty(a.shape) if need_b else placeholder(dh))


act_backward = plain_op(_act_backward, _act_backward_fake)


def _act_setup(ctx, inputs, output):
    kind, a, b, backend, hint_t, hint_key = inputs
    _, bad = output
    ctx.mark_non_differentiable(bad)
    ctx.kind, ctx.backend, ctx.has_b, ctx.hint_key = kind, backend, b is not None, hint_key
    ctx.save_for_backward(a, b, bad, hint_t)


def _act_grad(ctx, dh, _dbad):
    a, b, bad, hint_t = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[1], ctx.needs_input_grad[2] and ctx.has_b
    if not (need_a or need_b):
        return None, None, None, None, None, None
    da, db = act_backward(ctx.kind, dh, a, b, bad, need_a, need_b, ctx.backend, hint_t, ctx.hint_key)
    return None, if_wanted(da, need_a), if_wanted(db, need_b), None, None, None


act.register_autograd(_act_grad, setup_context=_act_setup)


def _compiled_act(kind, a, b, hint, backend):
    """Inside ``torch.compile``: the custom op :func:`act`, which Dynamo keeps in one graph. The hint goes in by
    its key: a tensor input under :func:`~.registry.keys_as_inputs` (layers compiled one by one share a
    graph), else a constant."""
    return torch.ops.sebp.act(kind, a, b, backend, *op_keys(graph_key(hint) if hint is not None else None, 0))[0]


def sebp_swiglu(gate: torch.Tensor, up: torch.Tensor, hint: RowHint | None = None,
                backend: str = "auto") -> torch.Tensor:
    """``F.silu(gate) * up`` (the same values), whose backward skips the zero rows of dL/dH and hands the rows
    that can be non-zero in dL/dgate and dL/dup to ``hint``."""
    compiling = torch.compiler.is_compiling()
    if not records_grad(gate, up):  # no backward to come: the forward pass alone, without the NaN/Inf flags
        if compiling:  # Inductor fuses the formula
            return F.silu(gate) * up
        return act_forward("swiglu", gate, up, backend, flags=False)[0]
    if compiling:
        return _compiled_act("swiglu", gate, up, hint, backend)
    return SEBPActFunction.apply("swiglu", gate, up, hint, backend)


def sebp_gelu(x: torch.Tensor, hint: RowHint | None = None, backend: str = "auto") -> torch.Tensor:
    """``F.gelu(x)`` (erf form; the same values), whose backward skips the zero rows of dL/dH and hands the
    rows that can be non-zero in dL/dx to ``hint``."""
    if not records_grad(x):  # no backward to come: torch's GELU alone (the forward's values are torch's anyway)
        return F.gelu(x)
    if torch.compiler.is_compiling():
        return _compiled_act("gelu", x, None, hint, backend)
    return SEBPActFunction.apply("gelu", x, None, hint, backend)
