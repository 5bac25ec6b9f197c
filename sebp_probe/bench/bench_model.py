"""Benchmark of whole models: the step time of every batch layout, dense, with SEBP and with Liger-Kernel. No CLI
code here; the cases, the batches of each layout and the limit's FLOP count are in :mod:`.bench_cases`.

Step: the forward to the loss and its backward (gradients of every parameter) of one batch, the optimizer left
out (it costs every entry the same). Per batch, the median of ``repeats`` steps after ``warmup`` untimed ones;
per entry, the mean over its layout's batches, which all layouts form from the same pool of sequences (so the
means compare what the pool costs). Forward and backward are split by CUDA events (a CPU run, for checks only,
by the wall clock). Peak GiB: the model's parameters plus the step's peak above what was allocated before it.

Entries, one result row each, layout x method x head x timing:

- method ``dense``: the model as built (bf16 parameters, sdpa attention; packed batches by varlen flash
  attention on CUDA in bf16/fp16, else by a mask); ``sebp``: every attention and MLP projection (and, under the
  full head, a decoder's LM head) an exact ``SEBPLinear``, with ``norms`` and ``acts`` the norms and MLP
  activations too; ``liger``: a second copy of the model (same weights) patched by Liger-Kernel (its RMSNorm,
  SwiGLU, RoPE and fused linear cross-entropy over all rows), decoders on CUDA where ``liger_kernel`` imports;
- head ``full``: the model's own loss (logits of every position); ``labelled``: the last layer and the head on
  the rows the loss reads only (:func:`~sebp_probe.model.losses.batch_loss` with ``labelled_head``);
- timing ``eager``, and with ``graphs`` also ``graphs``: forward and backward replayed as CUDA graphs, where a
  batch has a fixed shape and the step no host sync.

Entries that cannot run are listed in ``skipped`` with the reason; each row's ``loss_gap`` compares its loss with
dense's under the full head on the same batches (all entries compute the same loss: a check of the run). Derived per timing (``summary``): the fastest
``dense`` entry, the fastest non-SEBP entry (dense or Liger: the bar SEBP must clear), the fastest entry, and what
``--padding auto`` would pick (dense or SEBP, full head); per layout and head (``limits``): SEBP's speedup over
dense on that layout, the layout's limit (:mod:`.bench_cases`) and SEBP's share of the limit's speedup
(limit_ms / sebp_ms, 1 = all of it).
"""
from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict

import torch

from .bench_cases import ModelCase, backward_flops, geometry, layout_batches, layout_limits, \
    layout_padding, make_items, sample_lengths, summarize
from ..families import FAMILIES, names
from ..layouts import LAYOUTS

VARIANTS = (("dense", "full"), ("dense", "labelled"), ("sebp", "full"), ("sebp", "labelled"), ("liger", "full"))
WARMUP = 2


def check_pad_mask(case: ModelCase, pad_mask: bool) -> None:
    """Leaving the padding mask out is exact only for causal decoders (right padding); say so otherwise."""
    if not pad_mask and case.arch == "bert":
        raise ValueError(f"{case.name} attends in both directions: its real tokens would attend to the pads "
                         "without the padding mask; leaving it out is for causal decoders only")


def model_config(case: ModelCase):
    """The case's transformers config (sdpa attention)."""
    import transformers  # lazy: only the whole-model benchmark needs it

    cfg = transformers.AutoConfig.for_model(case.arch, **case.config)
    cfg._attn_implementation = "sdpa"
    return cfg


def build_model(case: ModelCase, dtype: torch.dtype, device: torch.device):
    """The case's model with random weights (seed 0), in ``dtype``, on ``device``, in training mode."""
    import transformers

    torch.manual_seed(0)
    auto = (transformers.AutoModelForSequenceClassification if case.task == "classification"
            else transformers.AutoModelForCausalLM)
    with torch.device(device):
        model = auto.from_config(model_config(case), attn_implementation="sdpa", dtype=dtype)
    return model.train()


def packed_backend(cfg, device: torch.device, dtype: torch.dtype) -> str:
    """How packed rows are expected to run on ``device`` without building the model (the plan): what
    :func:`~sebp_probe.model.packing.attention_backend`, which the run asks, picks for the model of ``cfg`` in
    training (the same :func:`~sebp_probe.model.packing.varlen_blocker`; encoders and decoders alike)."""
    from ..model.packing import varlen_blocker

    return "mask" if varlen_blocker(cfg, device.type, dtype, training=True) else "varlen"


def liger_reason(case: ModelCase, device: torch.device) -> str | None:
    """Why the Liger entries cannot run (None: they can)."""
    if not getattr(FAMILIES.get(case.arch), "liger", False):
        known = " and ".join(FAMILIES[t].name for t in names(lambda f: f.liger))
        return f"Liger-Kernel has no patch for {case.arch} here (the benchmark runs its patches for {known})"
    if device.type != "cuda":
        return "Liger-Kernel's Triton kernels need a CUDA GPU"
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure is the reason
        return f"liger_kernel does not import ({type(e).__name__}: {' '.join(str(e).split())[:120]})"
    return None


def liger_copy(case: ModelCase, dtype: torch.dtype, device: torch.device):
    """A second copy of the model patched by Liger-Kernel, and a context manager to run its steps in.

    ``apply_liger_kernel_to_llama/_qwen2(model=...)`` patches the instance's norms, MLPs and forward (its fused
    linear cross-entropy), but also the globals of the transformers module (RoPE, norm and MLP classes), which
    every other model of that module would then use. Those globals are put back at once and set again only
    within the context, around the Liger model's forward."""
    import liger_kernel.transformers as lk

    model = build_model(case, dtype, device)
    apply = getattr(lk, f"apply_liger_kernel_to_{case.arch}")  # apply_liger_kernel_to_llama, ..._qwen2
    module = sys.modules[type(model.model.layers[0]).__module__]
    before = dict(vars(module))
    apply(model=model)  # defaults: rope, rms_norm, swiglu, fused_linear_cross_entropy
    patched = {k: v for k, v in vars(module).items() if before.get(k, module) is not v}
    for k in patched:
        if k in before:
            setattr(module, k, before[k])
        else:
            delattr(module, k)

    @contextlib.contextmanager
    def liger_globals():
        for k, v in patched.items():
            setattr(module, k, v)
        try:
            yield
        finally:
            for k in patched:
                if k in before:
                    setattr(module, k, before[k])
                else:
                    delattr(module, k)

    return model, liger_globals


def plan_entries(case: ModelCase, graphs: bool, device: torch.device, liger: str | None) -> list[dict]:
    """Every entry of the case, with ``reason`` where it cannot run."""
    out = []
    for layout in LAYOUTS:
        for method, head in VARIANTS:
            why = None
            if method == "liger":
                why = liger
            elif head == "labelled" and layout == "packed" and case.task == "classification":
                why = "the [CLS]-rows last layer takes padded batches only"
            out.append(dict(layout=layout, method=method, head=head, timing="eager", reason=why))
            if not graphs:
                continue
            gwhy = why or ("CUDA graphs need a GPU" if device.type != "cuda" else
                           "packed rows change shape from batch to batch" if layout == "packed" else
                           "Liger's fused linear cross-entropy reads a count on the host (.item())"
                           if method == "liger" else
                           "the labelled-rows head finds its rows on the host (nonzero)" if head == "labelled"
                           else None)
            out.append(dict(layout=layout, method=method, head=head, timing="graphs", reason=gwhy))
    return out


# --------------------------------------------------------------------------------------------------- timing


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
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        _one_step(model, loss_fn, cuda)
    t = [_one_step(model, loss_fn, cuda) for _ in range(repeats)]
    model.zero_grad(set_to_none=True)
    out = {"step_ms": statistics.median(f + b for f, b, _ in t), "forward_ms": statistics.median(f for f, _, _ in t),
           "backward_ms": statistics.median(b for _, b, _ in t), "peak_gib": None, "loss": float(t[-1][2])}
    if cuda:
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        out["peak_gib"] = (torch.cuda.max_memory_allocated() - base + params) / 2**30
    return out


def time_graphs(model, batch: dict, repeats: int, warmup: int) -> dict:
    """The same as CUDA-graph replays of ``model(**batch).loss`` and its backward (no peak)."""
    from ..train.graphs import replay_ms

    try:
        f, b = replay_ms(model, batch, repeats, skip=warmup)
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


# ---------------------------------------------------------------------------------------------- the benchmark


def _pool(case: ModelCase, cfg, n_batches: int, seed: int, backend: str, pad_mask: bool) -> tuple[dict, dict]:
    """The pool's batches of each layout (CPU) and what the plan and the result say of them: lengths, batch
    shapes, padding share and the backward FLOPs of each batch per head (for the limits)."""
    lengths = sample_lengths(case.lengths, case.batch * n_batches, case.max_length, seed)
    items = make_items(case, lengths, cfg.vocab_size, seed)
    batches = layout_batches(case, items, seed)
    padding = layout_padding(lengths, case, seed, backend)
    heads = ("full", "labelled")
    info = {"pool": {"seed": seed, "sequences": len(lengths), "batches": n_batches, "tokens": sum(lengths),
                     "lengths": lengths}, "packed_backend": backend, "layouts": {}}
    for layout in LAYOUTS:
        decoder = case.task == "causal-lm"
        causal = decoder and ((layout == "packed" and backend == "varlen") or (layout != "packed" and not pad_mask))
        geos = [geometry(b, case.task, backend if layout == "packed" else "") for b in batches[layout]]
        flops = {h: [backward_flops(cfg, g, h, causal) for g in geos] for h in heads}
        info["layouts"][layout] = {
            "batches": len(geos), "padding_share": padding[layout], "read_rows": sum(sum(g.read) for g in geos),
            "shapes": [list(b["input_ids"].shape) for b in batches[layout]],
            "inactive_share": {h: round(sum(f["inactive"] for f in fl) / sum(f["total"] for f in fl), 4)
                               for h, fl in flops.items()},
            "linear_inactive_share": {h: round(sum(f["inactive"] for f in fl) / sum(f["linear"] for f in fl), 4)
                                      for h, fl in flops.items()},
            "flops": flops}
    return batches, info


def plan(case: ModelCase, n_batches: int = 8, graphs: bool = False, pad_mask: bool = True,
         dtype: torch.dtype = torch.bfloat16, device: str | None = None, seed: int = 0) -> dict:
    """What :func:`bench_model` would run, without a GPU or a model: the pool, each layout's batches, padding
    and inactive share of the backward FLOPs per head, and every entry (with why it would be skipped)."""
    check_pad_mask(case, pad_mask)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = model_config(case)
    _, info = _pool(case, cfg, n_batches, seed, packed_backend(cfg, dev, dtype), pad_mask)
    for lay in info["layouts"].values():
        del lay["flops"]
    entries = plan_entries(case, graphs, dev, liger_reason(case, dev))
    return {"case": asdict(case), "device": dev.type, **info, "entries": entries}


def bench_model(case: ModelCase, dtype: torch.dtype = torch.bfloat16, repeats: int = 5, n_batches: int = 8,
                mode: str = "exact", graphs: bool = False, progress: Callable[[str], None] | None = None,
                pad_mask: bool = True, breakdown: bool = False, norms: bool = False, acts: bool = False,
                keep_dx: bool = False, device: str = "cuda", warmup: int = WARMUP, seed: int = 0,
                pad_rows: bool = True) -> dict:
    """Every entry of ``case`` (see the module docstring) on a pool of ``n_batches`` batches. ``pad_mask=False``:
    decoders' padded layouts without the padding mask (right padding: same loss and gradients, the causal
    kernel). ``breakdown``: one backward of each eager entry on its layout's first batch, GPU kernel time by
    kind. ``keep_dx``: the SEBP entries take dX from :mod:`sebp_kernels.zero_rows` (its buffers count in their
    peak; the pool is emptied after each). ``device``: ``cpu`` runs everything but the CUDA-only entries
    (a check of the run, not a timing)."""
    from ..train.graphs import CaptureError
    from ..model.losses import batch_loss
    from ..model.packing import attention_backend
    from ..data.train_data import to_device

    check_pad_mask(case, pad_mask)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    model = build_model(case, dtype, dev)
    backend = attention_backend(model)
    batches, info = _pool(case, model.config, n_batches, seed, backend, pad_mask)
    why_liger = liger_reason(case, dev)
    liger = None if why_liger else liger_copy(case, dtype, dev)
    entries = plan_entries(case, graphs, dev, why_liger)
    runs = {(e["layout"], e["method"], e["head"], e["timing"]): [] for e in entries if e["reason"] is None}
    failed: dict[tuple, str] = {}
    kernels: dict[str, dict] = {}
    counts: dict[str, dict] = {}
    for layout in LAYOUTS:
        for bi, cpu_batch in enumerate(batches[layout]):
            batch = to_device(cpu_batch, dev)
            if not pad_mask and layout != "packed":
                del batch["attention_mask"]
            for method, head in VARIANTS:
                keys = [k for k in ((layout, method, head, t) for t in ("eager", "graphs"))
                        if k in runs and k not in failed]
                if not keys:
                    continue
                if progress:
                    progress(f"{case.name}: {layout}, {method}, {head} head, batch {bi + 1}/{len(batches[layout])}")
                m = liger[0] if method == "liger" else model
                ctx = (liger[1]() if method == "liger" else contextlib.nullcontext() if method == "dense" else
                       sebp_patched(model, case, head, mode, norms, acts, keep_dx, pad_rows))
                with ctx as patched:
                    if method == "sebp":
                        counts[head] = patched

                    def loss_fn(m=m, labelled=head == "labelled"):
                        return batch_loss(m, batch, labelled_head=labelled)

                    for key in keys:
                        try:
                            runs[key].append(time_eager(m, loss_fn, repeats, warmup, cuda) if key[3] == "eager"
                                             else time_graphs(m, batch, repeats, warmup))
                        except (torch.OutOfMemoryError, CaptureError) as e:  # the entry is out, the others go on
                            failed[key] = f"{type(e).__name__}: " + " ".join(str(e).split())[:160]
                        if key in failed:  # the failed step's tensors are gone now: give their memory back
                            m.zero_grad(set_to_none=True)
                            torch.cuda.empty_cache()
                    if breakdown and cuda and bi == 0 and keys[0] not in failed:
                        kernels[f"{layout} {method} {head}"] = backward_breakdown(m, loss_fn)
    del model, liger
    if cuda:
        torch.cuda.empty_cache()
    rows = [_row(key, rs, info["layouts"][key[0]]["padding_share"], runs.get((key[0], "dense", "full", "eager")))
            for key, rs in runs.items() if rs and key not in failed]
    skipped = [{k: e[k] for k in ("layout", "method", "head", "timing", "reason")} for e in entries if e["reason"]]
    skipped += [dict(zip(("layout", "method", "head", "timing"), k), reason=r) for k, r in failed.items()]
    limits = layout_limits(runs, failed, info)
    for lay in info["layouts"].values():
        del lay["flops"]
    result = {"case": asdict(case), "device": str(dev), "dtype": str(dtype).replace("torch.", ""), "mode": mode,
              "pad_mask": pad_mask, "norms": norms, "acts": acts, "keep_dx": keep_dx, "pad_rows": pad_rows,
              "graphs": graphs,
              "repeats": repeats, "warmup": warmup, **info, "sebp_layers": counts, "rows": rows,
              "skipped": skipped, "limits": limits, "summary": summarize(rows)}
    if breakdown:
        result["backward_kernels"] = kernels if cuda else {"skipped": "the kernel breakdown needs a CUDA GPU"}
    return result


def _row(key: tuple, rs: list[dict], padding: float, ref: list[dict] | None) -> dict:
    """One entry's result; ``loss_gap``: the largest relative difference of its loss from dense's with the full
    head on the same batches (every entry computes the same loss: a check of the run, bf16 rounding aside)."""
    layout, method, head, timing = key
    peaks = [r["peak_gib"] for r in rs if r["peak_gib"] is not None]
    gaps = [abs(r["loss"] - d["loss"]) / max(abs(d["loss"]), 1e-12) for r, d in zip(rs, ref or [])
            if r["loss"] is not None]
    return {"layout": layout, "method": method, "head": head, "timing": timing,
            "ms": round(statistics.fmean(r["step_ms"] for r in rs), 3),
            "forward_ms": round(statistics.fmean(r["forward_ms"] for r in rs), 3),
            "backward_ms": round(statistics.fmean(r["backward_ms"] for r in rs), 3),
            "peak_gib": round(max(peaks), 3) if peaks else None, "padding_share": padding,
            "loss_gap": float(f"{max(gaps):.3g}") if gaps else None,
            "per_batch_ms": [round(r["step_ms"], 3) for r in rs]}
