"""Integer keys that name SEBP objects inside compiled graphs.

Eager code runs the autograd Functions of :mod:`.functional`, :mod:`.norms` and :mod:`.activations`. Dynamo
cannot trace those Functions' backwards (Triton launches, per-layer Python state), so inside ``torch.compile``
each SEBP layer's backward is one ``torch.library`` operator with a fake (shape-only) implementation
(``sebp::linear_backward``, ``sebp::norm_backward``, ``sebp::act``/``sebp::act_backward``, defined beside
their Functions; the backward ones through :mod:`.library`). Dynamo and AOTAutograd then put everything into one graph and Inductor compiles the code
between them. Custom ops take tensors and plain values, not Python objects, so the ops carry integer keys:
:func:`register` maps a key to the module (or :class:`~.activations.RowHint`,
:class:`~.density.RowDensity`) whose settings and state the backward reads when it runs, so a compiled graph
always uses the module's current config, density estimate and hints. The key goes into the graph as a
constant (a module's ``_sebp_key``), which Inductor's CUDA graphs (``mode="reduce-overhead"``) take as they
are; but then every layer's graph is its own, and a stack compiled layer by layer (PyTorch's regional
compilation) recompiles for each layer until Dynamo's limit sends the rest eager. :func:`keys_as_inputs`
switches a model's modules (and the row hints they hold) to their key as a 0-d CPU tensor (``_sebp_key_t``),
an input of the graph: layers of one class then share one compiled graph. (Inductor once recorded no CUDA graph
of a graph with a CPU input. With its graph partitioning, on by default in torch 2.13, that check ignores CPU
inputs and Inductor cuts a graph around its CPU operations instead, so under ``reduce-overhead`` the parts of
such a graph that run on the GPU may be recorded.)

Inductor counts a CPU input as not 16-byte aligned, and counts every output of an operator with such an input
as not aligned either: the fused kernels that read an SEBP operator's dX (a GELU backward, a norm backward) then
lose their vectorised loads. :func:`keys_as_inputs` therefore tells Inductor that 0-d CPU tensors are aligned
(:func:`cpu_scalars_aligned`): no Triton kernel takes their pointer.

This module imports none of the modules that use it.
"""
from __future__ import annotations

import itertools
import weakref

import torch
from torch import Tensor

from .config import CONFIG_OF_KEY, SEBPConfig

_OBJECTS: dict[int, weakref.ref] = {}
_KEYS = itertools.count(1)


def register(obj) -> int:
    """A new integer key for ``obj`` (held weakly; the key dies with it). 0 stands for None."""
    key = next(_KEYS)
    _OBJECTS[key] = weakref.ref(obj, lambda _, k=key: _OBJECTS.pop(k, None))
    return key


def key_tensor(key: int) -> Tensor:
    """``key`` as a module holds it: a 0-d int64 tensor on the CPU (read on the host by the ops, no sync)."""
    return torch.tensor(key, dtype=torch.int64, device="cpu")  # a default device (a meta model's build) aside


def name_module(module) -> None:
    """Give ``module`` (an SEBP layer, new or copied, or another object a compiled op names: a row hint) a key
    of its own: ``_sebp_key``, and the same as ``_sebp_key_t`` (:func:`key_tensor`)."""
    module._sebp_key = register(module)
    module._sebp_key_t = key_tensor(module._sebp_key)


def graph_key(module) -> int | Tensor:
    """The key ``module`` carries into a compiled graph: its tensor under :func:`keys_as_inputs`, else its int."""
    return module._sebp_key_t if module._sebp_key_input else module._sebp_key


def op_keys(key: int | Tensor | None, default: int) -> tuple[Tensor | None, int]:
    """The two key arguments of a ``sebp::`` op: a module's key tensor and 0, or None and the int key (the
    module's, else ``default``: a functional call's config key)."""
    if isinstance(key, Tensor):
        return key, 0
    return None, key or default


def keys_as_inputs(model, on: bool = True) -> int:
    """Whether the SEBP objects of ``model`` carry their key into compiled graphs as a tensor input (``on``)
    or as a constant (the default); returns how many it set. The objects: its SEBP modules, and what its
    modules hold that has a key of its own (the row hints of SEBP activations), each once."""
    if on:
        cpu_scalars_aligned()
    seen: set[int] = set()
    for m in model.modules():
        for obj in (m, *vars(m).values()):
            if hasattr(obj, "_sebp_key_t") and id(obj) not in seen:
                seen.add(id(obj))
                obj._sebp_key_input = on
    return len(seen)


def cpu_scalars_aligned() -> bool:
    """Make Inductor count a 0-d CPU tensor input as 16-byte aligned (see the module docstring), once; False where
    this torch has no such hook (its Inductor decides alignment elsewhere). Only the graph's record of unaligned
    buffers changes: Inductor checks and copies unaligned inputs at run time on the GPU only."""
    try:
        from torch._inductor import graph
    except ImportError:
        return False
    orig = getattr(graph, "should_assume_input_aligned", None)
    if orig is None:
        return False
    if getattr(orig, "sebp_cpu_scalars", False):
        return True

    def should_assume_input_aligned(example) -> bool:
        return orig(example) or (example.device.type == "cpu" and example.dim() == 0)

    should_assume_input_aligned.sebp_cpu_scalars = True
    graph.should_assume_input_aligned = should_assume_input_aligned
    return True


def lookup(key: int | Tensor):
    """The object registered under ``key`` (None for 0; a negative key is an :class:`~.config.SEBPConfig`'s
    ``op_key``; a :func:`key_tensor` is read)."""
    key = int(key)
    if key == 0:
        return None
    if key < 0:
        return CONFIG_OF_KEY[key]
    ref = _OBJECTS.get(key)
    obj = ref() if ref is not None else None
    if obj is None:
        raise RuntimeError(f"sebp: the layer of compiled op key {key} no longer exists (recompile the model)")
    return obj


def settings(obj):
    """(config, state, row hint) of a registered module (its density state; sampled mode: its sample state), or
    of a bare config (functional calls)."""
    if isinstance(obj, SEBPConfig):
        return obj, None, None
    state = "_sebp_sampler" if obj.sebp_config.mode == "sampled" else "_sebp_density"
    return obj.sebp_config, getattr(obj, state, None), getattr(obj, "_sebp_hint", None)


def if_wanted(t: Tensor, wanted: bool):
    return t if wanted else None


def as_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype`` (itself where it is already: no call into torch)."""
    return t if t.dtype == dtype else t.to(dtype)


def placeholder(like: Tensor) -> Tensor:
    """The output of a gradient that was not asked for (custom ops return tensors, not None)."""
    return like.new_empty(0)
