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
  activations too (the row's ``sebp_layers`` counts them); the peers (:mod:`.bench_peers`): ``liger``, a
  second copy of the model patched by Liger-Kernel, and ``cce``, the backbone and Cut-Cross-Entropy on the
  labelled rows (causal LMs);
- head ``full``: the model's own loss (logits of every position); ``labelled``: the last layer and the head on
  the rows the loss reads only (:func:`~sebp_probe.model.losses.labelled_loss`);
- timing ``eager``; with ``graphs`` also ``graphs``: forward and backward replayed as CUDA graphs, where a
  batch has a fixed shape and the step no host sync; with ``compile`` (a ``torch.compile`` mode) also
  ``compiled``: the step's loss function compiled once per entry with dynamic shapes, its compile seconds,
  recompiles and graph breaks on the row (:mod:`.bench_compile`); with both, ``compiled_graphs`` where graphs
  apply: each layer compiled (``layers`` scope) and the step replayed as CUDA graphs, after the compiled timing.

Entries that cannot run are listed in ``skipped`` with the reason; each row's ``loss_gap`` compares its loss with
dense's under the full head on the same batches (all entries compute the same loss: a check of the run). Derived
per timing and over ``all`` timings (``summary``, :func:`~sebp_probe.bench.bench_cases.summarize`): the fastest
``dense`` entry, the fastest non-SEBP entry (dense, CCE or Liger: the bar SEBP must clear), the fastest entry,
and what ``--padding auto`` would pick (dense or SEBP); per layout, head and timing (``limits``): SEBP's speedup
over dense on that layout, the layout's limit (:mod:`.bench_cases`) and SEBP's share of the limit's speedup
(limit_ms / sebp_ms, 1 = all of it).
"""
from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable
from dataclasses import asdict

import torch

from .bench_cases import ModelCase, backward_flops, geometry, layout_batches, layout_limits, \
    layout_padding, make_items, sample_lengths, summarize
from . import bench_sampled
from .bench_compile import compile_reason, compiled_steps
from .bench_peers import cce_loss, cce_reason, liger_patch, liger_reason
from .bench_steps import replay_or_fail, backward_breakdown, sebp_patched, time_eager, time_graphs
from .probe_overhead import probe_overhead
from ..config import GRAPHED_COMPILE_MODES
from ..data.batching import COMPILE_MULTIPLE
from ..layouts import LAYOUTS
from ..model.losses import FULL, labelled_loss

VARIANTS = (("dense", "full"), ("dense", "labelled"), ("sebp", "full"), ("sebp", "labelled"), ("liger", "full"),
            ("cce", "labelled")) + bench_sampled.VARIANTS  # sampled: opt-in, not among METHODS
METHODS = ("dense", "sebp", "liger", "cce")
# what --padding auto chooses among on a GPU: dense and SEBP, and the CCE head (sebp_probe.model.losses.auto_heads)
AUTO_METHODS_GPU = ("dense", "sebp", "cce")
WARMUP = 2


def failure_reason(e: Exception, width: int = 160) -> str:
    """One line for an entry that failed: the exception's type and message and, for a compile error whose
    message ends in Dynamo's ``from user code:`` trace, the innermost frame of that trace (where it failed; its
    outermost frame, which alone fitted before, is the model's forward)."""
    text = str(e)
    message, _, trace = text.partition("from user code:")
    where = ""
    frames = [line.strip() for line in trace.splitlines() if line.strip()]
    files = [i for i, line in enumerate(frames) if line.startswith("File ")]
    if files:
        last = frames[files[-1]:files[-1] + 2]
        path, _, rest = last[0].partition(", line ")
        where = f" at {path.split('/')[-1].rstrip(chr(34))}:{rest}" + (f": {last[1]}" if len(last) > 1 else "")
    head = " ".join(message.split())[:width] or "(no message)"
    return f"{type(e).__name__}: {head}" + (" " + " ".join(where.split())[:width] if where else "")


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


def plan_entries(case: ModelCase, graphs: bool, device: torch.device, peers: dict[str, str | None],
                 compiled: bool = False, compile_why: str | None = None, layouts=LAYOUTS,
                 methods=METHODS, scope: str = "layers", mode: str | None = None) -> list[dict]:
    """Every entry of the case in ``layouts`` and ``methods``, with ``reason`` where it cannot run. ``peers``:
    method -> why it cannot run (liger, cce); ``compiled``: the compiled timing too (``compile_why``: why it
    cannot run here), and with ``graphs`` the compiled layers replayed as CUDA graphs where graphs apply
    (``compiled_graphs``, ``scope`` layers only, not for a compile ``mode`` that records CUDA graphs itself).
    Liger compiles with its graph breaks (its loss reads a count on the host)."""
    out = []
    for layout in (lay for lay in LAYOUTS if lay in layouts):
        for method, head in (v for v in VARIANTS if v[0] in methods or f"{v[0]}:{v[1]}" in methods):
            why = peers.get(method)
            if why is None and head == "labelled" and layout == "packed" and case.task == "classification":
                why = "the [CLS]-rows last layer takes padded batches only"
            out.append(dict(layout=layout, method=method, head=head, timing="eager", reason=why))
            if graphs:
                gwhy = why or ("CUDA graphs need a GPU" if device.type != "cuda" else
                               "packed rows change shape from batch to batch" if layout == "packed" else
                               "Liger's fused linear cross-entropy reads a count on the host (.item())"
                               if method == "liger" else
                               bench_sampled.GRAPHS_REASON if method == "sampled" else
                               "the labelled rows are found on the host (nonzero)" if head == "labelled" else None)
                out.append(dict(layout=layout, method=method, head=head, timing="graphs", reason=gwhy))
            if compiled:
                out.append(dict(layout=layout, method=method, head=head, timing="compiled",
                                reason=why or compile_why))
                if graphs:
                    out.append(dict(layout=layout, method=method, head=head, timing="compiled_graphs",
                                    reason=gwhy or compile_why or (
                                        "each layer compiled only (--compile-scope layers)" if scope != "layers"
                                        else f"--compile {mode} records CUDA graphs itself"
                                        if mode in GRAPHED_COMPILE_MODES else None)))
    return out


def _pool(case: ModelCase, cfg, n_batches: int, seed: int, backend: str, pad_mask: bool,
          compiled: bool = False) -> tuple[dict, dict]:
    """The pool's batches of each layout (CPU) and what the plan and the result say of them: lengths, batch
    shapes, padding share and the backward FLOPs of each batch per head (for the limits). ``compiled``: padded
    lengths a multiple of :data:`~sebp_probe.data.batching.COMPILE_MULTIPLE`, as ``finetune --compile`` pads."""
    multiple = COMPILE_MULTIPLE if compiled else 1
    lengths = sample_lengths(case.lengths, case.batch * n_batches, case.max_length, seed)
    items = make_items(case, lengths, cfg.vocab_size, seed)
    batches = layout_batches(case, items, seed, multiple)
    padding = layout_padding(lengths, case, seed, backend, multiple)
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


def _peers(case: ModelCase, dev: torch.device) -> dict[str, str | None]:
    return {"liger": liger_reason(case.arch, dev), "cce": cce_reason(case.task)}


def check_selection(layouts, methods) -> None:
    """ValueError unless ``layouts`` and ``methods`` are non-empty selections of known names (a method, or one
    of its heads as ``method:head``)."""
    variants = tuple(f"{m}:{h}" for m, h in VARIANTS)  # one head of a method: "sebp:labelled"
    methods_known = METHODS + bench_sampled.METHODS + variants
    for what, got, known in (("layout", layouts, LAYOUTS), ("method", methods, methods_known)):
        bad = [x for x in got if x not in known]
        if bad or not got:
            raise ValueError(f"unknown {what} {', '.join(map(repr, bad))}; choose from {', '.join(known)}" if bad
                             else f"no {what} selected; choose from {', '.join(known)}")


def plan(case: ModelCase, n_batches: int = 8, graphs: bool = False, pad_mask: bool = True,
         dtype: torch.dtype = torch.bfloat16, device: str | None = None, seed: int = 0, compile: str | None = None,
         layouts=LAYOUTS, methods=METHODS, compile_scope: str = "layers") -> dict:
    """What :func:`bench_model` would run, without a GPU or a model: the pool, each layout's batches, padding
    and inactive share of the backward FLOPs per head, and every entry (with why it would be skipped; whether
    Inductor runs here is found by the run, not the plan)."""
    check_pad_mask(case, pad_mask)
    check_selection(layouts, methods)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = model_config(case)
    _, info = _pool(case, cfg, n_batches, seed, packed_backend(cfg, dev, dtype), pad_mask, bool(compile))
    for lay in info["layouts"].values():
        del lay["flops"]
    entries = plan_entries(case, graphs, dev, _peers(case, dev), compile is not None, None, layouts, methods,
                           compile_scope, compile)
    return {"case": asdict(case), "device": dev.type, "compile": compile, **info, "entries": entries}


def _step_fn(method: str, head: str) -> Callable:
    """The entry's loss as a function of (model, batch): what eager steps call and the compiled timing compiles."""
    return cce_loss if method == "cce" else labelled_loss if head == "labelled" else FULL.loss


def bench_model(case: ModelCase, dtype: torch.dtype = torch.bfloat16, repeats: int = 5, n_batches: int = 8,
                mode: str = "exact", graphs: bool = False, progress: Callable[[str], None] | None = None,
                pad_mask: bool = True, breakdown: bool = False, norms: bool = False, acts: bool = False,
                keep_dx: bool = False, device: str = "cuda", warmup: int = WARMUP, seed: int = 0,
                pad_rows: bool = True, compile: str | None = None, compile_backend: str = "inductor",
                compile_scope: str = "layers", layouts=LAYOUTS, methods=METHODS, budget: float | str = "auto",
                sample_dx: bool = False, note: Callable[[str], None] | None = None,
                partial: Callable[[dict], None] | None = None, probe: bool = False) -> dict:
    """Every entry of ``case`` (see the module docstring) on a pool of ``n_batches`` batches. ``pad_mask=False``:
    decoders' padded layouts without the padding mask (right padding: same loss and gradients, the causal
    kernel). ``breakdown``: one backward of each eager entry on its layout's first batch, GPU kernel time by
    kind. ``keep_dx``: the SEBP entries take dX from :mod:`sebp_kernels.zero_rows` (its buffers count in their
    peak; the pool is emptied after each). ``device``: ``cpu`` runs everything but the CUDA-only entries
    (a check of the run, not a timing). ``compile``: a ``torch.compile`` mode, for the compiled timing too
    (``compile_backend``: ``aot_eager`` runs Dynamo and AOTAutograd without Inductor, a quick check;
    ``compile_scope``: each of the ``layers`` or the whole ``step``, :func:`~.bench_compile.compiled_steps`).
    ``layouts``, ``methods``: the entries to run (the pool and its layouts' statistics are the same).
    ``progress``: what runs now; ``note``: lines to keep (each compiled entry's compile seconds); ``partial``:
    given the result so far (``complete`` False) after each layout's eager entries and each compiled entry, so
    that a run cut short (a time limit, an error) keeps what it measured. ``probe``: each dense and SEBP entry
    also probed as ``finetune --probe-every`` probes a step, against the unprobed step (:mod:`.probe_overhead`)."""
    from ..train.graphs import CaptureError
    from ..model.packing import attention_backend
    from ..data.train_data import to_device

    check_pad_mask(case, pad_mask)
    check_selection(layouts, methods)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    model = build_model(case, dtype, dev)
    backend = attention_backend(model)
    batches, info = _pool(case, model.config, n_batches, seed, backend, pad_mask, bool(compile))
    peers = _peers(case, dev)
    why_compile = compile_reason(dev, compile_backend) if compile is not None else None
    entries = plan_entries(case, graphs, dev, peers, compile is not None, why_compile, layouts, methods,
                           compile_scope, compile)
    runs = {(e["layout"], e["method"], e["head"], e["timing"]): [] for e in entries if e["reason"] is None}
    liger = liger_patch(build_model(case, dtype, dev), case.arch) if any(k[1] == "liger" for k in runs) else None
    failed: dict[tuple, str] = {}
    kernels: dict[str, dict] = {}
    counts: dict[str, dict] = {}
    extra: dict[tuple, dict] = {}  # per compiled entry: compile seconds, recompiles, graph breaks

    @contextlib.contextmanager
    def entry(method: str, head: str):
        """The model of an entry's steps, as the entry runs it (SEBP patched, Liger's globals set) within the
        block; an SEBP entry's layer counts go to ``counts``."""
        if method == "liger":
            with liger[1]():
                yield liger[0]
        elif method == "sebp":
            with sebp_patched(model, case, head, mode, norms, acts, keep_dx, pad_rows) as patched:
                counts[head] = patched
                yield model
        elif method == "sampled":  # ``budget``: its budget (bench_sampled)
            with bench_sampled.sampled_patched(model, case, head, counts, budget, seed, pad_rows,
                                               sample_dx) as m:
                yield m
        else:
            yield model

    def out_of_run(key: tuple, e: Exception, m) -> None:  # the entry is out, the others go on
        failed[key] = failure_reason(e)
        m.zero_grad(set_to_none=True)  # the failed step's tensors are gone now: give their memory back
        if cuda:
            torch.cuda.empty_cache()

    def assemble(complete: bool) -> dict:
        """The result of the entries measured so far."""
        auto_methods = AUTO_METHODS_GPU if cuda else ("dense", "sebp")  # CCE's CPU path is a check, not timed
        ref = {lay: runs.get((lay, "dense", "full", "eager")) or runs.get((lay, "dense", "full", "compiled"))
               for lay in LAYOUTS}
        rows = [_row(key, rs, info["layouts"][key[0]]["padding_share"], ref[key[0]], extra.get(key, {}),
                     counts.get(key[2]) if key[1] == "sebp" else None)
                for key, rs in runs.items() if rs and key not in failed]
        skipped = [{k: e[k] for k in ("layout", "method", "head", "timing", "reason")} for e in entries if e["reason"]]
        skipped += [dict(zip(("layout", "method", "head", "timing"), k), reason=r) for k, r in failed.items()]
        limits = layout_limits({k: v for k, v in runs.items() if v}, failed, info)
        shown = {**info, "layouts": {lay: {k: v for k, v in d.items() if k != "flops"}
                                     for lay, d in info["layouts"].items()}}
        return {"case": asdict(case), "device": str(dev), "dtype": str(dtype).replace("torch.", ""), "mode": mode,
                "pad_mask": pad_mask, "norms": norms, "acts": acts, "keep_dx": keep_dx, "pad_rows": pad_rows,
                "graphs": graphs, "compile": compile, **({"compile_scope": compile_scope} if compile else {}),
                "layouts_run": list(layouts), "methods_run": list(methods),
                "repeats": repeats, "warmup": warmup, **shown, "sebp_layers": counts, "rows": rows,
                "skipped": skipped, "limits": limits, "summary": summarize(rows, auto_methods), "complete": complete}

    n_compiled = sum(k[3] == "compiled" for k in runs)
    timer = lambda m, fn: time_eager(m, fn, repeats, warmup, cuda)  # noqa: E731
    for layout in LAYOUTS:
        on_device = []
        for bi, cpu_batch in enumerate(batches[layout]):
            batch = to_device(cpu_batch, dev)
            if not pad_mask and layout != "packed":
                del batch["attention_mask"]
            on_device.append(batch)
            for method, head in VARIANTS:
                keys = [k for k in ((layout, method, head, t) for t in ("eager", "graphs"))
                        if k in runs and k not in failed]
                if not keys:
                    continue
                if progress:
                    progress(f"{case.name}: {layout}, {method}, {head} head, batch {bi + 1}/{len(batches[layout])}")
                with entry(method, head) as m:
                    step = _step_fn(method, head)
                    loss_fn = lambda m=m, step=step: step(m, batch)  # noqa: E731
                    for key in keys:
                        try:
                            runs[key].append(timer(m, loss_fn) if key[3] == "eager"
                                             else time_graphs(m, batch, repeats, warmup))
                        except (torch.OutOfMemoryError, CaptureError) as e:
                            out_of_run(key, e, m)
                    if breakdown and cuda and bi == 0 and keys[0] not in failed:
                        kernels[f"{layout} {method} {head}"] = backward_breakdown(m, loss_fn)
        if partial and any(k[0] == layout for k in runs):
            partial(assemble(False))
        for method, head in VARIANTS:  # compiled: entry by entry, each compiled once for the layout's batches
            key = (layout, method, head, "compiled")
            if key not in runs:
                continue
            done = sum(k[3] == "compiled" for k in (*extra, *failed))
            if progress:
                progress(f"{case.name}: compiling {layout}, {method}, {head} head ({done + 1}/{n_compiled})")
            gkey = (layout, method, head, "compiled_graphs")
            replay = replay_or_fail(gkey, repeats, warmup, out_of_run) if gkey in runs else None
            with entry(method, head) as m:
                try:
                    runs[key], extra[key] = compiled_steps(m, _step_fn(method, head), on_device, timer, compile,
                                                           compile_backend, compile_scope, graphs=replay)
                except Exception as e:  # noqa: BLE001 - whatever stops a compile (Dynamo, Inductor, OOM), the
                    out_of_run(key, e, m)  # entry is out and the others go on
                    if replay is not None:
                        out_of_run(gkey, e, m)
                if key in extra and replay is not None:
                    got, recompiles = extra[key].pop("graph_runs"), extra[key].pop("graph_recompiles")
                    if gkey not in failed:
                        runs[gkey] = got
                        extra[gkey] = {"recompiles": recompiles, "compile_scope": compile_scope}
            if note:
                x = extra.get(key)
                note(f"{case.name}: {layout}, {method}, {head} head, compiled ({done + 1}/{n_compiled}): " +
                     (f"{x['compile_s']:.1f} s to compile, {x['recompiles']} recompiles, "
                      f"{statistics.fmean(r['step_ms'] for r in runs[key]):.2f} ms a step" if x else failed[key]))
            if partial:
                partial(assemble(False))
    probed = probe_overhead(entry, _step_fn, batches, [k for k, v in runs.items() if v and k not in failed],
                            case.task, dev, repeats, warmup, pad_mask, compile, compile_backend, compile_scope,
                            progress) if probe else None
    if compile is not None:  # the last entry's graphs hold its model
        torch._dynamo.reset()
    model = liger = None  # the models are gone before the next case
    if cuda:
        torch.cuda.empty_cache()
    result = assemble(True) | ({"probe": probed} if probe else {})
    if breakdown:
        result["backward_kernels"] = kernels if cuda else {"skipped": "the kernel breakdown needs a CUDA GPU"}
    return result


def _row(key: tuple, rs: list[dict], padding: float, ref: list[dict] | None, extra: dict,
         sebp_layers: dict | None) -> dict:
    """One entry's result; ``loss_gap``: the largest relative difference of its loss from dense's with the full
    head on the same batches (eager, else compiled; every entry computes the same loss: a check of the run, bf16
    rounding aside); ``extra``: the compiled timing's compile seconds, recompiles and graph breaks;
    ``sebp_layers``: the SEBP kinds patched (linears, norms, acts)."""
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
            "per_batch_ms": [round(r["step_ms"], 3) for r in rs], **extra,
            **({"sebp_layers": {k: sebp_layers[k] for k in ("linears", "norms", "acts")}} if sebp_layers else {})}
