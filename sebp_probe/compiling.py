"""``--compile``: ``torch.compile`` of the training model in place, or, where it cannot run, one line saying why
and the run goes on eagerly.

Two things can stop it: Inductor cannot compile anything here (no C compiler for CPU code, a Python or torch
that Dynamo does not support, no Triton for a GPU), found by compiling and running a tiny function first; or
the model's forward does not trace (an op without a shape-only implementation, say), found at its first call,
which then runs eagerly, as every later one does.
"""
from __future__ import annotations

import torch

from .notes import note

_PROBED: dict[str, str | None] = {}  # device type -> why Inductor cannot run there (None: it can)


def _probe_fn(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x) * 2 + 1


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    text = lines[0].strip() if lines else ""
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def inductor_problem(device: torch.device) -> str | None:
    """Why Inductor cannot compile code for ``device`` here, or None: a tiny function compiled and run once per
    device type and process (a few seconds on a CPU the first time)."""
    if device.type in _PROBED:
        return _PROBED[device.type]
    why = None
    try:
        torch._dynamo.eval_frame.check_if_dynamo_supported()
        x = torch.linspace(-1, 1, 8, device=device)
        got = torch.compile(_probe_fn, backend="inductor", fullgraph=True)(x)
        if not torch.allclose(got, _probe_fn(x)):
            why = "a compiled test function computed wrong values"
    except Exception as e:  # whatever stops it, the run can still train eagerly
        why = _first_line(e)
    _PROBED[device.type] = why
    return why


def compile_or_eager(model: torch.nn.Module, mode: str, device: torch.device) -> bool:
    """``model.compile(mode=mode)`` (in place: the module, its parameter names and checkpoints stay as they
    are), or one note (:func:`.notes.note`) and eager training where Inductor cannot run on ``device`` (returns
    False). A forward that fails to compile at a call (a Dynamo error) notes one line and runs eagerly, then and
    after."""
    why = inductor_problem(device)
    if why is not None:
        note(f"--compile {mode}: torch.compile cannot run here ({why}); training eagerly")
        return False
    model.compile(mode=mode)
    compiled = model._compiled_call_impl  # what nn.Module.__call__ runs while it is set

    def call(*args, **kwargs):
        try:
            return compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as e:
            # the call runs again from the start, eagerly; a forward that fails eagerly too raises its own error
            model._compiled_call_impl = None
            note(f"--compile {mode}: the model's forward did not compile ({_first_line(e)}); training eagerly")
            return model(*args, **kwargs)

    model._compiled_call_impl = call
    return True
