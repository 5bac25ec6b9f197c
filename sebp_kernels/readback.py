"""A count on the device read back as a share, without the host waiting for it.

:class:`ShareReader` copies a device-side count into pinned memory behind the work already queued and records an
event; a later :meth:`~ShareReader.poll` reads it once the event has completed. Used by
:class:`~.pad_rows.PadRows` (a batch's real-row share), and through :class:`PeriodicShare` (a read every few
calls, the latest kept) by :class:`~.density.RowDensity` (a layer's active-row share) and sampled mode's
:class:`~.sampling.SampleState` (a layer's kept share). This module imports none of the modules that use it.
"""
from __future__ import annotations

import torch


class ShareReader:
    """One read in flight at most: :meth:`start` a count over ``n`` rows, :meth:`poll` its share later."""

    __slots__ = ("_host", "_event", "_n")

    def __init__(self) -> None:
        self._host = self._event = None
        self._n = 0

    @property
    def busy(self) -> bool:
        """Whether a read is in flight (started, not yet polled done)."""
        return self._event is not None

    def start(self, count: torch.Tensor, n: int) -> float | None:
        """Start reading ``count`` (a 1-element tensor) / ``n`` back; a CPU count is read at once and returned
        (no sync to avoid), a GPU one returns None. Call it only while not :attr:`busy`."""
        if count.device.type != "cuda":
            return int(count.reshape(-1)[0]) / n
        if self._host is None:
            self._host = torch.empty(1, dtype=torch.int32, pin_memory=True)
        self._host.copy_(count.reshape(1), non_blocking=True)  # on the count's device's current stream
        self._event, self._n = torch.cuda.Event(), n
        self._event.record(torch.cuda.current_stream(count.device))
        return None

    def poll(self) -> float | None:
        """The share of the read in flight once its copy is done (the read then ends), else None."""
        if self._event is None or not self._event.query():
            return None
        self._event = None
        return int(self._host[0]) / self._n


class PeriodicShare:
    """The latest share of a count that :meth:`observe` reads back every ``every``-th call (none while a read is
    in flight or a CUDA graph is captured), never waiting: :attr:`share` is None before the first read, and on
    a GPU a step or more stale. ``calls`` counts the observations (set it to 0 to read the next one)."""

    __slots__ = ("share", "calls", "every", "_reader")

    def __init__(self, every: int) -> None:
        self.share: float | None = None
        self.calls = 0
        self.every = every
        self._reader = ShareReader()

    def poll(self) -> float | None:
        """:attr:`share`, first updated with a read whose copy has completed."""
        share = self._reader.poll()
        if share is not None:
            self.share = share
        return self.share

    def observe(self, count: torch.Tensor, n: int, capturing: bool = False) -> None:
        """Start reading ``count`` (a 1-element tensor) / ``n`` back when this call is due (a CPU count: at once)."""
        calls, self.calls = self.calls, self.calls + 1
        if capturing or self._reader.busy or calls % self.every:
            return
        share = self._reader.start(count, n)
        if share is not None:
            self.share = share
