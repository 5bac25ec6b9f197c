"""The whole-model benchmark's peers, the methods it times SEBP against besides dense (:mod:`.bench_model`).

- ``liger``: a second copy of the model patched by Liger-Kernel (its RMSNorm, SwiGLU, RoPE and fused linear
  cross-entropy over all rows), decoders on CUDA where ``liger_kernel`` imports;
- ``cce``: the dense model's backbone, then Cut-Cross-Entropy's ``linear_cross_entropy`` (no logits in memory)
  on the labelled rows: ``finetune --head cce``'s loss (:mod:`sebp_probe.model.cce_head`), the whole last layer
  run as a user's ``torch.compile(model.model)`` + CCE runs it. Causal LMs only.
"""
from __future__ import annotations

import contextlib
import sys

import torch

from ..families import FAMILIES, names
from ..model.cce_head import cce_loss, cce_problem  # noqa: F401 - cce_loss: the CCE entry's, finetune --head cce's


def liger_reason(arch: str, device: torch.device) -> str | None:
    """Why the Liger entries cannot run (None: they can)."""
    if not getattr(FAMILIES.get(arch), "liger", False):
        known = " and ".join(FAMILIES[t].name for t in names(lambda f: f.liger))
        return f"Liger-Kernel has no patch for {arch} here (the benchmark runs its patches for {known})"
    if device.type != "cuda":
        return "Liger-Kernel's Triton kernels need a CUDA GPU"
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure is the reason
        return f"liger_kernel does not import ({type(e).__name__}: {' '.join(str(e).split())[:120]})"
    return None


def liger_patch(model: torch.nn.Module, arch: str):
    """``model`` (a second copy of the case's model, built for this) patched by Liger-Kernel, and a context
    manager to run its steps in.

    ``apply_liger_kernel_to_llama/_qwen2(model=...)`` patches the instance's norms, MLPs and forward (its fused
    linear cross-entropy), but also the globals of the transformers module (RoPE, norm and MLP classes), which
    every other model of that module would then use. Those globals are put back at once and set again only
    within the context, around the Liger model's forward."""
    import liger_kernel.transformers as lk

    apply = getattr(lk, f"apply_liger_kernel_to_{arch}")  # apply_liger_kernel_to_llama, ..._qwen2
    module = sys.modules[type(model.model.layers[0]).__module__]
    before = dict(vars(module))
    apply(model=model)  # defaults: rope, rms_norm, swiglu, fused_linear_cross_entropy
    patched = {k: v for k, v in vars(module).items() if before.get(k, module) is not v}
    for k in patched:
        if k in before:
            setattr(module, k, before[k])
        else:
            delattr(module, k)

    @contextlib.contextmanager
    def liger_globals():
        for k, v in patched.items():
            setattr(module, k, v)
        try:
            yield
        finally:
            for k in patched:
                if k in before:
                    setattr(module, k, before[k])
                else:
                    delattr(module, k)

    return model, liger_globals


def cce_reason(task: str) -> str | None:
    """Why the Cut-Cross-Entropy entries cannot run (None: they can)."""
    return cce_problem(None, task)

