"""The fused experts of a mixture-of-experts family (transformers 5's ``MixtralExperts``, ``Qwen3MoeExperts``: one
3-D ``gate_up_proj`` (experts, 2 x intermediate, hidden) and one ``down_proj`` (experts, hidden, intermediate)) with
the SEBP backward: each expert's two grouped GEMMs take only the routed rows whose dL/dY is not zero
(:mod:`sebp_kernels.experts`).

The forward is transformers' own ``grouped_mm`` experts forward (the routed rows sorted by expert, one grouped GEMM
per projection, the gate, the routing weights, the sum over the top-k), so the values are the model's; the
Parameters are the module's own, so state_dict keys, data pointers and an optimizer stay valid. It goes onto the
module instance (its ``forward``), as :func:`~.patch.patch_activations` does, and comes off with it. The router
(``mlp.gate``) stays dense: each token's routing reads its whole row. Experts in another layout (biases,
transposed or interleaved weights, a post-expert norm, expert parallelism) stay dense, said in one line.
"""
from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch import nn

from sebp_kernels.experts import sebp_grouped_linear

__all__ = ["experts_layout_problem", "patch_experts", "patched_experts", "unpatch_experts"]


def experts_layout_problem(module: nn.Module) -> str | None:
    """Why ``module`` (an experts class of its family's entry) cannot take the SEBP experts forward, or None."""
    for flag, want in (("has_gate", True), ("has_bias", False), ("is_transposed", False),
                       ("is_concatenated", True), ("has_post_expert_norm", False), ("_is_expert_parallel", False)):
        if getattr(module, flag, want) != want:
            return f"{flag} is {not want}"
    for name in ("gate_up_proj", "down_proj"):
        p = getattr(module, name, None)
        if not isinstance(p, nn.Parameter) or p.dim() != 3:
            return f"{name} is not a 3-D parameter"
    return None


def _sebp_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' ``grouped_mm_experts_forward`` with :func:`sebp_grouped_linear` for its two grouped GEMMs."""
    num_experts, top_k, hidden = self.num_experts, top_k_index.size(-1), hidden_states.size(-1)
    experts, perm = torch.sort(top_k_index.reshape(-1))
    x = hidden_states[perm // top_k].to(self.gate_up_proj.dtype)
    offs = torch.bincount(experts, minlength=num_experts).cumsum(0)
    h = self._apply_gate(sebp_grouped_linear(x, self.gate_up_proj, offs, experts))
    out = sebp_grouped_linear(h, self.down_proj, offs, experts) * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return out[inv].view(-1, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


def patch_experts(model: nn.Module, family, note: Callable[[str], None]) -> list[str]:
    """Give every experts module of ``family``'s entry (:class:`~sebp_probe.families.Family`; ``experts``: class
    names; None: no family) in ``model`` the SEBP experts forward; return their names. One line to ``note`` says
    what SEBP covers and what stays dense: the router, and experts in another layout
    (:func:`experts_layout_problem`). Patching again changes nothing."""
    if family is None or not family.experts:
        return []
    names, dense = [], []
    for name, module in [(n, m) for n, m in model.named_modules() if type(m).__name__ in family.experts]:
        why = experts_layout_problem(module)
        if why is not None:
            dense.append(f"{name} ({why})")
            continue
        if "_sebp_experts" not in vars(module):
            module._sebp_experts = True
            module.forward = types.MethodType(_sebp_experts_forward, module)
        names.append(name)
    if names or dense:
        kinds = sorted({n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1] if "." in n else n for n in names})
        said = (f"{family.name}: SEBP runs on the fused experts ({', '.join(kinds)}: gate_up_proj and down_proj, "
                "backward over their routed rows whose dL/dY is not zero) beside the projections; the router "
                "(mlp.gate) stays dense") if names else f"{family.name}: the router (mlp.gate) stays dense"
        if dense:
            said += f"; so do the experts {', '.join(dense)}: the SEBP experts take the fused layout only"
        note(said)
    return names


def unpatch_experts(model: nn.Module) -> list[str]:
    """Undo :func:`patch_experts` (the module's own forward again); return the modules' names."""
    names = []
    for name, module in model.named_modules():
        if vars(module).pop("_sebp_experts", None):
            vars(module).pop("forward", None)
            names.append(name)
    return names


def patched_experts(model: nn.Module) -> list[str]:
    """Names of the experts modules that run the SEBP experts forward."""
    return [n for n, m in model.named_modules() if "_sebp_experts" in vars(m)]
