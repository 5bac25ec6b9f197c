"""The whole-model benchmark's timing of one entry (:mod:`.bench_model` runs it): its eager steps
(:func:`time_eager`, forward and backward split by CUDA events, the wall clock on a CPU), its CUDA-graph replays
(:func:`time_graphs`), the SEBP entry's patch (:func:`sebp_patched`) and one backward's GPU kernels by kind
(:func:`backward_breakdown`)."""
from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable

import torch

from .bench_cases import ModelCase
from ..families import FAMILIES


def _one_step(model, loss_fn: Callable[[], torch.Tensor], cuda: bool) -> tuple[float, float, torch.Tensor]:
    """Forward and backward milliseconds of one step, and its loss (detached, not read: no sync)."""
    model.zero_grad(set_to_none=True)
    if cuda:
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        e0.record()
        loss = loss_fn()
        e1.record()
        loss.backward()
        e2.record()
        e2.synchronize()
        return e0.elapsed_time(e1), e1.elapsed_time(e2), loss.detach()
    t0 = time.perf_counter()
    loss = loss_fn()
    t1 = time.perf_counter()
    loss.backward()
    return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3, loss.detach()


def time_eager(model, loss_fn: Callable[[], torch.Tensor], repeats: int, warmup: int, cuda: bool) -> dict:
    """Median step, forward and backward milliseconds of ``repeats`` steps after ``warmup``, the peak GiB (CUDA
    only: the parameters plus the steps' peak above what was allocated before them) and the last step's loss."""
    from sebp_kernels import label_checks

    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    with label_checks.deferred() as checks:  # the labelled-rows head's checks, read between steps (no sync inside)
        for _ in range(warmup):
            _one_step(model, loss_fn, cuda)
            checks.check()
        t = []
        for _ in range(repeats):
            t.append(_one_step(model, loss_fn, cuda))
            checks.check()
    model.zero_grad(set_to_none=True)
    out = {"step_ms": statistics.median(f + b for f, b, _ in t), "forward_ms": statistics.median(f for f, _, _ in t),
           "backward_ms": statistics.median(b for _, b, _ in t), "peak_gib": None, "loss": float(t[-1][2])}
    if cuda:
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        out["peak_gib"] = (torch.cuda.max_memory_allocated() - base + params) / 2**30
    return out


def time_graphs(model, batch: dict, repeats: int, warmup: int, no_cache: bool = False) -> dict:
    """The same as CUDA-graph replays of ``model(**batch).loss`` and its backward (no peak). ``no_cache``: a
    causal LM is called with ``use_cache=False`` (compiled layers: a KV cache's guards would compile each layer
    apart)."""
    from ..model.losses import no_cache as without_cache
    from ..train.graphs import replay_ms

    try:
        f, b = replay_ms(model, batch, repeats, skip=warmup, call_kwargs=without_cache(model) if no_cache else None)
    finally:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return {"step_ms": f + b, "forward_ms": f, "backward_ms": b, "peak_gib": None, "loss": None}


@contextlib.contextmanager
def sebp_patched(model, case: ModelCase, head: str, mode: str, norms: bool, acts: bool, keep_dx: bool,
                 pad_rows: bool = True):
    """``model`` with the SEBP entry's layers (see the module docstring) within the block; yields their counts.
    The labelled head computes its LM head itself (a plain nn.Linear is what it reads), so that one stays."""
    from sebp_kernels import SEBPConfig, zero_rows

    from ..model.patch import pad_rows_summary, patch_sebp, unpatch_model

    # decoders: every projection, and under the full head the LM head (its rows at label -100 get no gradient)
    targets = None if case.task == "classification" else \
        FAMILIES[case.arch].targets + (("lm_head",) if head == "full" else ())
    names = patch_sebp(model, SEBPConfig(mode), target_modules=targets, norms=norms, acts=acts, pad_rows=pad_rows)
    counts = {kind: len(names[kind]) for kind in ("linears", "norms", "acts")}
    zero_rows.enable(keep_dx)
    try:
        yield counts
    finally:  # the graphs of the entry are gone: their buffers too, before the next entry's peak memory
        checked = pad_rows_summary(model) if pad_rows else None
        if checked:  # whether the padding rows passed their check, and how often they were taken
            counts["pad_rows"] = checked
        zero_rows.enable(False)
        zero_rows.forget_captured()
        unpatch_model(model)


# Kernel kinds of the backward breakdown, by substrings of the kernel's name (first match wins).
_KERNEL_KINDS = (
    ("sebp act", ("_act_fwd_kernel", "_act_bwd_kernel")),
    ("sebp", ("_grads_kernel", "_row_flags_kernel", "_compact_kernel", "_dx_kernel", "_dw_kernel", "_db_kernel")),
    ("attention", ("fmha", "flash", "sdpa", "attention", "attn")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "matmul", "splitk")),
    ("reduction", ("reduce_kernel",)),
    ("norm", ("norm", "gammabeta")),
    ("embedding", ("embedding", "indexing_backward", "radix_sort", "segment")),
)


def kernel_kind(name: str) -> str:
    """The kind of a CUDA kernel of the backward, from its name (``elementwise/other`` when none fits)."""
    low = name.lower()
    for kind, needles in _KERNEL_KINDS:
        if any(n in low for n in needles):
            return kind
    return "elementwise/other"


def backward_breakdown(model, loss_fn: Callable[[], torch.Tensor], top: int = 0) -> dict:
    """GPU kernel milliseconds of one backward of ``loss_fn()`` (torch.profiler), in total and by kernel kind;
    with ``top``, also the ``top`` kernels that took longest (name, calls, ms)."""
    from torch.profiler import ProfilerActivity, profile

    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        loss.backward()
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    rows = sorted(((e.key, e.count, e.device_time_total / 1e3) for e in prof.key_averages()
                   if e.device_time_total > 0), key=lambda r: -r[2])
    kinds: dict[str, float] = {}
    for name, _, ms in rows:
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + ms
    out = {"total_ms": round(sum(kinds.values()), 3),
           "by_kind_ms": {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}}
    if top:
        out["top"] = [{"kernel": n[:100], "calls": c, "ms": round(ms, 3)} for n, c, ms in rows[:top]]
    return out


def replay_or_fail(key: tuple, repeats: int, warmup: int, fail: Callable) -> Callable:
    """The ``compiled_graphs`` timer of an entry: :func:`time_graphs` of a batch, or, once anything in it fails
    (the capture, its memory, its eager warm-up steps: the compiled timing is measured by then and stays),
    ``fail(key, error, model)`` and None from then on."""
    failed = []

    def replay(model, batch):
        if failed:
            return None
        try:
            return time_graphs(model, batch, repeats, warmup, no_cache=True)
        except Exception as e:  # noqa: BLE001 - whatever stops it, this timing is out and the compiled one stays
            failed.append(e)
            fail(key, e, model)
            return None

    return replay
