"""sebp-probe: find and exploit gradient sparsity in Transformer fine-tuning."""
from sebp_kernels import ReSpropLinear, SEBPConfig, SEBPLinear, SEBPNorm

from ._version import __version__
from .model.patch import (PatchError, find_targets, patch_activations, patch_model, patch_norms, patched_activations,
                    patched_layers, unpatch_activations, unpatch_model)
from .model.resprop import ReuseDropCollector, patch_resprop, reset_resprop, resprop_layers, unpatch_resprop

__all__ = [
    "SEBPConfig", "SEBPLinear", "SEBPNorm", "PatchError", "find_targets", "patch_activations", "patch_model",
    "patch_norms", "patched_activations", "patched_layers", "unpatch_activations", "unpatch_model",
    "ReSpropLinear", "ReuseDropCollector", "patch_resprop", "reset_resprop", "resprop_layers", "unpatch_resprop",
]
