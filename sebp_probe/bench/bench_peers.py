"""The whole-model benchmark's peers, the methods it times SEBP against besides dense (:mod:`.bench_model`).

- ``liger``: a second copy of the model patched by Liger-Kernel (its RMSNorm, SwiGLU, RoPE and fused linear
  cross-entropy over all rows), decoders on CUDA where ``liger_kernel`` imports;
- ``cce``: the dense model's backbone, then Cut-Cross-Entropy's ``linear_cross_entropy`` (no logits in memory)
  on the labelled rows, the rows that :func:`~sebp_probe.model.heads.head_loss` selects (the next token's label not
  -100; a packed batch's count from its collator). The whole last layer runs, as a user's
  ``torch.compile(model.model)`` + CCE does. On a GPU its Triton kernels (``impl="cce"``), on a CPU its
  ``impl="torch_compile"`` (a check of the run, not a timing). Causal LMs only.
"""
from __future__ import annotations

import contextlib
import sys

import torch

from ..families import FAMILIES, names

IGNORE_INDEX = -100


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
    if task != "causal-lm":
        return "Cut-Cross-Entropy computes a language model's loss: a classifier has no LM head"
    try:
        import cut_cross_entropy  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure is the reason
        return f"cut_cross_entropy does not import ({type(e).__name__}: {' '.join(str(e).split())[:120]})"
    return None


def cce_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The causal-LM loss of ``batch`` (padded or packed) by the backbone and Cut-Cross-Entropy over the
    labelled rows: the model's own loss (mean over labelled tokens), without logits in memory."""
    from cut_cross_entropy import linear_cross_entropy
    from sebp_kernels.linear_ce import labelled_rows

    from ..model.heads import HeadError, backbone_inputs, resolve_head, target_labels
    from ..model.packing import packed_call

    head = resolve_head(model, "causal-lm")
    if head.transform is not None or head.softcap is not None or head.decoder.bias is not None:
        raise HeadError("the Cut-Cross-Entropy entry takes a plain linear LM head without a bias")
    impl = "cce" if head.decoder.weight.is_cuda else "torch_compile"

    def loss(inputs: dict, count: int | None) -> torch.Tensor:
        flat = target_labels(inputs, "causal-lm").reshape(-1)
        rows = labelled_rows(flat, head.decoder.out_features, IGNORE_INDEX, count=count)
        hidden = head.backbone(**backbone_inputs(inputs), use_cache=False)[0]
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
        return linear_cross_entropy(h, head.decoder.weight, flat.index_select(0, rows), impl=impl)

    if "cu_seqlens" not in batch:
        return loss(batch, batch.get("n_targets"))
    with packed_call(model, batch) as inputs:
        return loss(inputs, batch.get("n_targets"))
