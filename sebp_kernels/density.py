"""A layer's recent share of active rows, read back from the device without waiting for it.

In ``exact`` mode the rows the SEBP backward skips are exactly zero, so the plain dense backward (cuBLAS,
``dY @ W``, ``dYᵀ X``, ``dY.sum(0)``) gives the same gradients up to summation order. When nearly every row
is active, the dense GEMMs are the faster way to get them: there is nothing to skip, and the row selection
and gathered GEMMs cost more than cuBLAS. :class:`RowDensity` lets a layer pick between the two.

The active-row count stays on the device (the SEBP backward never syncs), so the density is copied into
pinned host memory asynchronously and read on a later backward once its event has completed. The choice is
therefore a step or more stale, which can cost speed but never correctness. While the dense path is in use,
every ``PROBE_EVERY``-th backward also runs the row selection (a few microseconds when rows are dense: it
stops at the first non-zero of each row) to see whether the density has dropped. Inside
CUDA-graph capture nothing is read or copied; the capture records whichever path the estimate picks then.
"""
from __future__ import annotations

import torch

from .readback import PeriodicShare
from .registry import register

# Take the dense backward when at least this share of rows was active last time. H100, bf16, the seven
# BERT-base / Llama-3.2-3B shapes (results/tuning/dense_gap_h100.json): the SEBP kernels are 1-13% faster than
# cuBLAS at 0.75 (one shape 1.5% slower), 5% faster to 10% slower at 0.9, and 2-16% slower at 1.0.
DENSE_ABOVE = 0.85
PROBE_EVERY = 16  # while dense, every PROBE_EVERY-th backward re-measures through the SEBP path
OBSERVE_EVERY = 8  # while sparse, read the count back every OBSERVE_EVERY-th backward (host cost ~10 us)


class RowDensity:
    """Host-side estimate of one layer's active-row share (see the module docstring)."""

    __slots__ = ("_share", "_dense_calls", "key", "__weakref__")

    def __init__(self) -> None:
        self.key = register(self)  # names it inside compiled graphs (see .registry); a copy gets its own
        self._share = PeriodicShare(OBSERVE_EVERY)  # the count read back, and the one in flight
        self._dense_calls = 0

    def __reduce__(self):  # copies and pickles (deepcopy of a model) start afresh: no event, no pinned buffer
        return (RowDensity, ())

    @property
    def density(self) -> float | None:
        """The last share read back; None before the first."""
        return self._share.share

    def choose(self, capturing: bool = False) -> str:
        """This backward's path: ``sebp``, ``dense``, or ``probe`` (dense, plus the row selection alone, whose
        count is then passed to :meth:`observe`)."""
        density = self._share.share if capturing else self._share.poll()
        if density is None or density < DENSE_ABOVE:
            return "sebp"
        if capturing:
            return "dense"
        self._dense_calls += 1
        if self._dense_calls >= PROBE_EVERY:
            self._dense_calls = 0
            self._share.calls = 0  # so that observe() reads this probe's count back
            return "probe"
        return "dense"

    def observe(self, count: torch.Tensor, rows: int, capturing: bool = False) -> None:
        """Start reading back the device-side active-row ``count`` of a backward over ``rows`` rows (every
        ``OBSERVE_EVERY``-th call; on the CPU, the Triton interpreter, at once)."""
        self._share.observe(count, rows, capturing)
