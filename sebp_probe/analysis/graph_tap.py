"""The collector's statistics inside compiled graphs: how ``finetune --probe-every`` probes a ``--compile`` run.

Hooks do not enter a compiled graph (Dynamo traced the model without them), so a compiled run's probed step would
have to run eagerly, as slow as an eager step. Instead :class:`GraphTaps` gives every target linear of the
collector a class of its own, made once per linear class: the class's ``forward`` is the linear's, and while the
collector is entered (``state.on``) it passes the output through :class:`_Tap`, an identity whose backward hands
dL/dY to the operator ``sebp::probe_stats_``. Dynamo traces that into the layer's graph: the operator runs in
the compiled backward, a Python call and one row-statistics launch per layer, into the collector's buffer of the
device (:meth:`~sebp_probe.analysis.hooks.GradientStatsCollector.graph_grad`).

What Dynamo sees per layer is the same for every layer of a stack: ``state.on`` (a guard: a probed and an
unprobed graph, each compiled once, the probed one at the first probed step), the device's buffer (one tensor,
an input of the graph) and the layer's slot as a 0-d CPU tensor (an input, read on the host by the operator;
the key of :mod:`sebp_kernels.registry`, as SEBP layers name themselves). Layers of one class thus share their
graphs, as they do unprobed. The operator declares that it writes the buffer, so nothing reorders or drops it.

Outside a compiled graph (a layer that runs eagerly) the class calls the collector's forward hook itself, so the
statistics are the same either way.

What a tap costs a probed step: per layer a Python call and a launch, and one more kernel, since Inductor does
not fuse across the operator (in the code it generates for a CPU, a GELU's backward and the bias gradient's sum,
one kernel unprobed, are two around the operator). About 100 us of host time a layer on an H100 host: within 5%
where the device bounds the step, not where the host does (docs/method.md, "Gradients through training").
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from sebp_kernels import registry
from sebp_kernels.library import plain_op

__all__ = ["GraphTaps", "TapState", "probe_stats_"]


class TapState:
    """Whether a collector's taps are on (one object per collector, read by all its layers)."""

    def __init__(self) -> None:
        self.on = False


class _Slot:
    """What the operator's key names: the collector and the layer's index in it."""

    def __init__(self, collector, index: int) -> None:
        self.collector, self.index = collector, index


def _probe_stats_(grad: Tensor, buf: Tensor, key: Tensor) -> None:
    """Add the statistics of ``grad`` (dL/dY of the layer ``key`` names) into ``buf`` (its collector's buffer on
    that device)."""
    slot = registry.lookup(key)
    slot.collector.graph_grad(slot.index, grad, buf)


def _probe_stats_fake(grad: Tensor, buf: Tensor, key: Tensor) -> None:
    return None


# Inductor must not record the operator into the CUDA graphs of a compile mode that makes them
# (``reduce-overhead``, ``max-autotune``): a replay runs no Python, so the collector would count no rows and the
# kernel would read the row groups of the window it was recorded in. Tagged ``cudagraph_unsafe``, it stays out:
# Inductor cuts the graph around it, or records no CUDA graph of it. Without the tag (older torch), Inductor
# records no CUDA graph of a graph with a CPU input, which the layer's key is, unless graph partitioning is on.
_NOT_IN_CUDA_GRAPHS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()

# the low-level definition (:func:`sebp_kernels.library.plain_op`): a call costs a host about a tenth of a
# ``custom_op``'s (1.6 against 21 us on this project's CI CPU), and the backward calls it once per layer
probe_stats_ = plain_op(_probe_stats_, _probe_stats_fake, mutates_args=("buf",), tags=_NOT_IN_CUDA_GRAPHS)


class _Tap(torch.autograd.Function):
    """The identity on a layer's output whose backward runs :data:`probe_stats_` on its gradient."""

    @staticmethod
    def forward(ctx, y: Tensor, buf: Tensor, key: Tensor) -> Tensor:
        ctx.buf, ctx.key = buf, key  # not saved tensors: the operator writes ``buf``, shared by every layer
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: Tensor):
        probe_stats_(grad, ctx.buf, ctx.key)
        return grad, None, None


def _probed_forward(self, *args, **kwargs):
    out = self._sebp_probe_base.forward(self, *args, **kwargs)
    state = self._sebp_probe_state
    if state.on and isinstance(out, Tensor) and out.requires_grad:
        if torch.compiler.is_compiling():
            out = _Tap.apply(out, self._sebp_probe_buf, self._sebp_probe_key)
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


_ATTRS = ("_sebp_probe_state", "_sebp_probe_buf", "_sebp_probe_key", "_sebp_probe_hook")


class GraphTaps:
    """The taps of one collector on its model's target linears (see the module docstring). ``modules``: the
    targets, in the collector's order; ``buffer_of(device)``: the collector's buffer on a device;
    ``hook_of(index)``: the collector's forward hook of a layer (for layers that run eagerly). :meth:`remove`
    gives the linears their classes back."""

    def __init__(self, collector, modules: list[nn.Module], buffer_of: Callable[[torch.device], Tensor],
                 hook_of: Callable[[int], Callable]) -> None:
        registry.cpu_scalars_aligned()  # the keys are 0-d CPU inputs, as SEBP layers' are
        self.state = TapState()
        self._slots = [_Slot(collector, i) for i in range(len(modules))]  # the registry holds them weakly
        self._modules = modules
        for i, m in enumerate(modules):
            weight = next(m.parameters(), None)
            device = weight.device if weight is not None else torch.device("cpu")
            m._sebp_probe_state, m._sebp_probe_buf = self.state, buffer_of(device)
            m._sebp_probe_key = registry.key_tensor(registry.register(self._slots[i]))
            m._sebp_probe_hook = hook_of(i)
            m.__class__ = _probed_class(type(m))

    def remove(self) -> None:
        """Take the taps off (the linears' own classes back)."""
        self.state.on = False
        for m in self._modules:
            if type(m).__dict__.get("_sebp_probe_base") is not None:
                m.__class__ = type(m)._sebp_probe_base
            for a in _ATTRS:
                m.__dict__.pop(a, None)
        self._modules = []
