"""Row-selection settings of the SEBP backward."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Mode = Literal["exact", "threshold", "topk", "sampled"]
Backend = Literal["auto", "torch", "triton"]
MODES: tuple[str, ...] = ("exact", "threshold", "topk", "sampled")
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")


@dataclass(frozen=True)
class SEBPConfig:
    """How the backward of one linear layer picks its active rows of dL/dY.

    mode:    ``exact`` (any non-zero element), ``threshold`` (max|row| > eps), ``topk`` (the ``top_n``
             rows of largest L2 norm; more than the row count means all rows) or ``sampled`` (approximate,
             unbiased: each non-zero row kept with a probability set by its norm and rescaled, see
             :mod:`.sampling`; the layer's state is a :class:`~.sampling.SampleState`).
    eps:     the threshold of ``threshold`` mode (>= 0).
    top_n:   the row capacity of ``topk`` mode (> 0).
    backend: ``torch`` (gather/GEMM/scatter), ``triton`` (fused GPU kernels) or ``auto`` (triton on CUDA
             when available, else torch). ``sampled`` on the Triton kernels draws, compacts and rescales its
             rows on the device (:mod:`sebp_kernels._triton.sampled`).
    triton_op: inside ``torch.compile``, the backward is a ``torch.library.triton_op`` whose kernels the
             compiled graph launches itself (no Python call a layer; :mod:`sebp_kernels._triton.traced`):
             exact and threshold modes on the Triton kernels only, without the density fallback, row hints or
             padding rows. Off: the operator ``sebp::linear_backward``. Eager runs ignore it.
    budget:    ``sampled``: the expected share of the non-zero rows kept for dW, in (0, 1] (1: exact), or
               ``"auto"``: per layer, the fewest rows whose added variance in dW stays under ``variance_tau`` of
               the minibatch SGD variance (:mod:`.sample_variance`).
    variance_tau: ``sampled``: the variance budget, a share of the SGD variance (VCAS's 0.025): the cutoff of
               ``auto``, and the limit of the exact-gradient guard in both budgets.
    sample_dx: ``sampled``: dX from the sample too (default False: dX exact over the non-zero rows).
    seed:      ``sampled``: the run's seed of the row draws.
    warmup:    ``sampled``: the layer's first ``warmup`` backwards keep every non-zero row (exact).

    Rows holding NaN or Inf are active in every mode, so a diverging run is never hidden.
    """

    mode: Mode = "exact"
    eps: float = 0.0
    top_n: int | None = None
    backend: Backend = "auto"
    triton_op: bool = False
    budget: float | str | None = None
    sample_dx: bool = False
    seed: int = 0
    warmup: int = 0
    variance_tau: float = 0.025

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
        self._check_sampled()
        object.__setattr__(self, "_op_key", _op_key(self))

    def _check_sampled(self) -> None:
        if self.mode != "sampled":
            if self.budget is not None or self.sample_dx or self.warmup or self.variance_tau != 0.025:
                raise ValueError(f"budget, sample_dx and warmup belong to sampled mode, not {self.mode}")
            return
        b = self.budget
        if b != "auto" and (isinstance(b, bool) or not isinstance(b, (int, float)) or not (0 < b <= 1)):
            raise ValueError(f"sampled mode needs a budget in (0, 1] (the share of non-zero rows kept) or 'auto', "
                             f"got {b!r}")
        t = self.variance_tau
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 < t < math.inf):
            raise ValueError(f"sampled mode's variance_tau must be a number > 0, got {t!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"sampled mode's seed must be an integer, got {self.seed!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"sampled mode's warmup must be an integer >= 0, got {self.warmup!r}")

    def __reduce__(self):  # copies and pickles are built afresh: the op key is this process's own
        return (SEBPConfig, (self.mode, self.eps, self.top_n, self.backend, self.triton_op, self.budget,
                             self.sample_dx, self.seed, self.warmup, self.variance_tau))

    @property
    def op_key(self) -> int:
        """A negative integer that names these settings inside compiled graphs (``sebp_kernels.registry``); equal
        settings share it."""
        return self._op_key

    @classmethod
    def from_dict(cls, d: dict) -> "SEBPConfig":
        """Build from a plain dict (the per-layer settings of a report); unknown keys are an error."""
        allowed = {"mode", "eps", "top_n", "backend", "triton_op", *_SAMPLED_KEYS}
        extra = set(d) - allowed
        if extra:
            raise ValueError(f"unknown SEBP setting(s) {sorted(extra)}; allowed: {sorted(allowed)}")
        return cls(**d)

    def to_dict(self) -> dict:
        """The settings as a plain dict (``triton_op`` only where set, so the records of runs without it read
        as before; ``sampled``'s own keys only in that mode)."""
        d = {"mode": self.mode, "eps": float(self.eps), "top_n": self.top_n, "backend": self.backend}
        if self.triton_op:
            d["triton_op"] = True
        if self.mode == "sampled":
            d.update(budget=_budget(self.budget), sample_dx=self.sample_dx, seed=self.seed, warmup=self.warmup)
            if self.variance_tau != 0.025:
                d["variance_tau"] = float(self.variance_tau)
        return d


_SAMPLED_KEYS = ("budget", "sample_dx", "seed", "warmup", "variance_tau")


def _budget(b):
    return b if b == "auto" or b is None else float(b)


def _values(config: SEBPConfig) -> tuple:
    return (config.mode, float(config.eps), config.top_n, config.backend, config.triton_op,
            _budget(config.budget), config.sample_dx, config.seed, config.warmup, float(config.variance_tau))


_KEY_OF_VALUES: dict[tuple, int] = {}
CONFIG_OF_KEY: dict[int, SEBPConfig] = {}  # -key -> the first config made with those settings (kept alive)


def _op_key(config: SEBPConfig) -> int:
    values = _values(config)
    key = _KEY_OF_VALUES.get(values)
    if key is None:
        key = _KEY_OF_VALUES[values] = -(len(_KEY_OF_VALUES) + 1)
        CONFIG_OF_KEY[key] = config
    return key

