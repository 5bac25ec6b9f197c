"""What a run's SEBP calibration (:func:`~.calibration.calibrate`) may spend: the rest of ``--calib-budget``.

The budget is one for the whole calibration: ``calib_budget`` of the run's estimated time (a pass's time per
token slot x the run's micro-batches), spent first by ``--padding auto``'s timing where it runs (it hands on
what is left and its estimate), then by the run's calibration. The calibration counts its passes as the
estimate says they cost (a pass's ms per token slot x the batch's token slots) and takes the richest plan
that fits (:func:`plan_calibration`): its timed rounds on every batch, one round, one round on one batch; no
timing (each layer's measured share of active rows decides, untimed); or no pass at all, where not even the
density's passes fit: then the padding decides (:func:`prior_layers`). Whatever it cuts is said in one line.
"""
from __future__ import annotations

from dataclasses import dataclass

from .layout_prior import Timer, wall_timer

GRAPH_PASSES = 4  # a step timed as CUDA-graph replays: its capture and three replays
# A compiled candidate's compile before one of this model's is measured: about what compiling a model's layers
# took on an H100/H200 (7-15 s, results/model_compiled.json)
COMPILE_PRIOR_S = 10.0


@dataclass
class CalibBudget:
    """``share`` of the run's estimated time, the run being ``micro_batches`` passes. ``budget_ms``, ``left_ms``
    and ``per_slot_ms`` (a pass's estimated ms per token slot): from ``--padding auto``'s timing, which spent
    the rest; None: the calibration's first pass sets them (:meth:`start`). ``timer`` times that pass
    (:data:`~.layout_prior.Timer`)."""

    share: float
    micro_batches: int
    budget_ms: float | None = None
    left_ms: float | None = None
    per_slot_ms: float | None = None
    timer: Timer = wall_timer

    def start(self, first_ms: float, slots: int) -> None:
        """The first pass, ``first_ms`` on a batch of ``slots`` token slots, estimates the run: the budget is
        ``share`` of it, less that pass."""
        self.per_slot_ms = first_ms / slots
        self.budget_ms = self.share * first_ms * self.micro_batches
        self.left_ms = self.budget_ms - first_ms


def micro_batches(cfg, examples: int) -> int:
    """The run's planned micro-batches: optimizer steps x ``grad_accum``, ``examples`` making its epochs."""
    return cfg.optimizer_steps(-(-examples // cfg.data.batch_size)) * cfg.grad_accum


def run_budget(cfg, examples: int, choice: dict | None, timer: Timer = wall_timer) -> CalibBudget:
    """A run's calibration budget (``cfg.calib_budget``; ``examples``: the training set's size): what
    ``--padding auto``'s ``choice`` (its ``to_dict``) left of it, with its estimate of a pass; without a choice
    (or one without an estimate), one its first pass sets."""
    micro = micro_batches(cfg, examples)
    if not choice or choice.get("budget_s") is None or not choice.get("per_slot_ms"):
        return CalibBudget(cfg.calib_budget, micro, timer=timer)
    budget = choice["budget_s"] * 1e3
    return CalibBudget(cfg.calib_budget, micro, budget, budget - (choice.get("spent_s") or 0.0) * 1e3,
                       choice["per_slot_ms"], timer)


@dataclass
class CalibPlan:
    """The calibration the budget affords: the density measured on the first ``density`` batches, SEBP timed
    against dense on the first ``timed`` (0: untimed) in ``reps`` rounds; ``cost_ms``: its estimate; ``cut``:
    what the budget cut, in words (None: nothing)."""

    density: int
    timed: int
    reps: int
    cost_ms: float
    cut: str | None = None


def plan_calibration(budget: CalibBudget, slots: list[int], measured: int, variants: int, reps: int,
                     graphs: bool = False) -> CalibPlan:
    """The richest calibration within ``budget.left_ms`` on batches of ``slots`` token slots each, the first
    ``measured`` of which have their density already: every batch's density, then SEBP timed against dense
    (``variants`` implementations, each one warm-up pass a batch and ``reps`` rounds of a dense and an SEBP
    pass; a timed pass ``graphs``: :data:`GRAPH_PASSES` passes) on every batch in ``reps`` rounds, in one round,
    on one batch in one round; else the density alone on as many batches as fit; else nothing."""
    left = budget.left_ms
    cost = lambda lo, hi: budget.per_slot_ms * sum(slots[lo:hi])  # noqa: E731
    n = len(slots)
    timed_pass = GRAPH_PASSES if graphs else 1
    density = cost(measured, n)
    for k, r in dict.fromkeys([(n, reps), (n, 1), (1, 1)]):
        total = density + variants * cost(0, k) * (1 + 2 * r * timed_pass)
        if total <= left:
            cut = None if (k, r) == (n, reps) else (
                f"the budget ({left / 1e3:.2f} s left) affords {r} timed round{'s' * (r > 1)} on {k} "
                f"batch{'es' * (k > 1)}, not {reps} on {n}")
            return CalibPlan(n, k, r, total, cut)
    short = f"the budget ({max(0.0, left) / 1e3:.2f} s left of {budget.budget_ms / 1e3:.2f} s)"
    for k in range(n, max(measured, 1) - 1, -1):
        if cost(measured, k) <= left or k == measured:
            return CalibPlan(k, 0, 0, cost(measured, k), f"{short} affords no timing of SEBP against dense")
    return CalibPlan(0, 0, 0, 0.0, f"{short} affords no calibration pass")


def compiled_cost_ms(per_slot_ms: float, slots: list[int], reps: int, methods: int, compile_s: float,
                     density: bool) -> float:
    """The estimated ms of timing a layout's compiled candidates (``methods`` of them) on batches of ``slots``
    token slots: each compiles (``compile_s``) and takes one first and ``reps`` timed passes a batch, at the
    eager estimate ``per_slot_ms`` (the compiled step is rarely slower); with ``density``, SEBP's density pass
    a batch first."""
    passes = per_slot_ms * sum(slots)
    return methods * (compile_s * 1e3 + (1 + reps) * passes) + (passes if density else 0.0)


def prior_layers(candidates: dict, batches: list[dict], fallback: float) -> tuple[dict, str]:
    """Without a pass, the padding's answer: an exact layer's share of active rows is at most the share of real
    tokens in ``batches`` (their attention masks; a packed batch's ``sequence_ids``, -1 on its padding), so every
    exact candidate runs SEBP where that share is at most ``fallback``, none where it is above; an approximate
    one (the user's choice) runs SEBP. (layers, the answer in words)"""
    real = slots = 0
    for b in batches:
        mask = b.get("attention_mask")
        mask = (b["sequence_ids"] >= 0) if "sequence_ids" in b else mask
        slots += b["input_ids"].numel()
        real += int(mask.sum()) if mask is not None and mask.dim() == 2 else b["input_ids"].numel()
    share = real / slots if slots else 1.0
    layers = {n: c for n, c in candidates.items() if c.mode != "exact" or share <= fallback}
    return layers, (f"{100 * (1 - share):.0f}% padding on the first batches: SEBP on {len(layers)} of "
                    f"{len(candidates)} layers, untimed")
