"""``--padding auto`` before and after its timings: the prior (what the layouts' token slots say before anything
is timed), the calibration budget (how much timing the run can afford), the timer of one pass, and the rule
that picks among timed candidates without trusting a gain the timings' own spread could explain.

The prior: every pass's work grows with the batch's token slots (the forward and most of the backward run over
every slot; SEBP only skips part of the backward over padding), so a layout with more than :data:`PRIOR_SLOTS`
times the token slots of the layout with the fewest is not timed. Among the candidates timed, the prior
prefers the least padding, then the run's own head, then plain dense, then eager: the order a tie goes in.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

PRIOR_SLOTS = 1.5  # a layout with more token slots than this times the fewest is not timed
ROUND_SHAPES = ((3, 3), (2, 3), (1, 3), (1, 2))  # (batches per candidate, timed rounds), richest first

# (padding, head, method), the batch, and a function that runs the pass and returns its milliseconds ->
# the milliseconds to count. The default runs the pass; tests pass one that returns chosen times.
Timer = Callable[[tuple, dict, Callable[[], float]], float]


def wall_timer(key: tuple, batch: dict, run: Callable[[], float]) -> float:
    """The pass's own wall-clock milliseconds."""
    return run()


def describe(key: tuple) -> str:
    """A candidate (padding, head, method; head and method may be None) as the progress lines name it."""
    padding, head, method = key
    return " ".join(filter(None, (padding, head and f"head {head}", "SEBP" if method == "sebp" else method)))


def prior_skips(slots: dict[str, float]) -> dict[str, str]:
    """Layout -> why the prior does not time it: more than :data:`PRIOR_SLOTS` times the mean token slots per
    batch of the layout with the fewest (``slots``: layout -> mean token slots per batch)."""
    if not slots:
        return {}
    least = min(slots, key=slots.__getitem__)
    return {p: f"not timed (prior): {s / slots[least]:.1f}x the token slots of {least} (over {PRIOR_SLOTS}x)"
            for p, s in slots.items() if s > PRIOR_SLOTS * slots[least]}


@dataclass
class TimingPlan:
    """What the budget affords: ``batches`` per candidate, ``rounds`` timed rounds (after one warm-up round),
    and the indices of the candidates it times (of those offered, in the prior's order)."""

    batches: int
    rounds: int
    chosen: list[int]


def plan_timing(pass_ms: Sequence[float], extra: Sequence[int], budget_ms: float, most_batches: int,
                shapes: Sequence[tuple[int, int]] = ROUND_SHAPES) -> TimingPlan | None:
    """The richest (batches, rounds) of ``shapes`` under which every candidate fits ``budget_ms`` (candidate i:
    ``pass_ms[i]`` a pass, (rounds + 1 + ``extra[i]``) passes a batch, ``extra`` counting the density pass an SEBP
    candidate needs), else the leanest with the candidates that fit, taken in the prior's order; None where
    the budget does not afford one pass of each candidate (too short a run to time)."""
    if budget_ms < sum(pass_ms):
        return None
    cost = lambda i, nb, r: pass_ms[i] * nb * (r + 1 + extra[i])  # noqa: E731
    every = list(range(len(pass_ms)))
    for nb, r in shapes:
        nb = min(nb, most_batches)
        if sum(cost(i, nb, r) for i in every) <= budget_ms:
            return TimingPlan(nb, r, every)
    nb, r = min(shapes[-1][0], most_batches), shapes[-1][1]
    chosen, left = [], budget_ms
    for i in every:
        if cost(i, nb, r) <= left:
            chosen.append(i)
            left -= cost(i, nb, r)
    return TimingPlan(nb, r, chosen)


MAD_SIGMA = 1.4826  # a median absolute deviation times this is a normal spread's standard deviation


def estimate(per_batch: list[list[float]], mean_slots: float) -> tuple[float, float, float]:
    """(median, low, high) milliseconds per batch over an epoch of a candidate timed in rounds
    (``per_batch[round][batch]``: milliseconds per token slot), times ``mean_slots``: the median of every
    pass's time per slot (a pass a neighbour's burst slowed moves it little, fewer than half of them not at
    all), and that -/+ its spread, the passes' median absolute deviation from it (times :data:`MAD_SIGMA`)."""
    passes = [t for r in per_batch for t in r]
    median = statistics.median(passes)
    dev = MAD_SIGMA * statistics.median(abs(t - median) for t in passes)
    return median * mean_slots, (median - dev) * mean_slots, (median + dev) * mean_slots


def within_noise(a: tuple[float, float, float], b: tuple[float, float, float]) -> bool:
    """Are two (median, low, high) times apart by no more than their spread: the gap of the medians at most
    half the wider of the two ranges?"""
    return abs(a[0] - b[0]) <= max(a[2] - a[1], b[2] - b[1]) / 2


def noise_aware(entries: Sequence[tuple[tuple[float, float, float], tuple]]) -> int:
    """Index of the entry to take of ``entries`` ((median, low, high) cost, prior key: the lesser preferred):
    the fastest by its median, unless an entry the prior prefers is within noise of it (:func:`within_noise`):
    then the most preferred of those."""
    fastest = min(range(len(entries)), key=lambda i: entries[i][0][0])
    near = [i for i, (cost, key) in enumerate(entries)
            if key <= entries[fastest][1] and within_noise(cost, entries[fastest][0])]
    return min(near, key=lambda i: entries[i][1])
