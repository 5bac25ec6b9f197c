"""The layers SEBP swaps: ``nn.Linear``, and transformers' ``Conv1D`` (GPT-2's attention and MLP projections:
the weight stored (in, out), ``y = x @ W + b``), known by duck typing (its class name, ``nf`` and the shapes), so
that nothing here imports transformers; their shapes, and the SEBP module each becomes (same Parameters)."""
from __future__ import annotations

from torch import nn

from sebp_kernels import ReSpropLinear, SEBPConfig, SEBPConv1D, SEBPLinear


def is_conv1d(m: nn.Module) -> bool:
    """Whether ``m`` is a plain transformers ``Conv1D``: weight (in, out) with ``nf`` = out, bias None or (out,)."""
    w, b = getattr(m, "weight", None), getattr(m, "bias", None)
    return (type(m).__name__ == "Conv1D" and isinstance(w, nn.Parameter) and w.dim() == 2
            and getattr(m, "nf", None) == w.shape[1] and (b is None or tuple(b.shape) == (w.shape[1],)))


def is_linear(m: nn.Module) -> bool:
    """A layer that targets can name: a plain ``nn.Linear`` or ``Conv1D``, or one already swapped (SEBP,
    ReSprop), so that patching is repeatable; also while a compiled run's probe taps it (its class then stands
    in for the layer's own, ``_sebp_probe_base``: :mod:`sebp_probe.analysis.graph_tap`)."""
    own = getattr(type(m), "_sebp_probe_base", type(m))
    return own is nn.Linear or isinstance(m, (SEBPLinear, ReSpropLinear)) or is_conv1d(m)


def features(m: nn.Module) -> tuple[int, int]:
    """(in, out) features of a layer :func:`is_linear` takes."""
    if is_conv1d(m):
        return int(m.weight.shape[0]), int(m.weight.shape[1])
    return m.in_features, m.out_features


def to_sebp(m: nn.Module, config: SEBPConfig, sample_key: int = 0) -> SEBPLinear:
    """The SEBP module of a plain ``nn.Linear`` or ``Conv1D`` (:class:`~sebp_kernels.SEBPConv1D`), holding its
    Parameters; ``sample_key``: its key in sampled mode's row hash."""
    if is_conv1d(m):
        return SEBPConv1D.from_conv1d(m, config, sample_key=sample_key)
    return SEBPLinear.from_linear(m, config, sample_key=sample_key)


def left_dense(model: nn.Module, chosen: list[str]) -> dict[str, str]:
    """Module name -> class name of the modules of ``model`` that hold a matrix of their own (a parameter of two
    or more dimensions; not an embedding) outside the ``chosen`` layers: what stays dense besides embeddings
    and norms (an output head, a projection SEBP does not know, fused experts). The modules inside a peft
    wrapper of a chosen base layer (its adapters) count as chosen."""
    roots = {n.removesuffix(".base_layer") for n in chosen}
    out = {}
    for name, m in model.named_modules():
        if name in roots or any(name.startswith(r + ".") for r in roots) or isinstance(m, nn.Embedding):
            continue
        if any(p.dim() >= 2 for p in m.parameters(recurse=False)):
            out[name] = type(m).__name__
    return out
