"""``--padding auto``: choose the batch layout (and with it dense or SEBP, the head and, under ``--compile auto``,
whether to compile) from what is known before timing, and time only what that cannot settle, within a budget.

Padding is cheaper to remove before the forward (trim, bucket, pack) than to skip in the backward, so SEBP is
measured on top of each layout, never only against padded dense. The prior (:mod:`.layout_prior`): each
applicable layout's padding share, rows and token slots per batch over the whole epoch (the sequence lengths
give them exactly; ``packed`` only where :func:`~sebp_probe.model.packing.check_packable` allows it and the
batch shapes may change); a layout with far more token slots than the fewest is not timed. The budget: the
first pass (dense, on the prior's favourite) times the run's planned micro-batches estimates the run;
timing takes at most ``calib_budget`` of that (:func:`~.layout_prior.plan_timing`: fewer batches and rounds,
then fewer candidates, in the prior's order); a run too short to time even one pass of each takes the prior's
pick untimed. The candidates (layout, head, method) are timed in interleaved rounds on a few batches from
inside the first epoch (:func:`_time_eager`: one warm-up round, then the timed ones), so that a load that comes
and goes on the host falls on every candidate alike; a candidate's time is its measured time per token slot
(the batch's padded size) times the epoch's mean slots, its median over the rounds and their spread. The SEBP
entry patches the candidate layers whose share of active rows on those batches is at most ``dense_fallback``,
as a run's calibration would. Where the run's head is the labelled-rows path (:mod:`sebp_probe.model.losses`),
every layout is also timed with the model's own (full) head. :func:`pick` takes the fastest unless one the
prior prefers (less padding, the run's head, dense, eager) is within the spread of it.

Under ``--compile`` each layout the prior keeps (and, with eager candidates, the budget affords) is also timed
compiled (:func:`_compiled_ms`; ``--compile MODE``: compiled only, the run compiles anyway; ``--compile auto``:
eager and compiled): dense and SEBP each compiled as the run would (``--compile-scope``: each layer in place,
or a fresh ``torch.compile(head.loss)``) with Dynamo's caches reset first, so no candidate finds another's
graphs; with ``--cuda-graphs`` too, the compiled step is timed as the run will take it, replayed as CUDA graphs.
On each batch the first call (a compile or a recompile, and one step) is timed apart; its time past the batch's
median is that candidate's compile seconds. A layout's compiled candidates are timed only where their estimated
compile (:data:`~.calibration_budget.COMPILE_PRIOR_S` until this model's is measured) and passes fit what is left
of the budget (under ``--compile MODE`` a first eager pass estimates the run); the rest are named. The choice
weighs the whole run's estimated seconds (:func:`whole_run_s`): steady ms per micro-batch x the run's planned
micro-batches (optimizer steps x
``grad_accum``), plus the compile seconds once per compiled candidate. The RNG is forked and the gradients are
dropped: training is untouched.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch

from sebp_kernels import SEBPConfig

from ..data.batching import PackingError, layout_counts, lengths
from .calibration import apply_sebp, measure_density, rng_devices, sync
from .calibration_budget import COMPILE_PRIOR_S, compiled_cost_ms, micro_batches
from .compiling import (Fallback, cannot_compile, compile_fn, compile_stack, compiles_whole, inductor_problem,
                        layer_compile_options)
from ..config import COMPILE_AUTO, FinetuneConfig
from .graphs import replay_ms
from ..layouts import LAYOUTS
from ..model.losses import FULL, Head, compiled_head_problem, head_for, no_cache, ready_to_compile
from ..model.packing import check_packable
from ..data.train_data import TrainData, make_loaders, most_rows, pad_multiple, to_device
from .layout_timing import EagerTiming, Passes, time_eager
from .layout_prior import Timer, describe as _name, noise_aware, prior_skips, wall_timer

SAMPLE_BATCHES = 3


@dataclass
class PaddingChoice:
    """What ``auto`` measured (``table``: one row per layout and head) and chose: ``padding``, ``method``,
    ``head`` and whether to compile (``compiled``); ``best``: the cheapest layout of each method measured,
    ``best_head``: the head it was timed with (None: the run's own, when only one head was timed),
    ``best_compiled``: whether it was the compiled candidate; ``micro_batches``: the run's planned
    micro-batches the whole-run costs (``*_run_s`` in the table) count."""

    padding: str
    method: str
    best: dict[str, str]
    table: list[dict] = field(default_factory=list)
    head: str | None = None
    best_head: dict[str, str | None] = field(default_factory=dict)
    compiled: bool = False
    best_compiled: dict[str, bool] = field(default_factory=dict)
    micro_batches: int | None = None
    replays: bool = False  # the times are CUDA-graph replays of the step (--cuda-graphs), as the run steps
    processes: int = 1  # the run's processes; past one, the times are of the main process alone, unwrapped
    untimed: str | None = None  # why the prior's pick was taken without timing (a run too short to time)
    run_estimate_s: float | None = None  # the run's seconds as the first pass x its micro-batches estimate them
    budget_s: float | None = None  # the timing's budget: calib_budget of that estimate
    spent_s: float | None = None  # what the timing took (its passes' milliseconds)
    per_slot_ms: float | None = None  # the first pass's ms per token slot: the run's calibration's estimate

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "PaddingChoice":
        return cls(d["padding"], d["method"], dict(d["best"]), list(d.get("table", [])), d.get("head"),
                   dict(d.get("best_head") or {}), bool(d.get("compiled", False)), dict(d.get("best_compiled") or {}),
                   d.get("micro_batches"), bool(d.get("replays", False)), int(d.get("processes", 1)),
                   d.get("untimed"), d.get("run_estimate_s"), d.get("budget_s"), d.get("spent_s"),
                   d.get("per_slot_ms"))


def whole_run_s(steady_ms: float, micro_batches: int, compile_s: float = 0.0) -> float:
    """A candidate's estimated seconds for the whole run: ``steady_ms`` per micro-batch times the run's
    ``micro_batches`` (planned optimizer steps x grad_accum), plus its ``compile_s`` once."""
    return steady_ms * micro_batches / 1e3 + compile_s


def candidate(method: str, compiled: bool) -> str:
    """A candidate's name in the table's keys (``{name}_ms``, ``{name}_compile_s``, ``{name}_run_s``)."""
    return f"{method}_compiled" if compiled else method


def _spread_batches(cfg: FinetuneConfig, data: TrainData, device: torch.device, n: int) -> list[dict]:
    """``n`` batches of epoch 0 at evenly spaced places inside it (not the first: under ``bucket`` it holds the
    longest sequences)."""
    loader, _, sampler = make_loaders(cfg, data)
    sampler.set_epoch(0)
    total = len(loader)
    want = {min(total - 1, (i + 1) * total // (n + 1)) for i in range(n)}
    return [to_device(b, device) for i, b in enumerate(loader) if i in want]


def _timed_pass(model, batch: dict, device: torch.device, autocast, loss_fn: Callable = FULL.loss) -> float:
    """Milliseconds of one forward+backward of ``model`` on ``batch`` (``loss_fn``: the step's loss); the
    gradients are dropped."""
    sync(device)
    t0 = time.perf_counter()
    with autocast():
        loss = loss_fn(model, batch)
    loss.backward()
    sync(device)
    model.zero_grad(set_to_none=True)
    return (time.perf_counter() - t0) * 1e3


def _replayed_ms(model, batch: dict, reps: int, autocast) -> float:
    """Milliseconds of one step on ``batch`` as a ``--cuda-graphs`` run takes it: the median forward plus backward
    of ``reps`` replays of the step captured as CUDA graphs, after one untimed replay (a causal LM without its
    KV cache, as it trains)."""
    return sum(replay_ms(model, batch, reps, autocast, skip=1, call_kwargs=no_cache(model)))


@contextlib.contextmanager
def _as(method: str, patch: Callable[[], None] | None, unpatch: Callable[[], None] | None):
    """Within the block the model is ``method``'s: dense as it is, SEBP patched (and unpatched after)."""
    if method == "dense":
        yield
        return
    patch()
    try:
        yield
    finally:
        unpatch()


def _layout_ms(model, batches: list[dict], mean_slots: float, device, autocast, graphs: bool, reps: int,
               patch: Callable[[], None] | None = None, unpatch: Callable[[], None] | None = None,
               head: Head = FULL) -> dict[str, float]:
    """A layout's milliseconds per batch over an epoch, dense and (with ``patch``) SEBP: measured ms per token slot
    times the epoch's mean slots. Eager, each batch runs one untimed pass per method, then ``reps`` timed
    passes of each, interleaved (dense, SEBP, dense, ...), so that neither method runs on a colder host or GPU;
    as CUDA-graph replays (``graphs``), each method's graphs are captured after their own warm-up and replayed
    ``reps`` times, dense first. ``head``: the loss timed eagerly."""
    methods = ("dense", "sebp") if patch else ("dense",)
    per_slot: dict[str, list[float]] = {m: [] for m in methods}
    for b in batches:
        times: dict[str, list[float]] = {m: [] for m in methods}
        if graphs:
            for method in methods:
                with _as(method, patch, unpatch):
                    times[method].append(_replayed_ms(model, b, reps, autocast))
        else:
            for i in range(reps + 1):  # the first round is the warm-up
                for method in methods:
                    with _as(method, patch, unpatch):
                        ms = _timed_pass(model, b, device, autocast, head.loss)
                    if i:
                        times[method].append(ms)
        for method, ts in times.items():
            per_slot[method].append(statistics.median(ts) / b["input_ids"].numel())
    return {m: statistics.fmean(v) * mean_slots for m, v in per_slot.items()}


def _compiled_ms(model, batches: list[dict], mean_slots: float, device, autocast, reps: int,
                 mode: str, scope: str = "layers", one_shape: bool = False,
                 replays: bool = False, row_bound: int | None = None, head: Head = FULL) -> tuple[float, float] | str:
    """A layout's compiled milliseconds per batch over an epoch (as :func:`_layout_ms`: per token slot times
    the epoch's mean slots) and its compile seconds, for the model as it is now (dense or patched), compiled as
    the run would (``scope``: ``layers``, each layer of its stack in place, :func:`compile_stack`, with
    dynamic shapes unless the layout has ``one_shape``, undone after; ``model``, a fresh
    ``torch.compile(head.loss)``), Dynamo's caches reset first; on each batch one
    first call (a compile or recompile, and one step: its time past the batch's median counts as compile
    seconds), then ``reps`` timed calls, or (``replays``: ``--cuda-graphs``, which replays the compiled layers)
    ``reps`` replays of the step captured as CUDA graphs, as the run will step; ``row_bound``: the run's most
    rows a batch (:func:`~.compiling.compile_layers`). Why it did not compile instead, where it did not."""
    torch._dynamo.reset()
    fallback = Fallback(mode)
    undo = compile_stack(model, fallback, row_bound=row_bound, **layer_compile_options(mode, one_shape)) \
        if scope == "layers" else None
    step = head.loss if undo is not None else compile_fn(head.loss, mode, device, fallback=fallback)
    per_slot, compile_s = [], 0.0
    try:
        for b in batches:
            first = _timed_pass(model, b, device, autocast, step)
            ms = (_replayed_ms(model, b, reps, autocast) if replays
                  else statistics.median(_timed_pass(model, b, device, autocast, step) for _ in range(reps)))
            if fallback.why is not None:
                return f"did not compile: {fallback.why}"
            compile_s += max(0.0, first - ms) / 1e3
            per_slot.append(ms / b["input_ids"].numel())
    finally:
        if undo is not None:
            undo()
    return statistics.fmean(per_slot) * mean_slots, compile_s


def _time_compiled(row: dict, model, task: str, padding: str, batches, slots: float, device, autocast, reps: int,
                   mode: str, methods: tuple[str, ...], patch, unpatch, scope: str = "layers",
                   replays: bool = False, row_bound: int | None = None, head: Head = FULL) -> None:
    """Add the compiled candidates of ``row`` (a layout and head) to it: ``{method}_compiled_ms`` and
    ``_compile_s``, or ``compiled_skipped``: why they were not timed. ``scope``: the run's --compile-scope
    (under ``layers`` the head runs eagerly, so nothing about it keeps a compiled step from running);
    ``replays``: timed as CUDA-graph replays of the compiled layers (``--cuda-graphs``); ``row_bound``: the
    run's most rows a batch, as its layers will be compiled with it; ``head``: the row's."""
    why = compiled_head_problem(task, padding) if head.kind == "labelled" and compiles_whole(model, scope) \
        else None
    if why:
        row["compiled_skipped"] = f"the labelled-rows head {why}"
        return
    ready_to_compile(model, padding, autocast)
    for method in methods:
        with _as(method, patch, unpatch):
            got = _compiled_ms(model, batches, slots, device, autocast, reps, mode, scope,
                               LAYOUTS[padding].one_shape, replays, row_bound, head)
        if isinstance(got, str):
            row["compiled_skipped"] = got
            return
        name = candidate(method, True)
        row[f"{name}_ms"], row[f"{name}_compile_s"] = round(got[0], 3), round(got[1], 3)


def _why_not(model, cfg: FinetuneConfig, task: str, padding: str, graphs: bool) -> str | None:
    """Why ``padding`` cannot run here (None: it can)."""
    layout = LAYOUTS[padding]
    if graphs and not layout.fixed_shapes:
        return f"CUDA graphs need fixed batch shapes; {padding} batches change from batch to batch"
    if not layout.packed:
        return None
    try:
        check_packable(model, task)
    except PackingError as e:
        return str(e)
    return None


def _timings(model, cfg: FinetuneConfig, device: torch.device, graphs: bool) -> tuple[str | None, bool]:
    """(the compile mode to time candidates with, None: eager only; whether steps are timed as CUDA-graph
    replays): as the run will train."""
    mode = cfg.compile_mode
    if mode and (cannot_compile(cfg.compile, device) if cfg.compile == COMPILE_AUTO  # then the line comes from here
                 else inductor_problem(device) is not None):  # the run will say so
        mode = None
    replays = bool(graphs and cfg.cuda_graphs)  # the run replays its steps as CUDA graphs (not Inductor's own)
    if mode and replays and compiles_whole(model, cfg.compile_scope):
        mode = None  # no layer stack to compile: the run replays its step eagerly, as timed here
    return mode, replays


def _prior_layouts(model, cfg: FinetuneConfig, data: TrainData, graphs: bool) -> tuple[dict[str, dict], dict]:
    """(layout -> its prior row, for the layouts timing may consider, in the prior's order: least padding first;
    layout -> its table row where it is not timed: it cannot run here, or the prior skips it)."""
    lens, multiple = lengths(data.train), pad_multiple(cfg)  # that of the batches timed
    rows, skipped = {}, {}
    for padding in LAYOUTS:
        n, nrows, slots, real = layout_counts(lens, cfg.data.batch_size, cfg.data.max_length, padding, cfg.seed,
                                              multiple=multiple)
        row = {"padding": padding, "padding_share": round(1.0 - real / slots, 4), "slots": round(slots / n, 1),
               "rows": round(nrows / n, 2)}
        reason = _why_not(model, cfg, data.task, padding, graphs)
        if reason:
            skipped[padding] = {**row, "skipped": reason}
        else:
            rows[padding] = row
    for padding, why in prior_skips({p: r["slots"] for p, r in rows.items()}).items():
        skipped[padding] = {**rows.pop(padding), "skipped": why}
    order = sorted(rows, key=lambda p: (rows[p]["padding_share"], list(LAYOUTS).index(p)))
    return {p: rows[p] for p in order}, skipped


def _time_compiled_rows(model, cfg: FinetuneConfig, data: TrainData, rows: dict, layouts: dict, batches: dict,
                        candidates, device, autocast, reps: int, mode: str, eager: bool, replays: bool, head_named,
                        unpatch_model, info: dict, say) -> None:
    """Each row's compiled candidates (:func:`_time_compiled`), but none of a row not afforded eager, nor one
    whose estimated compile and passes (:func:`~.calibration_budget.compiled_cost_ms`) are over what is left
    of the budget (``info``: the eager timing's ``budget_s``, ``spent_s`` and ``per_slot_ms``, its spend
    counted on); those say why in their row, and in one line."""
    left = (info["budget_s"] - info["spent_s"]) * 1e3
    compile_s, spent, over = COMPILE_PRIOR_S, 0.0, []
    for (padding, head), row in rows.items():
        if eager and not any(k.endswith("_ms") for k in row):  # not afforded eager: nor compiled
            continue
        slots = [b["input_ids"].numel() for b in batches[padding]]
        est = compiled_cost_ms(info["per_slot_ms"], slots, reps, 2 if candidates else 1, compile_s, bool(candidates))
        if spent + est > left:
            row["compiled_skipped"] = (f"not timed: compiling and timing it, about {est / 1e3:.0f} s, is over the "
                                       f"{max(0.0, left - spent) / 1e3:.1f} s left of the budget")
            over.append(_name((padding, head, None)))
            continue
        t0 = time.perf_counter()
        h = head_named(head)
        patch = _sebp_patch(model, cfg, row, batches[padding], candidates, device, autocast, h) \
            if candidates else None
        _time_compiled(row, model, data.task, padding, batches[padding], layouts[padding]["slots"], device,
                       autocast, reps, mode, ("dense", "sebp") if patch else ("dense",), patch,
                       lambda: unpatch_model(model), cfg.compile_scope, replays,
                       row_bound=most_rows(cfg, data, padding), head=h)
        took = [row[k] for k in row if k.endswith("_compiled_compile_s")]
        compile_s = max(took) if took else compile_s  # this model's compile, measured, for the next rows
        counted = sum(1e3 * row[f"{m}_compile_s"] + (1 + reps) * len(slots) * row[f"{m}_ms"]
                      for m in ("dense_compiled", "sebp_compiled") if f"{m}_ms" in row)
        spent += max((time.perf_counter() - t0) * 1e3, counted)
    info["spent_s"] = round(info["spent_s"] + spent / 1e3, 3)
    if over:
        say(f"--padding auto: compiled candidates not timed (over the budget): {', '.join(over)}")


def _estimate(model, cfg: FinetuneConfig, task: str, rows: dict, layouts: dict, batches: dict, device, autocast,
              heads, timer: Timer, say, micro: int, head_named, unpatch_model) -> dict:
    """Where only compiled candidates are timed (``--compile MODE``): the first pass alone (eager, as
    :func:`~.layout_timing.time_eager`'s), for the run's estimate and the budget."""
    passes = Passes(_timed_pass, _as, _layout_ms, _sebp_patch, head_named, unpatch_model)
    timing = EagerTiming(model, cfg, task, rows, layouts, batches, {}, device, autocast, timer, say, passes)
    timing.keys = [(next(iter(layouts)), heads[0], "dense")]
    timing.first_pass(micro)
    return timing.done()


def _untimed_or_picked(table: list[dict], info: dict, layouts: dict, methods: tuple[str, ...], heads,
                       micro: int) -> PaddingChoice:
    """The prior's pick where nothing was timed (or the timing says untimed), else :func:`pick`'s."""
    prior = next(iter(layouts))
    if info.get("untimed") or not any(k.endswith("_ms") for r in table for k in r):
        own = "sebp" if "sebp" in methods else "dense"  # the run's calibration still times SEBP against dense
        return PaddingChoice(prior, own, {m: prior for m in methods}, table, heads[0],
                             {m: heads[0] for m in methods}, False, {m: False for m in methods}, micro)
    return pick(table, methods, micro)


def choose_padding(model, cfg: FinetuneConfig, data: TrainData, candidates: dict[str, SEBPConfig],
                   device: torch.device, autocast=contextlib.nullcontext, graphs: bool = False,
                   reps: int = 3, heads: tuple[str | None, ...] = (None,), timer: Timer = wall_timer,
                   say: Callable[[str], None] | None = None, head: Head = FULL) -> PaddingChoice:
    """Time the layouts the prior keeps (:mod:`.layout_prior`) dense and (with ``candidates``) with SEBP on
    ``model``, eager and/or compiled as ``cfg.compile`` says, within ``cfg.calib_budget`` of the run's estimated
    time; see the module docstring. ``heads``: the heads to time each layout with
    (names of :data:`~sebp_probe.model.losses.HEADS`, made by :func:`~sebp_probe.model.losses.head_for`; None:
    ``head``, the run's own).
    ``timer``: times one eager pass (:data:`~.layout_prior.Timer`); ``say``: one plain line per phase and per
    candidate timed. ``model`` is left unpatched, without gradients, and Dynamo's caches reset."""
    from ..model.patch import unpatch_model

    head_named = lambda h: head if h is None else head_for(model, data.task, h)[0]  # noqa: E731
    say = say or (lambda text: None)
    micro = micro_batches(cfg, len(data.train))
    methods = ("dense", "sebp") if candidates else ("dense",)
    mode, replays = _timings(model, cfg, device, graphs)
    eager = mode is None or cfg.compile == COMPILE_AUTO  # --compile MODE: the run compiles: only compiled is timed
    layouts, skipped = _prior_layouts(model, cfg, data, graphs)
    say("--padding auto: prior, mean token slots per batch: " + ", ".join(
        f"{r['padding']} {r['slots']:.0f} ({100 * r['padding_share']:.1f}% padding)" for r in layouts.values())
        + "".join(f"; {p}: {r['skipped']}" for p, r in skipped.items()))
    rows = {(p, h): {**r, **({"head": h} if h else {})} for p, r in layouts.items() for h in heads}
    info: dict = {"micro_batches": micro}
    with torch.random.fork_rng(devices=rng_devices(device)):
        # only its batches are used; a compiling run's carry the labelled rows' counts (a layout's own --compile
        # mode: auto is --padding auto's alone)
        batches = {p: _spread_batches(replace(cfg, data=replace(cfg.data, padding=p), compile=cfg.compile and
                                              "default"), data, device, max(SAMPLE_BATCHES, cfg.calib_batches))
                   for p in layouts}
        if eager:
            info.update(_time_eager(model, cfg, data.task, rows, layouts, batches, candidates, methods, device,
                                    autocast, replays, heads, timer, say, micro, head_named, unpatch_model))
        elif mode:
            info.update(_estimate(model, cfg, data.task, rows, layouts, batches, device, autocast, heads, timer, say,
                                  micro, head_named, unpatch_model))
        if mode:
            _time_compiled_rows(model, cfg, data, rows, layouts, batches, candidates, device, autocast, reps, mode,
                                eager, replays, head_named, unpatch_model, info, say)
        model.zero_grad(set_to_none=True)
    if mode:
        torch._dynamo.reset()  # the runs compile their own models afresh
    table = [r for p in LAYOUTS for r in ([skipped[p]] if p in skipped else
                                          [rows[(p, h)] for h in heads if (p, h) in rows])]
    choice = _untimed_or_picked(table, info, layouts, methods, heads, micro)
    choice = replace(choice, replays=replays, **{k: v for k, v in info.items() if k != "micro_batches"})
    say(f"--padding auto: chose {_name((choice.padding, choice.head, choice.method))}"
        + (" compiled" if choice.compiled else "")
        + (f"; timing took {choice.spent_s:.1f} s of its {choice.budget_s:.1f} s budget"
           if choice.budget_s is not None else ""))
    return choice


def _sebp_patch(model, cfg: FinetuneConfig, row: dict, batches: list[dict], candidates: dict[str, SEBPConfig],
                device, autocast, head: Head = FULL) -> Callable[[], None] | None:
    """What patches SEBP into ``model`` for ``row``'s layout and head: the candidate layers whose share of active
    rows on ``batches`` is at most ``dense_fallback``, and every sampled one, as a run's calibration would (None:
    no layer, norm or activation to patch); ``row["sebp_layers"]`` says how many."""
    density = measure_density(model, batches, candidates, device, autocast, head)
    layers = {n: c for n, c in candidates.items() if density[n] <= cfg.dense_fallback or c.mode == "sampled"}
    row["sebp_layers"] = len(layers)
    if not (layers or cfg.sebp_norms or cfg.sebp_acts):
        return None
    return lambda: apply_sebp(model, layers, cfg.sebp_norms, cfg.sebp_acts)


def _time_eager(model, cfg: FinetuneConfig, task: str, rows: dict, layouts: dict, batches: dict, candidates,
                methods, device, autocast, replays: bool, heads, timer: Timer, say, micro: int, head_named,
                unpatch_model) -> dict:
    """The eager candidates timed within the budget (:func:`~.layout_timing.time_eager`), with this module's
    passes. Returns what the choice records of it."""
    passes = Passes(_timed_pass, _as, _layout_ms, _sebp_patch, head_named, unpatch_model)
    timing = EagerTiming(model, cfg, task, rows, layouts, batches, candidates, device, autocast, timer, say, passes)
    return time_eager(timing, methods, heads, replays, micro)


def pick(table: list[dict], methods: tuple[str, ...], micro_batches: int) -> PaddingChoice:
    """Add to each row of ``table`` the whole-run estimate of each candidate timed there (``{name}_run_s``,
    :func:`whole_run_s` of its ``{name}_ms`` and ``{name}_compile_s``) and choose, overall and for each method:
    the least, unless a candidate the prior prefers (less padding, then the row's order, then dense, then eager)
    is within the timings' spread of it (``{name}_spread``; :func:`~.layout_prior.noise_aware`)."""
    for row in table:
        for name in [k[:-3] for k in row if k.endswith("_ms")]:
            row[f"{name}_run_s"] = whole_run_s(row[f"{name}_ms"], micro_batches, row.get(f"{name}_compile_s", 0.0))
    measured = []
    for i, r in enumerate(table):
        for j, m in enumerate(methods):
            for c in (False, True):
                name = candidate(m, c)
                if f"{name}_run_s" not in r:
                    continue
                lo, hi = r.get(f"{name}_spread", (r[f"{name}_ms"],) * 2)
                cost = tuple(whole_run_s(ms, micro_batches, r.get(f"{name}_compile_s", 0.0))
                             for ms in (r[f"{name}_ms"], lo, hi))
                measured.append((cost, (r["padding_share"], i, j, c), m, c, r["padding"], r.get("head")))
    take = lambda es: es[noise_aware([e[:2] for e in es])]  # noqa: E731
    best = {m: take([e for e in measured if e[2] == m]) for m in methods if any(e[2] == m for e in measured)}
    _, _, method, compiled, padding, head = take(measured)
    return PaddingChoice(padding, method, {m: b[4] for m, b in best.items()}, table, head,
                         {m: b[5] for m, b in best.items()}, compiled, {m: b[3] for m, b in best.items()},
                         micro_batches)
