"""Whether Triton runs under its interpreter: the one place the package reads ``TRITON_INTERPRET``.

Triton reads the variable itself when it decorates the kernels (``TRITON_INTERPRET=1``: they run on CPU tensors,
slowly; the CPU tests use it), so it is read once, at import, as Triton does; the kernels' launchers and the
code that decides where the Triton paths apply import it from here.
"""
from __future__ import annotations

import os

import torch

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels take tensors on ``device``: a GPU, or the CPU under the interpreter."""
    return device.type == ("cpu" if INTERPRET else "cuda")
