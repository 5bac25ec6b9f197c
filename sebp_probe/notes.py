"""One channel for notes: what the library did in place of what was asked or expected (a fallback of a model
family, labels mapped, rows dropped, a checkpoint passed over), one line each.

Library code calls :func:`note`. Inside :func:`collect_notes` (``finetune``, ``analyze``, ``heatmap``) each
distinct line goes to that block's collector: finetune turns it into a ``note`` event (the CLI prints it as
``note: ...``) and lists it under ``notes`` in its summary; analyze and heatmap list it under ``notes`` in what
they return, which the CLI prints the same way. Outside such a block (``patch_model``, ``apply_sebp(trainer)``,
the benchmark) a note is a warning of the ``sebp_probe`` logger, which the CLI prints as ``note: ...`` too.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

__all__ = ["collect_notes", "note"]

log = logging.getLogger("sebp_probe")
_collectors: list[Callable[[str], None]] = []


def note(message: str) -> None:
    """Say one line (whitespace collapsed): to the innermost :func:`collect_notes` block, else to the logger."""
    line = " ".join(str(message).split())
    if _collectors:
        _collectors[-1](line)
    else:
        log.warning(line)


@contextlib.contextmanager
def collect_notes(on_note: Callable[[str], None] | None = None) -> Iterator[list[str]]:
    """Within the block, every distinct note goes to ``on_note`` once and into the yielded list, in order."""
    said: list[str] = []

    def collect(line: str) -> None:
        if line not in said:
            said.append(line)
            if on_note is not None:
                on_note(line)

    _collectors.append(collect)
    try:
        yield said
    finally:
        _collectors.remove(collect)
