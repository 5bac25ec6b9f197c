"""The rows padding fills, known before the forward: the SEBP linears take them instead of selecting rows.

In a padded batch whose attention mask hides the padding, a padding position is never attended to and carries
no loss, so dL/dY of every token-wise linear is exactly zero on its rows. Each SEBP linear would find that
out again with its select pass (a pass over dY and a compaction, about 4 us a layer on an H100 at BERT-base
`longest` sizes: a third of a millisecond over BERT-base's 72 linears). :class:`PadRows` works the rows out
once per forward from the mask, in the select pass's form (a permutation with the real-token rows first, in
order, and their count on the device), and hands them to every SEBP linear of that forward whose dY has the
batch's row count; a row hint from an SEBP activation still comes first.

Whether padding rows really get no gradient depends on the model and the labels (a collator that leaves
labels on the padding breaks it, and so does left padding under a classifier that pools position 0), so only
right-padded batches name padding rows (decided on the device: a batch with padding elsewhere names none),
and nothing is taken on trust: the first backward after the rows are set
only checks, on the device, that every non-zero row of each linear's dY is a real-token row, while the
linears still select their rows. The next forward reads that count once (one host sync): zero turns the
rows on, anything else turns them off for good with a warning. Only exact mode uses them (elsewhere rows are
chosen by their values), and never while a CUDA graph is captured before the check was read.

Some linears' dY is far sparser than the padding says: where the loss reads a few positions, the last layer's
rows past its attention (in a [CLS] classifier the CLS rows; in an SFT decoder with the prompt's labels masked,
the answer rows, and the model's own LM head with them) carry gradient on those positions only. The check
therefore also counts each linear's non-zero rows, and a linear whose count was at most :data:`OWN_BELOW` of the
real-token rows keeps selecting its own rows after the verdict (its select pass costs less than the GEMMs over
the real rows it would skip): the check sets its ``sebp_own_rows``.

Inside ``torch.compile`` (each layer compiled, the model's pre-hook eager) an SEBP linear passes the rows of its
forward as inputs of the graph (:meth:`PadRows.traced`), which its backward operator takes as eager code does
(:func:`bind_traced`): what the check found is read when the backward runs, so the verdict "on" changes no
graph ("off" names no rows from then on: the layer compiles once more without them). Where the pre-hook itself
is traced (the whole model compiled) it names no rows.
"""
from __future__ import annotations

import warnings

import torch

from .readback import ShareReader

CHECKING, ON, OFF = "checking", "on", "off"
# A linear whose dY had at most this share of the real-token rows non-zero while checked selects its own rows.
OWN_BELOW = 0.5


class PadRows:
    """The real-token rows of the current batch, shared by a model's SEBP linears (see the module docstring).

    ``set(mask)`` before each forward (a forward pre-hook of the model does it); an SEBP linear's forward
    calls :meth:`bind` and keeps what it returns as its row hint. ``state``: "checking", "on" or "off";
    ``taken`` counts the backwards that used the rows. ``forward_real_rows``: once "on", an SEBP linear's forward
    may compute the real-token rows alone (:mod:`~sebp_kernels.forward_rows`); False keeps every forward on
    all rows (the backward still takes the padding rows)."""

    def __init__(self, forward_real_rows: bool = True):
        self.forward_real_rows = forward_real_rows
        self.state = CHECKING
        self.rows = None  # (perm, count, real-token flags) of the batch set last
        self.real = None  # the flags as (batch, seq)
        self.shape = None  # its (batch, seq)
        self.violations = None  # device counter of non-zero padding rows seen while checking
        self.checked = 0  # backwards checked since the counter was last read
        self.taken = 0
        self.density = None  # the share of real rows of a recent batch (read without a sync), None before one
        self._reader = ShareReader()  # that share in flight
        self._layers = {}  # id(linear) -> [linear, non-zero rows, real rows] (device counters) while checking
        # the most rows a batch of the run can have (batch size x longest length), set by what makes the batches, or
        # None: a compiled layer decides with it, once, whether its forward over the real rows could pay
        # (sebp_kernels.functional._over_rows), instead of guarding on each batch's row count (a recompile)
        self.row_bound = None

    def __getstate__(self):  # a copy (deepcopy of a model, pickle) leaves the read in flight behind
        return {**vars(self), "_reader": ShareReader()}

    def set(self, mask: torch.Tensor) -> None:
        """The rows of a batch whose (batch, seq) attention mask is ``mask`` (non-zero = a real token). Only a
        right-padded batch names padding rows; for any other every row counts as real."""
        if self.state == CHECKING and self.checked and not _capturing(mask.device):
            self._decide()
        if self.state == OFF:
            self.rows = None
            return
        real = mask != 0
        if real.dim() == 2 and real.shape[1] > 1:  # right padding only (decided on the device): else every row
            right = (real[:, 1:] <= real[:, :-1]).all()
            real = real | ~right
        flat = real.reshape(-1)
        perm = torch.sort((~flat).to(torch.uint8), stable=True).indices.to(torch.int32)
        self.rows = (perm, flat.sum(dtype=torch.int32).reshape(1), flat)
        self.real, self.shape = real, tuple(mask.shape)
        self._read_density(self.rows[1], flat.numel())

    def _read_density(self, count: torch.Tensor, n: int) -> None:
        """The share of real rows, for the forward's choice (:func:`~sebp_kernels.forward_rows.pays`) without a
        host sync: copied to pinned memory as it is set, read at a later set once that copy is done (so the
        share is a batch or more stale). On the CPU it is read at once; during a CUDA-graph capture nothing."""
        if _capturing(count.device):
            return
        done = self._reader.poll()  # the read started at an earlier set, if its copy is done
        now = None if self._reader.busy else self._reader.start(count, n)  # a CPU count: this batch's at once
        for share in (done, now):
            if share is not None:
                self.density = share

    def clear(self) -> None:
        """No rows for the next forward (a batch without a padding mask)."""
        self.rows = self.real = None

    def traced(self) -> tuple | None:
        """What a compiled SEBP linear passes on as inputs of its graph: (perm, count, real-token flags as
        (batch, seq)) of the batch set last, or None. Read as the layer is traced and each call: the state, which
        the check changes, is not (:func:`bind_traced` reads it when the backward runs)."""
        return None if self.rows is None else (self.rows[0], self.rows[1], self.real)

    def bind(self, hint, x_shape: tuple, owner=None):
        """The row hint an SEBP linear's backward reads in this forward: ``hint`` (an activation's rows, or
        None), backed by the padding rows set now where the linear's input ``x_shape`` is the batch's tokens
        (batch, seq, features): not, say, the tokens routed to one expert of a mixture, whose count may match
        by chance. ``owner``: the linear (its check counts its own rows; one that selects its own rows gets
        ``hint`` alone)."""
        if (self.rows is None or self.state == OFF or tuple(x_shape[:-1]) != self.shape
                or getattr(owner, "sebp_own_rows", False)):
            return hint
        return _Bound(self, hint, self.rows, owner)

    def forward_rows(self, x_shape: tuple):
        """(perm, count, a recent real-row share) of the real-token rows an SEBP linear's forward may compute
        alone (:mod:`~sebp_kernels.forward_rows`, which decides whether that pays), or None (every row): only
        once the check found no gradient on the padding (``on``), and only where the input ``x_shape`` is the
        batch's tokens, as :meth:`bind` decides (a linear that selects its own backward rows takes them too)."""
        return None if self.rows is None else forward_rows_traced(self, x_shape, self.rows[0], self.rows[1], self.real)

    def verdict(self) -> str | None:
        """``on`` or ``off`` once the check is decided, deciding it now where backwards were checked since (one
        host sync; not while a CUDA graph is captured); None while nothing was checked."""
        if self.state == CHECKING and self.checked and not _capturing(self.violations.device):
            self._decide()
        return None if self.state == CHECKING else self.state

    def _decide(self) -> None:
        layers = list(self._layers.values())
        # one host sync for the verdict and every linear's counts
        counts = torch.stack([self.violations, *(c for _, act, real in layers for c in (act, real))]).tolist()
        bad = counts[0]
        self.checked, self._layers = 0, {}
        if bad:
            self.state = OFF
            warnings.warn(f"sebp: {bad} padding row(s) of the linears' dL/dY were non-zero (the loss reaches the "
                          "padding, e.g. labels left on it): the SEBP linears select their rows themselves",
                          stacklevel=3)
            return
        self.state = ON
        for i, (linear, _, _) in enumerate(layers):
            act, real = counts[1 + 2 * i], counts[2 + 2 * i]
            if 0 < act <= OWN_BELOW * real:  # no non-zero row at all (a batch without a target) says nothing
                linear.sebp_own_rows = True

    def _check(self, t: torch.Tensor, flat: torch.Tensor, owner=None) -> None:
        nonzero = (t.reshape(flat.numel(), -1) != 0).any(1)
        bad = (nonzero & ~flat).sum(dtype=torch.int32)
        if self.violations is None:
            self.violations = torch.zeros((), dtype=torch.int32, device=bad.device)
        dev = self.violations.device  # the counters live on one device, whichever device a layer is on
        self.violations += bad.to(dev)
        self.checked += 1
        if owner is not None:
            entry = self._layers.get(id(owner))
            if entry is None:
                entry = self._layers[id(owner)] = [owner, torch.zeros((), dtype=torch.int32, device=dev),
                                                   torch.zeros((), dtype=torch.int32, device=dev)]
            entry[1] += nonzero.sum(dtype=torch.int32).to(dev)
            entry[2] += flat.sum(dtype=torch.int32).to(dev)


class _Bound:
    """A row hint of one forward: the activation's own first, then the padding rows (or, while checking,
    none: the check only) of the linear ``owner``."""

    __slots__ = ("pad", "hint", "rows", "owner")

    def __init__(self, pad: PadRows, hint, rows, owner=None):
        self.pad, self.hint, self.rows, self.owner = pad, hint, rows, owner

    def take(self, t: torch.Tensor):
        got = self.hint.take(t) if self.hint is not None else None
        perm, count, flat = self.rows
        if got is not None or t.dim() == 0 or t.numel() != flat.numel() * t.shape[-1] or t.device != flat.device:
            return got
        if self.pad.state == CHECKING:
            self.pad._check(t, flat, self.owner)
            return None
        self.pad.taken += 1
        return perm, count


def bind_traced(pad: PadRows | None, hint, dy_shape: tuple, perm, count, real, owner=None):
    """The row hint of a compiled SEBP linear ``owner``'s backward: ``hint``, backed by the padding rows its
    forward passed on (:meth:`PadRows.traced`) where ``pad`` has not turned them off and dY is the batch's tokens
    (batch, seq, features), as :meth:`PadRows.bind` decides eagerly."""
    if (pad is None or pad.state == OFF or tuple(dy_shape[:-1]) != tuple(real.shape)
            or getattr(owner, "sebp_own_rows", False)):
        return hint
    return _Bound(pad, hint, (perm, count, real.reshape(-1)), owner)


def forward_rows_traced(pad: PadRows | None, x_shape: tuple, perm, count, real):
    """(perm, count, a recent real-row share) for the forward of a compiled SEBP linear whose layer passed on
    the rows of its batch (:meth:`PadRows.traced`), read when the forward runs, as :meth:`PadRows.forward_rows`
    decides eagerly; or None."""
    if pad is None or not pad.forward_real_rows or pad.state != ON or tuple(x_shape[:-1]) != tuple(real.shape):
        return None
    return perm, count, pad.density


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
