"""Calibration: which candidate layers run SEBP, measured on the run's first batches before training.

A few dense forward/backward passes measure each candidate layer's share of active rows under its SEBP
setting (layers above ``dense_fallback`` stay dense: SEBP would not pay there), then dense and SEBP backward
are timed interleaved on the same batches. The RNG is forked and the gradients discarded, so training is
untouched. Within a run it takes what is left of ``--calib-budget`` (:class:`CalibBudget`,
:mod:`.calibration_budget`): fewer rounds and batches, no timing (the density's answer), or no pass at all
(the padding's answer).
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field, replace

import torch

from sebp_kernels import SEBPConfig, SEBPNorm, select_rows

from ..config import FinetuneConfig, FinetuneError
from .graphs import replay_ms
from ..model.losses import FULL, Head, no_cache
from ..model.patch import find_targets, patch_sebp
from ..notes import note
from .calibration_budget import CalibBudget, plan_calibration, prior_layers


def _linear_name(modules: dict, name: str) -> str:
    from ..analysis.report import linear_name

    real = linear_name(modules, name)
    if real is None:
        raise FinetuneError(f"layer {name!r} of the SEBP settings is not in this model")
    return real


def candidate_layers(model: torch.nn.Module, cfg: FinetuneConfig,
                     report_layers: dict[str, SEBPConfig] | None) -> dict[str, SEBPConfig]:
    """Name of an nn.Linear in ``model`` -> its SEBP setting, before the density check."""
    if report_layers is not None:
        modules = dict(model.named_modules())
        return {_linear_name(modules, n): c for n, c in report_layers.items()}
    return {n: cfg.sebp_config() for n in find_targets(model, list(cfg.targets) if cfg.targets else None)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(model, batch, device, autocast, head: Head = FULL) -> tuple[float, float]:
    """Milliseconds of the forward (to ``head``'s loss) and of its backward, each between syncs."""
    sync(device)
    t0 = time.perf_counter()
    with autocast():
        loss = head.loss(model, batch)
    sync(device)
    t1 = time.perf_counter()
    loss.backward()
    sync(device)
    return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3


def graphed_step_ms(model, batch, autocast, repeats: int = 3) -> tuple[float, float]:
    """Median forward and backward milliseconds of the step replayed as CUDA graphs (``--cuda-graphs``); the
    gradients it wrote are dropped."""
    return replay_ms(model, batch, repeats, autocast, call_kwargs=no_cache(model))


def rng_devices(device: torch.device) -> list[int]:
    return [device.index or 0] if device.type == "cuda" else []


def measure_density(model, batches: list[dict], candidates: dict[str, SEBPConfig], device: torch.device,
                    autocast=contextlib.nullcontext, head: Head = FULL,
                    counts: dict | None = None) -> dict[str, float]:
    """Each candidate layer's share of rows of dL/dY that its SEBP setting keeps, over dense backward passes
    (of ``head``'s loss) on ``batches`` (``counts``: name -> [kept, rows] to add to, over several calls). The
    caller discards the gradients (and forks the RNG when it matters)."""
    modules = dict(model.named_modules())
    counts = {n: [0, 0] for n in candidates} if counts is None else counts

    def hook_for(name, scfg):
        def fwd(_mod, _inp, out):
            if out.requires_grad:
                def grad(g):
                    g2 = g.detach().reshape(-1, g.shape[-1])
                    counts[name][0] += select_rows(g2, scfg).numel()
                    counts[name][1] += g2.shape[0]
                out.register_hook(grad)
        return fwd

    handles = [modules[n].register_forward_hook(hook_for(n, c)) for n, c in candidates.items()]
    try:
        for b in batches:
            timed_step(model, b, device, autocast, head)
    finally:
        for h in handles:
            h.remove()
    return {n: (k / m if m else 1.0) for n, (k, m) in counts.items()}


@dataclass
class Calibration:
    """What :func:`calibrate` found: the medians over its timed passes of the backward and of the whole step
    (forward to the loss + backward), dense and with SEBP, in milliseconds (None where not timed)."""

    density: dict[str, float]
    dense_backward_ms: float | None
    sebp_backward_ms: float | None
    layers: dict[str, SEBPConfig]
    fallback: list[str]
    reason: str | None = None
    norms: list[str] = field(default_factory=list)  # norms with the SEBP backward (``sebp_norms``)
    acts: list[str] = field(default_factory=list)  # MLPs with the SEBP activation (``sebp_acts``)
    dense_step_ms: float | None = None
    sebp_step_ms: float | None = None
    budget: dict | None = None  # its budget, what it spent (as estimated) and what it cut (``budget_s``, ...)

    def to_dict(self) -> dict:
        return {"density": self.density, "dense_backward_ms": self.dense_backward_ms,
                "sebp_backward_ms": self.sebp_backward_ms, "dense_step_ms": self.dense_step_ms,
                "sebp_step_ms": self.sebp_step_ms, "fallback_dense": self.fallback,
                "fallback_reason": self.reason, "layers": {n: s.to_dict() for n, s in self.layers.items()},
                "norms": self.norms, "activations": self.acts, "budget": self.budget}


def backend_variants(layers: dict[str, SEBPConfig], device: torch.device,
                      graphs: bool = False) -> list[dict[str, SEBPConfig]]:
    """The SEBP implementations worth timing: on CUDA with backend ``auto``, both the Triton kernels and the
    torch path (gather + cuBLAS + scatter, one host sync per layer), since which one wins depends on the GPU,
    the dtype and the shapes; elsewhere just the configured one. With ``graphs`` only the Triton kernels: the
    torch path's host sync cannot be captured."""
    from sebp_kernels.functional import _triton_backward

    if device.type != "cuda" or any(c.backend != "auto" for c in layers.values()):
        return [layers]
    if graphs:
        return [{n: replace(c, backend="triton") for n, c in layers.items()}]
    backends = ("triton", "torch") if _triton_backward() is not None else ("torch",)
    return [{n: replace(c, backend=b) for n, c in layers.items()} for b in backends]


def apply_sebp(model, layers: dict[str, SEBPConfig], norms: bool = False, acts: bool = False) -> list[str]:
    """Patch ``layers`` into ``model``, with ``norms`` its norms too, with ``acts`` its MLP activations (also
    without any SEBP linear: their fused kernels can pay where every row is active); return the names of the
    model's SEBP norms (patched now or before)."""
    patch_sebp(model, layer_configs=layers, norms=norms, acts=acts)
    return [n for n, m in model.named_modules() if isinstance(m, SEBPNorm)] if norms else []


def calibrate(model, batches: list[dict], candidates: dict[str, SEBPConfig], fallback: float,
              device: torch.device, autocast=contextlib.nullcontext, if_slower: bool = True,
              reps: int = 2, norms: bool = False, acts: bool = False, graphs: bool = False,
              head: Head = FULL, budget: CalibBudget | None = None) -> Calibration:
    """Decide which candidate layers run SEBP, and patch them into ``model`` (with ``norms``, its norms too,
    with ``acts`` its MLP activations: they are timed and kept or dropped together with the linear layers).

    1. One dense forward and backward per batch measures each layer's share of active rows under its setting;
       layers above ``fallback`` stay dense (gathering nearly every row costs more than it saves); ``sampled``
       layers do not (nor does ``if_slower`` apply to them): the user chose the approximation; where they are
       all there is, nothing is timed (there is no choice to make). With
       ``norms`` or ``acts``, those are timed even where no linear layer qualifies.
    2. Dense and SEBP steps (the forward to the loss, then its backward) are timed interleaved on the same
       batches (median of ``reps`` rounds); on CUDA with backend ``auto`` the Triton and the torch
       implementations are both timed and the faster kept. The forward counts: SEBP's differs from dense's
       (the linears over the real-token rows once the padding's check passed, the activations' and norms'
       fused kernels). With ``if_slower``, an SEBP step slower than dense's leaves the whole model dense: SEBP
       never costs step time as timed here. With ``graphs`` both are timed as CUDA-graph replays, as
       ``--cuda-graphs`` (and the graph-recording ``--compile`` modes) train; otherwise eagerly, also under
       ``--compile default``, whose compiled step can rank differently.

    ``head``: the run's loss (:class:`~sebp_probe.model.losses.Head`). ``budget`` (None: no limit): only what it
    affords (:func:`~.calibration_budget.plan_calibration`; what it cuts said in one note): fewer rounds or
    batches; untimed (step 1 decides); no pass (the batches' padding decides,
    :func:`~.calibration_budget.prior_layers`). Leaves no gradients and no trace in the RNG.
    """
    from ..model.patch import unpatch_model

    dense, sebp, reason, norm_names, answer = [], [], None, [], None
    if graphs:
        timed = lambda b: graphed_step_ms(model, b, autocast)  # noqa: E731
    else:
        timed = lambda b: timed_step(model, b, device, autocast, head)  # noqa: E731
    with torch.random.fork_rng(devices=rng_devices(device)):
        density, timed_batches, reps, spent = _density_within(model, batches, candidates, device, autocast, budget,
                                                              reps, graphs, head)  # also the dense warm-up
        if density is None:  # not one pass afforded: the padding's answer
            layers, answer = prior_layers(candidates, batches, fallback)
            density, if_slower = {}, False
        else:  # sampled layers stay whatever their density: the user asked for the approximation
            layers = {n: c for n, c in candidates.items() if density[n] <= fallback or c.mode == "sampled"}
            if_slower = if_slower and not any(c.mode == "sampled" for c in layers.values())
        if not timed_batches or (layers and all(c.mode == "sampled" for c in layers.values()) and not (norms or acts)):
            # untimed (the budget) or nothing to choose (sampled: every layer kept, its backend as asked)
            norm_names = apply_sebp(model, layers, norms, acts) if layers or norms or acts else []
            if spent and spent["cut"] and answer is None:
                answer = (f"SEBP on the {len(layers)} of {len(candidates)} layers whose share of active rows is at "
                          f"most {fallback:g}, untimed")
        elif layers or norms or acts:
            layers, dense, sebp = _fastest_variant(model, timed_batches, norms, acts, reps, timed,
                                                   backend_variants(layers, device, graphs) if layers else [{}],
                                                   lambda b: timed_step(model, b, device, autocast, head))
            norm_names = apply_sebp(model, layers, norms, acts)  # the chosen backend in place of the last one timed
            if if_slower and _median_step(sebp) > _median_step(dense):
                unpatch_model(model)
                reason = "SEBP measured slower than dense (forward + backward) on the calibration batches"
                if device.type == "cuda" and not graphs:  # eager on a GPU: often the host's launch overhead
                    reason += " (eager: where the host is the bound, --cuda-graphs may reverse it)"
                layers, norm_names = {}, []
        else:
            dense = [timed(b) for b in timed_batches]
        model.zero_grad(set_to_none=True)
    if spent and spent["cut"]:
        spent["cut"] += f": {answer}" if answer else ""
        note(f"calibration: {spent['cut']}")
        if answer and not layers:
            reason = spent["cut"]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return Calibration(density, med([b for _, b in dense]), med([b for _, b in sebp]), layers,
                       sorted(n for n in candidates if n not in layers), reason, norm_names,
                       dense_step_ms=_median_step(dense), sebp_step_ms=_median_step(sebp), budget=spent)


def _density_within(model, batches: list[dict], candidates: dict[str, SEBPConfig], device, autocast,
                    budget: CalibBudget | None, reps: int, graphs: bool, head: Head = FULL):
    """Each candidate's density over the batches ``budget`` affords, and the timing it affords: (density,
    None where not one pass is afforded; the batches to time SEBP against dense on, none: untimed; the rounds;
    what the budget was and what it spent, its estimate, and what it cut, None without a budget)."""
    if budget is None:
        return measure_density(model, batches, candidates, device, autocast, head), batches, reps, None
    counts = {n: [0, 0] for n in candidates}
    measured, first = 0, 0.0
    if budget.per_slot_ms is None:  # the first pass estimates the run
        b0 = batches[0]

        def run() -> float:
            t0 = time.perf_counter()
            measure_density(model, [b0], candidates, device, autocast, head, counts)
            return (time.perf_counter() - t0) * 1e3

        first = budget.timer(("calibration", None, "dense"), b0, run)
        budget.start(first, b0["input_ids"].numel())
        measured = 1
    variants = len(backend_variants(candidates, device, graphs)) if candidates else 1
    plan = plan_calibration(budget, [b["input_ids"].numel() for b in batches], measured, variants, reps, graphs)
    density = measure_density(model, batches[measured:plan.density], candidates, device, autocast, head,
                              counts) \
        if plan.density else None
    spent = {"budget_s": round(budget.budget_ms / 1e3, 3), "spent_s": round((first + plan.cost_ms) / 1e3, 3),
             "cut": plan.cut}
    return density, batches[:plan.timed], max(plan.reps, 1), spent


def _median_step(passes: list[tuple[float, float]]) -> float | None:
    """Median forward + backward milliseconds of timed passes (None for none)."""
    return statistics.median(f + b for f, b in passes) if passes else None


def _fastest_variant(model, batches, norms, acts, reps, timed, variants, warm):
    """(layers, dense passes, SEBP passes) of the SEBP implementation of ``variants`` (layer settings, see
    :func:`backend_variants`) whose steps timed fastest, each timed interleaved with dense (``timed``) after a
    warm-up pass (``warm``) over ``batches``."""
    from ..model.patch import unpatch_model

    best = None
    for cfgs in variants:
        apply_sebp(model, cfgs, norms, acts)
        for b in batches:  # SEBP warm-up: kernel compilation and tuning for these row counts, the padding check
            warm(b)
        dense, sebp = [], []
        for _ in range(reps):
            for b in batches:
                unpatch_model(model)
                dense.append(timed(b))
                apply_sebp(model, cfgs, norms, acts)
                sebp.append(timed(b))
        if best is None or _median_step(sebp) < _median_step(best[2]):
            best = (cfgs, dense, sebp)
    return best


def take_main_choice(model, c: Calibration, candidates: dict[str, SEBPConfig]) -> Calibration:
    """Under several processes (accelerate's state), every process takes the main process's choice of layers,
    norms and activations (timings differ per process, and the processes must compute the same model); ``model``
    is patched again to match. One process: ``c`` as it is."""
    from accelerate import PartialState

    if PartialState().num_processes == 1:
        return c
    from accelerate.utils import broadcast_object_list

    from ..model.patch import patched_activations, unpatch_model

    chosen = broadcast_object_list([{"layers": {n: sc.to_dict() for n, sc in c.layers.items()},
                                     "norms": bool(c.norms), "acts": bool(patched_activations(model))}])[0]
    unpatch_model(model)
    c.layers = {n: SEBPConfig.from_dict(d) for n, d in chosen["layers"].items()}
    c.fallback = sorted(n for n in candidates if n not in c.layers)
    c.norms = apply_sebp(model, c.layers, chosen["norms"], chosen["acts"])
    return c
