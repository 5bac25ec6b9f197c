"""ReSprop on whole models: swap target linears for ReSpropLinear, and measure what reuse would drop.

Training loop::

    patch_resprop(model, reuse=0.9)      # after loading weights (a load resets P), before or after the optimizer
    for epoch in ...:
        model.train()                    # a switch from eval resets P: the first step is exact
        for batch in loader:
            model(**batch).loss.backward(); opt.step(); opt.zero_grad()
        model.eval()                     # plain linears, no state touched
        ...

P is never saved: after a resume the first step is exact. :func:`reset_resprop` forgets P explicitly (e.g.
when the data changes). Targets are matched as by :func:`sebp_probe.patch_model` (:func:`find_targets`).
"""
from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch
from torch import nn

from sebp_kernels import ReSpropLinear, SEBPLinear
from sebp_kernels.resprop import DEFAULT_LEVELS, ReuseDrop, check_reuse, drop_stats, reuse_source

from .patch import PatchError, _logical_name, _set_submodule, find_targets


def patch_resprop(
    model: nn.Module,
    reuse: float = 0.9,
    targets: Iterable[str] | str | None = None,
    exclude: Iterable[str] | str | None = None,
    backend: str = "auto",
) -> list[str]:
    """Swap the target nn.Linear modules of ``model`` (default: the attention and MLP projections) for
    ReSpropLinear in place, sharing their Parameters (state_dict keys, data pointers and an existing optimizer
    stay valid); return their names. A layer that is already ReSprop only takes the new ``reuse`` and keeps
    its P, so patching twice is a no-op."""
    check_reuse(reuse)
    names = find_targets(model, targets, exclude)
    other = [n for n in names if not isinstance(model.get_submodule(n), nn.Linear)]
    if other:  # checked before any swap: nothing patched half-way
        raise PatchError(f"layer {other[0]!r} is a {type(model.get_submodule(other[0])).__name__}: gradient reuse "
                         "takes nn.Linear layers only")
    for name in names:
        module = model.get_submodule(name)
        if isinstance(module, SEBPLinear):
            raise PatchError(f"layer {name!r} is an SEBPLinear: unpatch SEBP first (sebp_probe.unpatch_model)")
        if isinstance(module, ReSpropLinear):
            module.reuse = reuse
        else:
            _set_submodule(model, name, ReSpropLinear.from_linear(module, reuse, backend))
    return names


def unpatch_resprop(model: nn.Module) -> list[str]:
    """Put plain nn.Linear modules (same Parameters) back in place of every ReSpropLinear; return their names."""
    names = [n for n, m in model.named_modules() if isinstance(m, ReSpropLinear)]
    for name in names:
        _set_submodule(model, name, model.get_submodule(name).to_linear())
    return names


def reset_resprop(model: nn.Module) -> int:
    """Forget P in every ReSpropLinear (the next step is exact); return how many there are."""
    layers = [m for m in model.modules() if isinstance(m, ReSpropLinear)]
    for m in layers:
        m.reset_resprop()
    return len(layers)


def resprop_layers(model: nn.Module) -> dict[str, float]:
    """Module name -> reuse of every ReSpropLinear in ``model``."""
    return {n: m.reuse for n, m in model.named_modules() if isinstance(m, ReSpropLinear)}


class ReuseDropCollector:
    """Context manager: per target linear and training step, what ReSprop at each reuse level would drop of
    dL/dY (:class:`~sebp_kernels.ReuseDrop`), with P taken from the same layer's dL/dY of the step before by
    the layer's rule. It only watches (forward hooks put a tensor hook on the outputs): run a few real
    training steps (optimizer included) inside it, on a plain or a patched model. A layer called several
    times per step compares each call with the one before. Statistics stay on the device until read."""

    def __init__(self, model: nn.Module, target_modules=None, exclude_modules=None,
                 levels: Iterable[float] = DEFAULT_LEVELS):
        self.levels = tuple(check_reuse(r) for r in levels)
        real = find_targets(model, target_modules, exclude_modules)
        if not real:
            raise ValueError("no linear layer to watch (check the target/exclude patterns)")
        # a peft layer's wrapper, whose output has dL/dY where the frozen base layer's may have none
        self._modules = {_logical_name(n): model.get_submodule(_logical_name(n)) for n in real}
        self._p: dict[str, torch.Tensor] = {}
        self._stats: dict[str, list[torch.Tensor]] = {n: [] for n in self._modules}
        self._handles: list = []

    def __enter__(self) -> "ReuseDropCollector":
        for name, module in self._modules.items():
            self._handles.append(module.register_forward_hook(partial(self._on_forward, name)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _on_forward(self, name: str, module, args, output) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad and output.dim() >= 3:
            output.register_hook(partial(self._on_grad, name))

    def _on_grad(self, name: str, grad: torch.Tensor) -> None:
        if not grad.numel():
            return
        g = grad.detach()
        p = self._p.get(name)
        if p is not None and p.shape[-1] == g.shape[-1] and p.dtype == g.dtype:
            self._stats[name].append(drop_stats(p, g, self.levels))
        self._p[name] = reuse_source(g.reshape(-1, *g.shape[-2:]))

    def drops(self) -> dict[str, list[ReuseDrop]]:
        """Layer name -> one :class:`ReuseDrop` per step after the first (one device->host copy)."""
        n = len(self.levels)
        out = {}
        for name, rows in self._stats.items():
            values = torch.stack(rows).cpu().tolist() if rows else []
            out[name] = [ReuseDrop(self.levels, v[:n], v[n:2 * n], v[2 * n], int(v[2 * n + 1])) for v in values]
        return out

    def summary(self) -> dict[str, dict]:
        """Layer name -> means over the steps: ``dropped`` and ``topk_dropped`` (reuse level -> relative norm),
        ``residual``, and ``steps`` (how many comparisons); JSON-ready (NaN where dY held NaN/Inf)."""
        out = {}
        for name, drops in self.drops().items():
            if not drops:
                out[name] = {"steps": 0}
                continue
            mean = lambda vals: float(torch.tensor(vals, dtype=torch.float64).mean())  # noqa: E731
            out[name] = {
                "steps": len(drops),
                "dropped": {str(r): mean([d.dropped[i] for d in drops]) for i, r in enumerate(self.levels)},
                "topk_dropped": {str(r): mean([d.topk_dropped[i] for d in drops]) for i, r in enumerate(self.levels)},
                "residual": mean([d.residual for d in drops]),
            }
        return out
