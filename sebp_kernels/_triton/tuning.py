"""Autotuning spaces of the GEMM kernels (Hopper-first; small enough to tune in seconds per shape)."""
from __future__ import annotations

import os

import triton

# SEBP_TRITON_AUTOTUNE=0 launches the first config of each list without tuning (fast test runs).
AUTOTUNE = os.environ.get("SEBP_TRITON_AUTOTUNE", "1") != "0"


def _cfg(bm, bn, bk, stages, warps, group=8):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group},
                         num_stages=stages, num_warps=warps)


def dx_configs() -> list:
    """dX: rows x in_features tiles, reduction over out_features."""
    return [
        _cfg(128, 256, 64, 4, 8),
        _cfg(128, 256, 64, 3, 8),
        _cfg(128, 128, 64, 4, 8),
        _cfg(64, 256, 64, 4, 8),
        _cfg(64, 128, 64, 4, 4),
    ]


def dw_configs() -> list:
    """dW: out_features x in_features tiles, reduction over the gathered rows."""
    return [
        _cfg(128, 256, 64, 4, 8),
        _cfg(128, 256, 64, 3, 8),
        _cfg(128, 128, 64, 4, 8),
        _cfg(128, 128, 64, 5, 8),
        _cfg(128, 128, 64, 4, 4),
    ]


# fp32 (full-precision FMA dots unless TF32 is allowed) is a correctness path, not a speed target: one small
# config, so that it costs one compile instead of a tuning sweep.
FP32_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
INTERPRET_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 1}


def _launch_kwargs(cfg) -> dict:
    return dict(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def tuned_launch_kwargs(tuned, memo: dict, key, launch, rows_known: bool = True) -> dict | None:
    """The launch kwargs (tile sizes, warps, stages) the autotuner chose for ``key``, or None on first sight.

    On first sight ``launch(tuned)`` runs the autotuner (which launches the kernel) and its choice is kept:
    later calls launch the plain kernel with it and skip the autotuner's per-call Python work. Without a
    known row count (``rows_known`` False: the first call on a shape) nothing is tuned, since the data at
    hand may not match the key; the first config is used.
    """
    if not (AUTOTUNE and rows_known):
        return _launch_kwargs(tuned.configs[0])
    kw = memo.get(key)
    if kw is None:
        launch(tuned)
        memo[key] = _launch_kwargs(tuned.best_config)
    return kw
