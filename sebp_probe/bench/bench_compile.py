"""The whole-model benchmark's compiled timing (:mod:`.bench_model` runs it).

Timing ``compiled``: an entry's model (each of its layers, the scope below) or its step function (its loss,
:func:`~sebp_probe.model.losses.labelled_loss`, the model's own or :func:`cce_loss`) goes through
``torch.compile(..., dynamic=True)`` once per entry, after
``torch._dynamo.reset()``, so each entry compiles its own graphs and its ``compile_s`` is its own (Inductor's
on-disk cache stays: an entry whose graph an earlier entry compiled, the same model on another padded layout,
say, finds it there, as a second run of a user's job would), with the options ``finetune --compile`` gives its
layers: ``mode``'s, less one Inductor fusion whose size guards recompiled a layer as batches crossed them
(:func:`~sebp_probe.train.compiling.dynamic_options`); a compiled bench pads its batches to a multiple of
:data:`~sebp_probe.data.batching.COMPILE_MULTIPLE`, as ``finetune --compile`` does (Inductor guards on that
alignment). ``dynamic=True`` makes the batch and
sequence sizes symbols from the first call on, so a layout's later batches (padded to another length, or packed into
another token count) reuse the graphs (but for Dynamo's 0/1 specialization: a size that is 1 in the first batch
and more in a later one recompiles once, as the rows of packed batches run under a mask can; varlen-packed
batches are always one row): ``recompiles`` counts the graphs Dynamo compiled after the entry's
first step (0 is the aim), ``graph_breaks`` the breaks while tracing (breaks are allowed: a step that breaks
runs the pieces between them compiled). ``compile_s``: the wall seconds of the first step, forward and
backward (AOTAutograd compiles the backward at the first backward), which the timed steps leave out. The timed
steps then run as eager ones do (:func:`~sebp_probe.bench.bench_steps.time_eager`): ``forward_ms`` is the call of
the compiled function (its guards and compiled forward graphs, the eager pieces between breaks),
``backward_ms`` the compiled backward that AOTAutograd made with it.

Scope: by default (``layers``) each layer of the model's stack compiles in place and the embeddings, the head
and the loss stay eager: the layers share their code (and SEBP layers carry their registry keys as tensor
inputs of the graph, :func:`sebp_kernels.registry.keys_as_inputs`), so Dynamo and Inductor compile one layer's graphs and every layer runs them (PyTorch's
"regional compilation"). On an H100 that took 19-27 s for a 1B decoder where the whole step took minutes
(results/model_compiled.json). ``step`` compiles the whole step function instead, so Inductor sees the
model, its head and the loss as one program (the model's own head's logits and cross-entropy fused too).

SEBP under compile: the entry patches what ``--norms`` and ``--acts`` ask for, by default the linears only.
Each SEBP layer is an opaque custom op (``sebp::``) in the graph, and Inductor cannot fuse across one: SEBP
norms and activations would keep it from fusing each norm, activation and residual add with its neighbours,
which is most of what compiling buys a dense model; the linears are matmuls, which it does not fuse anyway.
The row says which kinds it patched (``sebp_layers``).
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..train.compiling import compile_layers, distinct_sizes, dynamic_options, dynamo_counts, inductor_problem


def compile_reason(device: torch.device, backend: str) -> str | None:
    """Why the compiled entries cannot run on ``device`` (None: they can): Inductor's probe
    (:func:`~sebp_probe.train.compiling.inductor_problem`); other backends are not probed."""
    why = inductor_problem(device) if backend == "inductor" else None
    return None if why is None else f"torch.compile cannot run here ({why})"


SCOPES = ("layers", "step")


def compiled_step(model: torch.nn.Module, step: Callable, batches: list[dict], mode: str | None, backend: str,
                  scope: str = "layers") -> tuple[Callable, Callable[[], None] | None]:
    """``step(model, batch) -> loss`` ready to compile at its first call, after ``torch._dynamo.reset()``, and
    what undoes it (None: nothing to undo): under ``layers`` the step itself with each layer of the model's stack
    compiled in place (told the most rows a batch of ``batches`` has), under ``step`` the step compiled."""
    if scope not in SCOPES:
        raise ValueError(f"compile scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    torch._dynamo.reset()
    kw = dict(dynamic=True, backend=backend, **({"options": dynamic_options(mode)} if backend == "inductor" else {}))
    if scope == "layers":
        bound = max(b["input_ids"].numel() for b in batches)  # the most rows a batch of the pool has
        return step, compile_layers(model, row_bound=bound, **kw)
    return distinct_sizes(torch.compile(step, **kw)), None


def compiled_steps(model: torch.nn.Module, step: Callable, batches: list[dict], timer: Callable,
                   mode: str | None, backend: str, scope: str = "layers",
                   graphs: Callable | None = None) -> tuple[list[dict], dict]:
    """The compiled entry of ``step(model, batch) -> loss`` on ``batches`` (see the module docstring): the
    per-batch times of ``timer(model, loss_fn)`` (as eager entries are timed) and ``{compile_s, recompiles,
    graph_breaks, compiled_graphs, compile_scope}`` (``compiled_graphs``: those the first step compiled, one
    per piece between breaks). ``scope``: ``layers`` compiles each layer of the model's stack
    (:func:`compile_layers`, told the pool's most rows a batch), the embeddings, head and loss left eager,
    ``step`` the whole step function; the model is as it was after the call. ``graphs``:
    ``graphs(model, batch) -> timing``, called on each batch after the compiled steps while the layers are still
    compiled (timing ``compiled_graphs``: the compiled layers
    replayed as CUDA graphs, ``layers`` scope only); its timings and the graphs Dynamo compiled meanwhile
    come in the stats as ``graph_runs`` and ``graph_recompiles``."""
    compiled, undo = compiled_step(model, step, batches, mode, backend, scope)
    try:
        graphs0, breaks0 = dynamo_counts()
        cuda = next(model.parameters()).is_cuda
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        compiled(model, batches[0]).backward()
        if cuda:
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        graphs1 = dynamo_counts()[0]
        runs = [timer(model, lambda b=b: compiled(model, b)) for b in batches]
        graphs2, breaks2 = dynamo_counts()
        graph_runs = [graphs(model, b) for b in batches] if graphs is not None and scope == "layers" else None
        graphs3 = dynamo_counts()[0]
    finally:
        if undo is not None:
            undo()
    stats = {"compile_s": round(compile_s, 2), "recompiles": graphs2 - graphs1, "graph_breaks": breaks2 - breaks0,
             "compiled_graphs": graphs1 - graphs0, "compile_scope": scope}
    if graph_runs is not None:
        stats.update(graph_runs=graph_runs, graph_recompiles=graphs3 - graphs2)
    return runs, stats
