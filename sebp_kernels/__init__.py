"""SEBP kernels: a linear layer (and LayerNorm/RMSNorm, MLP activations) whose backward works on the active rows
of dL/dY only; and ReSprop (:mod:`.resprop`), which reuses the previous step's dL/dY and computes a sparse
correction through the same row-gather backward.

Depends on torch (and triton for the GPU kernels) only; knows nothing of models or of sebp_probe.
"""
from .activations import RowHint, sebp_gelu, sebp_swiglu
from .config import SEBPConfig
from .functional import SEBPLinearFunction, sebp_linear
from .linear_ce import linear_cross_entropy
from .modules import SEBPConv1D, SEBPLinear
from .norms import SEBPNorm, norm_kind, sebp_layer_norm, sebp_rms_norm
from .reference import backward_over_rows, select_rows, sebp_backward_torch
from .sampling import SampleState
from .resprop import ReSpropLinear, ReSpropState, ReuseDrop, resprop_grads, resprop_linear, reuse_drop

__all__ = [
    "RowHint",
    "sebp_gelu",
    "sebp_swiglu",
    "SEBPConfig",
    "SEBPLinear",
    "SEBPConv1D",
    "SEBPNorm",
    "norm_kind",
    "sebp_layer_norm",
    "sebp_rms_norm",
    "SEBPLinearFunction",
    "sebp_linear",
    "linear_cross_entropy",
    "select_rows",
    "backward_over_rows",
    "sebp_backward_torch",
    "SampleState",
    "ReSpropLinear",
    "ReSpropState",
    "ReuseDrop",
    "resprop_grads",
    "resprop_linear",
    "reuse_drop",
]
