"""The ``sebp::`` operators of the compiled path without a derivative of their own, defined with torch.library's
low-level API.

Inside ``torch.compile`` each SEBP layer's backward is one operator (see :mod:`.registry`), which the compiled
backward calls once per layer and step: about 105 times a step for a Llama-3.2-1B. ``torch.library.custom_op``
wraps every call in Python layers of its own (an autograd kernel that redispatches, a ``torch._dynamo.disable``
frame, a check that no output aliases an input). On the H100 host of the device machine (torch 2.11) a call of
``sebp::linear_backward`` through them took 133 us against 108 us as defined here, and a compiled stack of 16
SEBP linears spent 181 us more host time per layer and step than the same stack dense, against 125 us as
defined here (results/kernels.json run op_overhead).

The backward operators need none of those layers: they run inside a backward, where autograd records nothing,
return new tensors, and have no derivative of their own. :func:`plain_op` defines one as the dispatcher's
kernel for every backend (``CompositeExplicitAutograd``: the dispatcher calls the Python function directly) with
its fake (shape-only) implementation, which Dynamo, AOTAutograd and Inductor trace with. Without an autograd
kernel, a call that autograd would record (a backward with ``create_graph=True``) would only warn, so the
kernel refuses it, as the eager Functions (``once_differentiable``) do. ``sebp::linear_forward`` (the forward
over real-token rows) is one too: it runs inside the forward of the autograd Function whose backward is
``sebp::linear_backward``, where autograd records nothing either. The forward operators with a derivative
(``sebp::act``, ``sebp::linear_ce``) stay ``custom_op``s with ``register_autograd``.

This module imports none of the modules that use it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

_LIB = torch.library.Library("sebp", "FRAGMENT")  # noqa: TOR901 - the low-level API, on purpose (see above)


def plain_op(fn: Callable, fake: Callable, mutates_args: tuple[str, ...] = (),
             tags: tuple[torch.Tag, ...] = ()) -> torch._ops.OpOverload:
    """Define ``sebp::<name>`` (``fn``'s name without leading underscores) from ``fn``'s annotated signature
    (as ``custom_op`` infers it; it writes the arguments named in ``mutates_args``, none by default), with
    ``fn`` as its kernel for every device and ``fake`` as its shape-only implementation, and the operator
    ``tags``; returns the operator (``torch.ops.sebp.<name>.default``)."""
    name = fn.__name__.lstrip("_")
    _LIB.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args), tags=tags)

    def kernel(*args):
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            raise RuntimeError(f"sebp::{name} has no derivative of its own: SEBP gives no second-order "
                               "gradients (backward with create_graph=True)")
        return fn(*args)

    _LIB.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"sebp::{name}", fake, lib=_LIB)
    return getattr(torch.ops.sebp, name).default
