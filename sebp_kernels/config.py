"""Row-selection settings of the SEBP backward."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Mode = Literal["exact", "threshold", "topk"]
Backend = Literal["auto", "torch", "triton"]
MODES: tuple[str, ...] = ("exact", "threshold", "topk")
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")


@dataclass(frozen=True)
class SEBPConfig:
    """How the backward of one linear layer picks its active rows of dL/dY.

    mode:    ``exact`` (any non-zero element), ``threshold`` (max|row| > eps) or ``topk`` (the ``top_n``
             rows of largest L2 norm; more than the row count means all rows).
    eps:     the threshold of ``threshold`` mode (>= 0).
    top_n:   the row capacity of ``topk`` mode (> 0).
    backend: ``torch`` (gather/GEMM/scatter), ``triton`` (fused GPU kernels) or ``auto`` (triton on CUDA
             when available, else torch).
    triton_op: inside ``torch.compile``, the backward is a ``torch.library.triton_op`` whose kernels the
             compiled graph launches itself (no Python call a layer; :mod:`sebp_kernels._triton.traced`):
             exact and threshold modes on the Triton kernels only, without the density fallback, row hints or
             padding rows. Off: the operator ``sebp::linear_backward``. Eager runs ignore it.

    Rows holding NaN or Inf are active in every mode, so a diverging run is never hidden.
    """

    mode: Mode = "exact"
    eps: float = 0.0
    top_n: int | None = None
    backend: Backend = "auto"
    triton_op: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown SEBP mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown SEBP backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)):
            raise TypeError(f"eps must be a number, got {type(self.eps).__name__}")
        if not math.isfinite(self.eps) or self.eps < 0:
            raise ValueError(f"eps must be a finite number >= 0, got {self.eps}")
        if self.top_n is not None:
            if isinstance(self.top_n, bool) or not isinstance(self.top_n, int):
                raise TypeError(f"top_n must be an integer, got {type(self.top_n).__name__}")
            if self.top_n <= 0:
                raise ValueError(f"top_n (N) must be > 0, got {self.top_n}")
        if not isinstance(self.triton_op, bool):
            raise TypeError(f"triton_op must be True or False, got {type(self.triton_op).__name__}")
        if self.mode == "topk" and self.top_n is None:
            raise ValueError("topk mode needs top_n (N > 0)")
        object.__setattr__(self, "_op_key", _op_key(self))

    def __reduce__(self):  # copies and pickles are built afresh: the op key is this process's own
        return (SEBPConfig, (self.mode, self.eps, self.top_n, self.backend, self.triton_op))

    @property
    def op_key(self) -> int:
        """A negative integer that names these settings inside compiled graphs (``sebp_kernels.registry``); equal
        settings share it."""
        return self._op_key

    @classmethod
    def from_dict(cls, d: dict) -> "SEBPConfig":
        """Build from a plain dict (the per-layer settings of a report); unknown keys are an error."""
        allowed = {"mode", "eps", "top_n", "backend", "triton_op"}
        extra = set(d) - allowed
        if extra:
            raise ValueError(f"unknown SEBP setting(s) {sorted(extra)}; allowed: {sorted(allowed)}")
        return cls(**d)

    def to_dict(self) -> dict:
        """The settings as a plain dict (``triton_op`` only where set, so the records of runs without it read
        as before)."""
        d = {"mode": self.mode, "eps": float(self.eps), "top_n": self.top_n, "backend": self.backend}
        return {**d, "triton_op": True} if self.triton_op else d


_KEY_OF_VALUES: dict[tuple, int] = {}
CONFIG_OF_KEY: dict[int, SEBPConfig] = {}  # -key -> the first config made with those settings (kept alive)


def _op_key(config: SEBPConfig) -> int:
    values = (config.mode, float(config.eps), config.top_n, config.backend, config.triton_op)
    key = _KEY_OF_VALUES.get(values)
    if key is None:
        key = _KEY_OF_VALUES[values] = -(len(_KEY_OF_VALUES) + 1)
        CONFIG_OF_KEY[key] = config
    return key

