"""Fused Triton kernels (private). Importing this raises ImportError without triton.

Submodules load on first use, so one kernel (e.g. :mod:`.rowstats` for the gradient-statistics collector)
does not import the others.
"""
import triton  # noqa: F401  (the ImportError promised above, before any submodule is touched)

__all__ = ["sebp_backward_triton"]


def __getattr__(name: str):
    if name == "sebp_backward_triton":
        from .backward import sebp_backward_triton

        return sebp_backward_triton
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
