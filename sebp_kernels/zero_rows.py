"""dX buffers whose inactive rows stay zero from one backward to the next.

The SEBP backward writes every row of dX: its active rows, and zeros on all the others, because autograd takes
the whole (M, in) tensor. At low density the zeros are most of the bytes it writes (on an H100 they set the
floor of the per-layer backward: "ideal +io" in docs/kernels.md). A :class:`ZeroRowBuffer` keeps dX's storage
between backwards with a per-row mark (``dirty``) of the rows that may hold non-zeros. The Triton backward
then writes the rows active now and zeros only the rows marked dirty (those active the last time), so its
writes scale with k instead of M. The SEBP norms and activations take their input gradients from the pool
too (dX of a norm, dA and dB of an activation): their zero rows are as many.

This is safe only while nobody else writes the buffer between two backwards, which is what :func:`pooled`
checks: it hands out a buffer only when no tensor but the pool's own refers to it (autograd and the layer
below have let go of the last dX), on the stream it was last used on; and a buffer changed in place through
torch (its version counter moved) is marked dirty in full before it is used again. What it cannot see is a
kernel that writes into a gradient it was handed without telling torch (an in-place Triton or CUDA backward
of another library); it is off by default for that reason (:func:`enable`). Under CUDA-graph capture it
hands out only buffers made before (see :func:`pooled`); ``torch.compile`` (whose compiled code may reuse an
output's memory) never uses it.

Memory: the pool keeps up to :data:`MAX_PER_SHAPE` buffers of each gradient shape alive between steps
(BERT-base at 32 x 512 tokens, bf16: 25 MiB for each 768-wide one, 100 MiB for each 3072-wide one); a
BERT-base step's peak rose from 0.986 to 1.015 of dense with it (H100).
"""
from __future__ import annotations

import sys

import torch

MAX_PER_SHAPE = 4
_POOL: dict[tuple, list["ZeroRowBuffer"]] = {}
_ENABLED = [False]


def _refs(t: torch.Tensor) -> tuple[int, int, int]:
    """References to ``t``'s Python object, to its C++ tensor and to its storage (the counts include those that
    asking makes)."""
    return sys.getrefcount(t), t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class ZeroRowBuffer:
    """dX storage of one shape (rows, in_features) plus ``dirty``, int8 per row: 1 where the row may hold
    non-zeros. A new buffer is dirty everywhere, so its first backward writes every row."""

    def __init__(self, rows: int, features: int, dtype: torch.dtype, device) -> None:
        self.dx = torch.empty((rows, features), dtype=dtype, device=device)
        self.dirty = torch.ones(rows, dtype=torch.int8, device=device)
        # a counter per row tile of the zero-writing programs (tiles of 16 rows or more), zero between backwards
        self.tickets = torch.zeros(-(-rows // 16), dtype=torch.int32, device=device)
        self._version = self.dx._version
        self.stream = None  # the CUDA stream of its eager backwards (pooled buffers)
        self.captured = False  # written by a captured CUDA graph: the graph's from now on
        self._idle_refs = _refs(self.dx)

    def take(self, rows: int, features: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor,
                                                                         torch.Tensor]:
        """(dX, dirty, tickets) for a backward with this dX shape; marks every row dirty if dX was changed in
        place through torch since the last backward."""
        if self.dx.shape != (rows, features) or self.dx.dtype != dtype:
            raise ValueError(f"this dX buffer holds {tuple(self.dx.shape)} {self.dx.dtype}, the backward needs "
                             f"({rows}, {features}) {dtype}")
        if self.dx._version != self._version:
            self.dirty.fill_(1)
            self._version = self.dx._version
        return self.dx, self.dirty, self.tickets

    def idle(self) -> bool:
        """Whether only this object refers to dX (no view, no autograd buffer, no user tensor)."""
        return _refs(self.dx) == self._idle_refs


def enable(on: bool = True) -> None:
    """Turn the pool on (SEBP linears, norms and activations on CUDA then keep the zero rows of their input
    gradients between backwards) or off, which also frees its buffers, except those a captured CUDA graph
    writes into (see :func:`pooled`)."""
    _ENABLED[0] = bool(on)
    if not on:
        _keep(captured=True)


def forget_captured() -> None:
    """Drop the buffers that captured CUDA graphs took (see :func:`pooled`): call it only once those graphs
    are gone, since a replay would write into memory that is no longer the buffer's."""
    _keep(captured=False)


def _keep(captured: bool) -> None:
    """Keep only the pooled buffers whose ``captured`` is this."""
    for key in list(_POOL):
        _POOL[key] = [buf for buf in _POOL[key] if buf.captured == captured]
        if not _POOL[key]:
            del _POOL[key]


def enabled() -> bool:
    return _ENABLED[0]


def _usable(device: torch.device) -> bool:
    return device.type == "cuda"


# torch's own C functions behind torch.cuda.is_current_stream_capturing() and current_stream(): the Python
# wrappers cost 1-10 us a call on the device machine's host (current_stream builds a Stream object),
# per SEBP linear of every backward. Absent from CPU-only builds, which never get here with a CUDA device.
_IS_CAPTURING = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and _IS_CAPTURING()


def _stream_id(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return _RAW_STREAM(device.index if device.index is not None else torch.cuda.current_device())


def pooled(rows: int, features: int, dtype: torch.dtype, device: torch.device) -> ZeroRowBuffer | None:
    """An idle buffer of this shape from the pool, or None (pool off, not a CUDA device, or none to be had).

    Eagerly: an idle buffer last used on the current stream, else a new one while fewer than
    :data:`MAX_PER_SHAPE` of the shape are in eager use. While a CUDA graph is being captured: an idle buffer
    that exists already (one the eager warm-up steps made, or one another capture took), never a new one: a
    buffer made during the capture would come from the graph's memory, and the fill of its marks would be
    captured too and rerun at every replay. A buffer taken by a capture stays the graph's: it is not handed
    out eagerly again, and not freed while this process runs (the graph may replay into it). Replays keep
    its zero rows and marks from one to the next like eager backwards do; what they cannot see is an in-place
    change of a dX inside the graph after its last use there.
    """
    if not _ENABLED[0] or not _usable(device):
        return None
    buffers = _POOL.setdefault((rows, features, dtype, device), [])
    if _capturing(device):
        for buf in buffers:
            if buf.idle():
                buf.captured = True
                return buf
        return None
    stream = _stream_id(device)
    for buf in buffers:
        if not buf.captured and buf.stream == stream and buf.idle():
            return buf
    if sum(not buf.captured for buf in buffers) >= MAX_PER_SHAPE:
        return None
    buf = ZeroRowBuffer(rows, features, dtype, device)
    buf.stream = stream
    buffers.append(buf)
    return buf
