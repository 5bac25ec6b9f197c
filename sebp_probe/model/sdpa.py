"""sdpa without cuDNN's attention: the one place that says why and how.

PyTorch's ``scaled_dot_product_attention`` may pick cuDNN's attention on a GPU such as the H100. cuDNN builds an
execution plan on the host for each new input shape, and padded training batches change shape with nearly
every step. Measured on an H100 (docs/trainer.md, results/trainer.json): two profiled steps of plain
SFTTrainer spent 0.99 s of host time in cuDNN's attention forward and 1.2 s in its backward, against 0.33 s of
GPU time, and the same trainer without cuDNN's attention stepped 1.5x faster. Flash, memory-efficient or math
attention compute the same, without a plan per shape.

Used by ``finetune``'s run (unless its batches all have one shape, ``max_length``: cuDNN then plans once), by
the training steps of :func:`~sebp_probe.integrations.hf.apply_sebp` (unless ``keep_cudnn_attention``), and
always by the kept-rows last layer, whose query count changes with every batch.
"""
from __future__ import annotations


def without_cudnn_attention():
    """A block in which sdpa chooses among flash, memory-efficient and math attention, not cuDNN's. The flags
    are the process's; a backward run inside keeps the kernel its forward took, and a checkpointed layer's
    recomputation must run inside too (it must take the kernel the forward took)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
