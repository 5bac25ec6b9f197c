"""Launch configurations of the GEMM kernels: a fixed table, tuned offline.

The row count k lives on the device, so a runtime autotuner would tune on whatever density its first call
had (and pay Python work on every call). Instead the tile shapes come from the config sweep of
a sweep on an H100 and an H200 (bf16; BERT-base and Llama-3.2-3B projection shapes,
densities 0.2 and 1.0): one config won or came within a few percent of the best for every shape, for each
kernel (``results/tuning/kernel_sweep_h200.json``). In the fused gradient kernel, which takes the dW tiles for both
roles, a sweep on an H100 found it within 1.1% of the best of 8 settings on average over the
same shapes at densities 0.1-0.5 (``results/tuning/grads_sweep_h100.json``).
"""
from __future__ import annotations

import torch

# tile of rows x in_features, reduction over out_features
DX_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}
# tile of out_features x in_features, reduction over the gathered rows
DW_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}

# Few rows (a trimmed batch of short sequences): the default tiles leave most SMs idle. Measured on an H100
# (results/tuning/small_m_h100.json, benchmarks/small_m_probe.py: BERT-base `longest` batches, 2112 rows, 897
# and 1175 of them active), 128 x 128 tiles with 4 warps ran the fused kernel in 10.7 / 12.5 us instead of
# 14.7 / 17.0 us at 768->768 and 25.8 / 30.8 instead of 30.6 / 31.3 at 768->3072; at 3072->768, whose dX has
# four times the tiles, the default stayed faster. :func:`few_rows` draws that line.
SMALL_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4}
SMALL_STAGES = {"dw": 3, "dx": 4}

# fp32 (full-precision FMA dots unless TF32 is allowed) is a correctness path, not a speed target: one small
# config, so that it costs one compile.
FP32_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
INTERPRET_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 1}


def cdiv(a: int, b: int) -> int:
    """Ceiling division for host code (``triton.cdiv`` is a constexpr function whose Python call costs a few
    microseconds; the launchers call it on every backward)."""
    return -(-a // b)


# Smaller settings, in order, for GPUs with less shared memory per block than the H100/H200 (227 KB; the tiles
# above take about 196 KB): the fused gradient kernel moves to the next one when a launch fails for lack of
# resources (``grads.grads_rows``). Each is (the dW tile, warps and stages; the dX pipeline depth), with
# about the shared memory its pipelines take: 147 KB (A100: 164 KB), 48 KB (consumer and L4-class GPUs:
# about 100 KB), 16 KB. Not timed: the lent GPUs only ever take the first setting.
FALLBACK_CONFIGS = [
    ({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}, 3),
    ({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}, 3),
    ({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 2}, 2),
]
LEVELS = 1 + len(FALLBACK_CONFIGS)


def few_rows(m: int, n_in: int, n_sm: int) -> bool:
    """Whether a backward of ``m`` rows into ``n_in`` input features takes :data:`SMALL_CONFIG`: the default
    dX tiles (128 x 256) over all ``m`` rows would fill fewer than half the SMs."""
    return cdiv(m, DX_CONFIG["BLOCK_M"]) * cdiv(n_in, DX_CONFIG["BLOCK_N"]) < n_sm // 2


def gemm_config(kind: str, dtype, interpret: bool, level: int = 0, small: bool = False) -> dict:
    """Launch kwargs (tile sizes, warps, stages) for ``kind`` in ("dx", "dw"); ``level`` > 0: the
    ``level``-th fallback setting (fp16/bf16 only: the fp32 and interpreter settings are small already);
    ``small``: the setting for few rows (:func:`few_rows`)."""
    if interpret:
        return INTERPRET_CONFIG
    if dtype == torch.float32:
        return FP32_CONFIG
    if level == 0 and small:
        return dict(SMALL_CONFIG, num_stages=SMALL_STAGES[kind])
    if level == 0:
        return DX_CONFIG if kind == "dx" else DW_CONFIG
    cfg, dx_stages = FALLBACK_CONFIGS[level - 1]
    return cfg if kind == "dw" else dict(cfg, num_stages=dx_stages)
