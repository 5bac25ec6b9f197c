"""LoRA merged into a gathered state dict: how a sharded (FSDP) LoRA run saves a plain model.

Unsharded, ``finetune`` saves ``peft_model.merge_and_unload()``. Under FSDP the weights are shards (DTensors):
merging them in place and saving from the main process alone would start collectives on one rank (a hang).
There the full state dict is gathered on every rank first (accelerate's ``get_state_dict``), and the main
process merges it here, key by key: ``W + scaling * B @ A`` for every LoRA linear, under the base model's
own keys.
"""
from __future__ import annotations

import torch
from torch import nn

ADAPTER = "default"


def lora_scalings(peft_model: nn.Module) -> dict[str, float]:
    """{module name in ``peft_model``: scaling} of its LoRA linears (adapter ``default``), or a one-line error
    for what this merge does not cover (DoRA, fan-in-fan-out weights, several adapters)."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer) or ADAPTER not in getattr(module, "lora_A", {}):
            continue
        if module.use_dora.get(ADAPTER) or getattr(module, "fan_in_fan_out", False) or len(module.lora_A) > 1:
            raise ValueError(f"saving a sharded LoRA model: layer {name!r} uses DoRA, fan-in-fan-out weights or "
                             "several adapters, which the merge does not cover")
        out[name] = float(module.scaling[ADAPTER])
    return out


def merge_lora_state(state: dict[str, torch.Tensor], scalings: dict[str, float],
                     prefix: str = "base_model.model.") -> dict[str, torch.Tensor]:
    """The base model's state dict from a peft model's full one: every LoRA linear merged (computed in float32,
    stored in the weight's dtype), its ``base_layer`` keys renamed to the plain module's, adapter keys
    dropped."""
    merged = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        name = key[len(prefix):] if key.startswith(prefix) else key
        merged[name.replace(".base_layer.", ".")] = value
    for module, scale in scalings.items():
        base = module[len(prefix):] if module.startswith(prefix) else module
        a = state[f"{module}.lora_A.{ADAPTER}.weight"].float()
        b = state[f"{module}.lora_B.{ADAPTER}.weight"].float()
        w = merged[f"{base}.weight"]
        merged[f"{base}.weight"] = (w.float() + scale * (b @ a)).to(w.dtype)
    return merged
