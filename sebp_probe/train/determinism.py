"""``--deterministic``: torch's deterministic algorithms for a whole run, so that the same command computes the
same bits twice, and a run resumed after an interruption the bits of the uninterrupted run.

What changes: ``torch.use_deterministic_algorithms(True)`` (strict: an op without a deterministic implementation
raises at its first call, which ends the run in one line naming it), cuBLAS's fixed workspace
(``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless set: torch refuses deterministic cuBLAS calls without it), and
cuDNN's deterministic, unbenchmarked kernels. sdpa's flash and memory-efficient attention then take their
deterministic backward (no atomic adds into dQ), which is slower. The SEBP kernels are deterministic as they
are: their reductions run in a fixed order and their atomics count integers only. The settings are the
process's; they are put back when the run ends (the environment variable too).

Same bits: a resumed run and the uninterrupted one, always (the resume reloads every choice the run made);
two separate runs of one command where nothing is chosen by timing: ``--padding auto`` and ``--compile auto``
pick by measured speed, and calibration's dense fallback (``--always-sebp`` turns it off) by measured backward
time, so two runs may choose differently.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

CUBLAS_WORKSPACE = ":4096:8"
_NOT_DETERMINISTIC = "does not have a deterministic implementation"


class NotDeterministic(RuntimeError):
    """An op of the run has no deterministic implementation; the message is one line."""


@contextlib.contextmanager
def deterministic(on: bool) -> Iterator[None]:
    """Within the block torch runs deterministically where ``on`` (see the module docstring); an op that cannot
    raises :class:`NotDeterministic` with its one-line reason."""
    if not on:
        yield
        return
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if workspace is None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    except RuntimeError as e:
        if _NOT_DETERMINISTIC not in str(e):
            raise
        first = str(e).strip().splitlines()[0]
        raise NotDeterministic(f"--deterministic: {first[:300]}") from None
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
