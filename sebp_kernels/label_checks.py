"""The labelled-rows head's checks of its labels, kept on the device until the caller waits anyway.

:func:`~sebp_kernels.linear_ce.labelled_rows` checks that every label it keeps is a class (in [0, V)) and, given
the labelled count as a Python int, that the labels hold that many. Read on the host, each check is a device
sync: the host waits for everything queued before it, and the GPU then idles while the host launches what
follows. A training step of the labelled-rows head given its counts made four (two in the head, before the
model's forward, and two in the loss, after it).

Inside :func:`deferred` the checks stay on the device: each call adds its counts to device tensors, the rows
are found as if every label were good, and the heads that read the labels take them through :func:`safe`, which
turns a label outside [0, V) into class 0 (no kernel reads past the logits, none asserts on the device); the
caller reads the checks where it waits anyway, :meth:`Deferred.check` (the training loop: right after the wait
for the step's loss, before the optimizer step), which raises the same one-line ``ValueError`` the eager checks
raise. Leaving the block checks too. A step with bad labels thus computes a loss nobody uses and changes no
parameter.

This module imports none of the modules that use it.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# past this many counts held, the next add reads them at once (one sync): a block around many steps stays small
MAX_HELD = 256


class Deferred:
    """Label checks made on the device, read by :meth:`check`."""

    def __init__(self) -> None:
        self._bad: list[tuple[torch.Tensor, torch.Tensor, int, int]] = []  # (bad count, a bad label, V, ignore)
        self._counts: list[tuple[torch.Tensor, int, int]] = []  # (labels kept, the count given, ignore_index)

    def add(self, labels: torch.Tensor, bad: torch.Tensor, kept: torch.Tensor, count: int | None, vocab: int,
            ignore_index: int) -> None:
        """One call's checks: ``bad`` (flags of labels outside [0, vocab)), ``kept`` (flags of the labels that are
        not ``ignore_index``, bad ones included) against ``count`` (None: not given)."""
        if labels.numel():
            first = labels.reshape(-1)[bad.reshape(-1).to(torch.uint8).argmax()]  # a bad label, where there is one
            self._bad.append((bad.sum(), first, vocab, ignore_index))
        if count is not None:
            self._counts.append((kept.sum(), count, ignore_index))
        if len(self._bad) + len(self._counts) > MAX_HELD:
            self.check()

    def check(self) -> None:
        """Read every check held (one sync) and forget them; ``ValueError`` for the first that failed: a label
        outside [0, V) first, then a count that differs from the one given."""
        bad, counts, self._bad, self._counts = self._bad, self._counts, [], []
        if not bad and not counts:
            return
        held = [x for n, first, _, _ in bad for x in (n, first)] + [n for n, _, _ in counts]
        dev = held[0].device
        values = torch.stack([t.reshape(()).to(dev, torch.int64) for t in held]).tolist()
        for i, (_, _, vocab, ignore_index) in enumerate(bad):
            if values[2 * i]:
                raise ValueError(f"label {values[2 * i + 1]} is outside [0, {vocab}) (and is not ignore_index "
                                 f"{ignore_index})")
        for got, (_, want, ignore_index) in zip(values[2 * len(bad):], counts):
            if got != want:
                raise ValueError(f"{got} labels are not ignore_index {ignore_index}, not the {want} given")


_ACTIVE: list[Deferred] = []


def active() -> Deferred | None:
    """The innermost :func:`deferred` block's checks, or None (the checks then read on the host at once)."""
    return _ACTIVE[-1] if _ACTIVE else None


def safe(labels: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
    """``labels`` as a head may index with them: inside :func:`deferred`, where a bad label is only counted, every
    label outside [0, vocab) but ``ignore_index`` becomes 0 (a new tensor; the check still raises); elsewhere
    ``labels`` itself (the eager checks raised already)."""
    if not _ACTIVE or torch.compiler.is_compiling():
        return labels
    return labels.masked_fill((labels != ignore_index) & ((labels < 0) | (labels >= vocab)), 0)


@contextlib.contextmanager
def deferred() -> Iterator[Deferred]:
    """Keep the labelled-rows head's label checks on the device inside the block (see the module docstring);
    they are read at :meth:`Deferred.check` and when the block ends (not where it ends by an exception: that one
    goes on)."""
    checks = Deferred()
    _ACTIVE.append(checks)
    try:
        yield checks
    finally:
        _ACTIVE.remove(checks)
    checks.check()
