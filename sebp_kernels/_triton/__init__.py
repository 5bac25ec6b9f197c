"""Fused Triton kernels of the SEBP backward (private). Importing this raises ImportError without triton."""
from .backward import sebp_backward_triton

__all__ = ["sebp_backward_triton"]
