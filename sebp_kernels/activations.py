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
import weakref

import torch
import torch.nn.functional as F

from .reference import records_grad, refuse_missing_triton

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class RowHint:
    """Rows that can be non-zero in a gradient tensor, handed from the backward that wrote it to the SEBP
    linear whose backward reads it (shared by the activation and the linears before it).

    An entry is found by the tensor itself: the same memory, shape, strides and device, alive (a weak
    reference) and not modified since (its version counter), so a hint never applies to other data.
    ``offered`` and ``taken`` count the hand-overs (tests and diagnostics)."""

    def __init__(self):
        self._items: dict = {}
        self.offered = 0
        self.taken = 0

    def offer(self, t: torch.Tensor, perm: torch.Tensor, count: torch.Tensor) -> None:
        self._items = {k: v for k, v in self._items.items() if v[0]() is not None}
        self._items[t.data_ptr()] = (weakref.ref(t), t._version, t.shape, t.stride(), t.device, perm, count)
        self.offered += 1

    def take(self, t: torch.Tensor):
        """(perm, count) for ``t``, or None."""
        item = self._items.get(t.data_ptr())
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
        n = a.shape[-1]
        a2 = a.reshape(-1, n)
        b2 = b.reshape(-1, n) if b is not None else None
        if kind == "gelu":  # torch's values; the pass reads the input for its flags only
            h = F.gelu(a2)
            bad = tri[1](kind, a2, None, True, tri[0], store_h=False)[1]
        else:
            h, bad = tri[1](kind, a2, b2, True, tri[0])
        ctx.save_for_backward(a2, b2, bad)
        ctx.shape = a.shape
        return h.view(a.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dh):
        need_a, need_b = ctx.needs_input_grad[1:3]
        if not (need_a or need_b):
            return None, None, None, None, None
        if ctx.triton:
            a2, b2, bad = ctx.saved_tensors
            tri = _use_triton(ctx.backend, dh, a2.view(ctx.shape))
            if tri is not None:
                hint = ctx.hint
                da, db, rows = tri[2](ctx.kind, dh.reshape(-1, dh.shape[-1]), a2, b2, bad, need_a,
                                      need_b and b2 is not None, hint is not None, tri[0])
                da = da.view(ctx.shape) if da is not None else None
                db = db.view(ctx.shape) if db is not None else None
                if rows is not None:
                    for t in (da, db):
                        if t is not None:
                            hint.offer(t, *rows)
                return None, da, db, None, None
            a, b = a2.view(ctx.shape), (b2.view(ctx.shape) if b2 is not None else None)
            act = F.silu(a) if b is not None else None
        else:
            a, b, act = ctx.saved_tensors
        # the kernels autograd runs for Hugging Face's ops (mul, then silu; or gelu)
        if ctx.kind == "gelu":
            return None, torch.ops.aten.gelu_backward(dh, a) if need_a else None, None, None, None
        da = torch.ops.aten.silu_backward(dh * b, a) if need_a else None
        db = dh * act if need_b else None
        return None, da, db, None, None


def sebp_swiglu(gate: torch.Tensor, up: torch.Tensor, hint: RowHint | None = None,
                backend: str = "auto") -> torch.Tensor:
    """``F.silu(gate) * up`` (the same values), whose backward skips the zero rows of dL/dH and hands the rows
    that can be non-zero in dL/dgate and dL/dup to ``hint``."""
    if not records_grad(gate, up):  # no backward to come: the forward pass alone, without the NaN/Inf flags
        tri = _use_triton(backend, gate, up)
        if tri is None:
            return F.silu(gate) * up
        n = gate.shape[-1]
        return tri[1]("swiglu", gate.reshape(-1, n), up.reshape(-1, n), False, tri[0])[0].view(gate.shape)
    return SEBPActFunction.apply("swiglu", gate, up, hint, backend)


def sebp_gelu(x: torch.Tensor, hint: RowHint | None = None, backend: str = "auto") -> torch.Tensor:
    """``F.gelu(x)`` (erf form; the same values), whose backward skips the zero rows of dL/dH and hands the
    rows that can be non-zero in dL/dx to ``hint``."""
    if not records_grad(x):  # no backward to come: torch's GELU alone (the forward's values are torch's anyway)
        return F.gelu(x)
    return SEBPActFunction.apply("gelu", x, None, hint, backend)
