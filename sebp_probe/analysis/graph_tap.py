"""The collector's statistics inside compiled graphs: how ``finetune --probe-every`` probes a ``--compile`` run.

Hooks do not enter a compiled graph (Dynamo traced the model without them), so a compiled run's probed step would
have to run eagerly, as slow as an eager step. Instead :class:`GraphTaps` gives every target linear of the
collector a class of its own, made once per linear class: the class's ``forward`` is the linear's, and while the
collector is entered (``state.on``) it passes the output through :class:`_Tap`, an identity whose backward adds
the statistics of dL/dY into the collector's buffer of the device in plain torch ops
(:func:`~sebp_probe.analysis.grad_reduce.add_stats_`). Dynamo traces them into the layer's backward graph and
Inductor compiles them with it: the host runs no Python per layer, and a CUDA graph (``reduce-overhead``) can
record them, since every input they read or write keeps its address for the collector's life. Nothing in them
is made from host data: a constant tensor would be copied to the device at every call, a copy that waits for
the device.

What Dynamo sees per layer is the same for every layer of a stack: ``state.on`` (a guard: a probed and an
unprobed graph, each compiled once, the probed one at the first probed step), the layer's row of the buffer as
a 0-d tensor, and its device's :class:`GraphInputs` (the buffer, the window's row groups and their token count),
all inputs of the graph. Layers of one class thus share their graphs, as they do unprobed. The ops write the
buffer in place, so nothing reorders or drops them.

Outside a compiled graph (a layer that runs eagerly) the class calls the collector's forward hook itself, so the
statistics are the same either way.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

__all__ = ["GraphInputs", "GraphTaps", "TapState"]


class TapState:
    """Whether a collector's taps are on (one object per collector, read by all its layers)."""

    def __init__(self) -> None:
        self.on = False


# tokens of a window the row-group buffer holds at first (128 KiB); a window with more makes it twice as large, and
# the probed graphs compile again once (Dynamo specializes on the buffer's size)
GROUPS_AT_FIRST = 1 << 17


class GraphInputs:
    """What the taps of one device read besides dL/dY: the collector's buffer (``flat``, its layout in
    :func:`~sebp_probe.analysis.grad_reduce.add_stats_`), the open window's row groups and their token count
    (:meth:`set_groups`). Each keeps its address for the collector's life, so a CUDA graph can read it. ``add``:
    what adds a gradient's statistics (:func:`~sebp_probe.analysis.grad_reduce.add_stats_`)."""

    def __init__(self, flat: Tensor, n_layers: int, add: Callable) -> None:
        self.flat, self.n_layers, self.add = flat, n_layers, add
        self.groups = torch.zeros(GROUPS_AT_FIRST, dtype=torch.int8, device=flat.device)
        self.n_tokens = torch.full((), -1, dtype=torch.int64, device=flat.device)
        for t in (flat, self.groups, self.n_tokens):  # a CUDA graph reads (and writes) them where they are
            torch._dynamo.mark_static_address(t)

    def set_groups(self, groups: Tensor | None) -> None:
        """The row groups of the window that begins (one int8 per token; None: no groups); no host sync."""
        if groups is None:
            self.n_tokens.fill_(-1)
            return
        groups = groups.reshape(-1)
        n = groups.shape[0]
        if n > self.groups.shape[0]:
            self.groups = torch.zeros(1 << (n - 1).bit_length(), dtype=torch.int8, device=self.flat.device)
            torch._dynamo.mark_static_address(self.groups)
        self.groups[:n].copy_(groups, non_blocking=True)
        self.n_tokens.fill_(n)


class _Tap(torch.autograd.Function):
    """The identity on a layer's output whose backward adds the statistics of its gradient into the buffer."""

    @staticmethod
    def forward(ctx, y: Tensor, slot: Tensor, flat: Tensor, groups: Tensor, n_tokens: Tensor, n_layers: int,
                add: Callable) -> Tensor:
        # not saved tensors: the backward writes ``flat``, shared by every layer
        ctx.slot, ctx.flat, ctx.groups, ctx.n_tokens, ctx.n_layers, ctx.add = slot, flat, groups, n_tokens, \
            n_layers, add
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.add(grad, ctx.flat, ctx.slot, ctx.groups, ctx.n_tokens, ctx.n_layers)
        return grad, None, None, None, None, None, None


def _probed_forward(self, *args, **kwargs):
    out = self._sebp_probe_base.forward(self, *args, **kwargs)
    state = self._sebp_probe_state
    if state.on and isinstance(out, Tensor) and out.requires_grad:
        if torch.compiler.is_compiling():
            inputs = self._sebp_probe_inputs
            out = _Tap.apply(out, self._sebp_probe_slot, inputs.flat, inputs.groups, inputs.n_tokens,
                             inputs.n_layers, inputs.add)
        else:
            self._sebp_probe_hook(self, args, out)
    return out


_CLASSES: dict[type, type] = {}


def _probed_class(cls: type) -> type:
    """``cls`` with :func:`_probed_forward` (made once per class)."""
    probed = _CLASSES.get(cls)
    if probed is None:
        probed = _CLASSES[cls] = type(cls.__name__, (cls,), {"forward": _probed_forward, "_sebp_probe_base": cls,
                                                             "__module__": cls.__module__})
    return probed


_ATTRS = ("_sebp_probe_state", "_sebp_probe_inputs", "_sebp_probe_slot", "_sebp_probe_hook")


class GraphTaps:
    """The taps of one collector on its model's target linears (see the module docstring). ``modules``: the
    targets, in the collector's order; ``buffer_of(device)``: the collector's buffer on a device;
    ``hook_of(index)``: the collector's forward hook of a layer (for layers that run eagerly); ``add``: what
    adds a gradient's statistics to the buffer (:class:`GraphInputs`). :meth:`remove` gives the linears their
    classes back."""

    def __init__(self, modules: list[nn.Module], buffer_of: Callable[[torch.device], Tensor],
                 hook_of: Callable[[int], Callable], add: Callable) -> None:
        self.state = TapState()
        self.inputs: dict[torch.device, GraphInputs] = {}
        self._modules = modules
        for i, m in enumerate(modules):
            weight = next(m.parameters(), None)
            device = weight.device if weight is not None else torch.device("cpu")
            inputs = self.inputs.get(device)
            if inputs is None:
                inputs = self.inputs[device] = GraphInputs(buffer_of(device), len(modules), add)
            m._sebp_probe_state, m._sebp_probe_inputs, m._sebp_probe_hook = self.state, inputs, hook_of(i)
            m._sebp_probe_slot = torch.tensor(i, dtype=torch.int64, device=device)
            m.__class__ = _probed_class(type(m))

    def set_groups(self, groups: Tensor | None) -> None:
        """The row groups of the window that begins, on every device (see :meth:`GraphInputs.set_groups`)."""
        for inputs in self.inputs.values():
            inputs.set_groups(groups)

    def remove(self) -> None:
        """Take the taps off (the linears' own classes back)."""
        self.state.on = False
        for m in self._modules:
            if type(m).__dict__.get("_sebp_probe_base") is not None:
                m.__class__ = type(m)._sebp_probe_base
            for a in _ATTRS:
                m.__dict__.pop(a, None)
        self._modules = []
