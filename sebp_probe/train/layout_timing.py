"""``--padding auto``'s eager timing (:func:`time_eager`): the candidates (layout, head, method) the budget
affords, timed in interleaved rounds, one warm-up round then the timed ones; see :mod:`.strategy`. The passes
themselves (one timed pass, a method's patch, a layout's CUDA-graph replays, SEBP's patch) come from the
caller, so this module knows nothing of the model beyond them."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .layout_prior import Timer, describe as _name, estimate, plan_timing


@dataclass
class Passes:
    """How one candidate's passes run: ``timed_pass(model, batch, device, autocast, loss_fn)`` -> ms;
    ``as_method(method, patch, unpatch)``: a context in which the model is that method's; ``layout_ms``: a
    layout's CUDA-graph
    replays (as :func:`~.strategy._layout_ms`); ``sebp_patch``: as :func:`~.strategy._sebp_patch`;
    ``head_for(name)``: the :class:`~sebp_probe.model.losses.Head` a row's head stands for (None: the run's);
    ``unpatch_model``: as :mod:`sebp_probe.model.patch`."""
    timed_pass: Callable
    as_method: Callable
    layout_ms: Callable
    sebp_patch: Callable
    head_for: Callable
    unpatch_model: Callable


@dataclass
class EagerTiming:
    """One eager timing's state: what is timed on what, the ms spent so far and the budget."""
    model: object
    cfg: object
    task: str
    rows: dict
    layouts: dict
    batches: dict
    candidates: object
    device: object
    autocast: object
    timer: Timer
    say: Callable
    passes: Passes
    keys: list = field(default_factory=list)
    spent: float = 0.0
    budget_ms: float = 0.0
    per_slot: float = 0.0
    out: dict = field(default_factory=dict)
    patches: dict = field(default_factory=dict)
    plan: object = None

    def head(self, h):
        return self.passes.head_for(h)

    def not_timed(self, key: tuple) -> None:
        self.rows[key[:2]].setdefault("not_timed", []).append(key[2])

    def done(self, **extra) -> dict:
        return {**self.out, **extra, "spent_s": round(self.spent / 1e3, 3)}

    def first_pass(self, micro: int) -> None:
        """The first pass (the prior's first candidate) sets the run's estimate and the budget."""
        cfg, first_key = self.cfg, self.keys[0]
        b0 = self.batches[first_key[0]][0]
        loss = self.head(first_key[1]).loss
        first = self.timer(first_key, b0, lambda: self.passes.timed_pass(self.model, b0, self.device,
                                                                          self.autocast, loss))
        self.per_slot = first / b0["input_ids"].numel()
        run_s = self.per_slot * self.layouts[first_key[0]]["slots"] * micro / 1e3
        self.budget_ms = cfg.calib_budget * run_s * 1e3
        self.spent = first
        self.out = {"run_estimate_s": round(run_s, 3), "budget_s": round(self.budget_ms / 1e3, 3),
                    "per_slot_ms": self.per_slot}
        self.say(f"--padding auto: first pass ({_name(first_key)}) {first:.1f} ms: the run's {micro} micro-batches "
                 f"take about {run_s:.1f} s; timing budget {100 * cfg.calib_budget:g}% of that, "
                 f"{self.budget_ms / 1e3:.2f} s")

    def planned(self) -> list[tuple] | None:
        """The candidates the plan times, SEBP's patched (None: too short a run: it says so, all untimed)."""
        keys = self.keys
        pass_ms = [self.per_slot * self.layouts[p]["slots"] for p, _, _ in keys]
        plan = self.plan = plan_timing(pass_ms, [int(m == "sebp") for _, _, m in keys], self.budget_ms - self.spent,
                                       min(len(b) for b in self.batches.values()))
        if plan is None or len(plan.chosen) < 2:
            why = ("too short a run to time the layouts: the budget affords less than one pass of each candidate"
                   if plan is None else "the budget affords one candidate alone")
            for key in keys[1:] if plan is not None else keys:
                self.not_timed(key)
            self.say(f"--padding auto: {why}; the prior's pick, {_name(keys[0][:2] + (None,)).strip()}, untimed")
            self.out["untimed"] = why
            return None
        timed = [keys[i] for i in plan.chosen]
        for key in keys:
            if key not in timed:
                self.not_timed(key)
        for p, h in dict.fromkeys((p, h) for p, h, m in timed if m == "sebp"):
            self.patches[(p, h)] = self.passes.sebp_patch(self.model, self.cfg, self.rows[(p, h)],
                                                          self.batches[p][:plan.batches], self.candidates,
                                                          self.device, self.autocast, self.head(h))
            self.spent += self.per_slot * self.layouts[p]["slots"] * plan.batches  # the density passes, as estimated
        timed = [k for k in timed if k[2] == "dense" or self.patches.get(k[:2])]
        skipped = [_name(k) for k in keys if k not in timed]
        self.say(f"--padding auto: timing {len(timed)} candidates, interleaved: 1 warm-up round and {plan.rounds} "
                 f"timed, {plan.batches} batch{'es' if plan.batches > 1 else ''} each"
                 + (f"; not timed (budget or no SEBP layer): {', '.join(skipped)}" if skipped else ""))
        return timed

    def unpatch(self) -> None:
        self.passes.unpatch_model(self.model)

    def replayed(self, timed: list[tuple]) -> None:
        """CUDA-graph replays: each layout and head as ``layout_ms`` captures them, no spread."""
        plan = self.plan
        for (p, h) in dict.fromkeys(k[:2] for k in timed):
            t0 = time.perf_counter()
            t = self.passes.layout_ms(self.model, self.batches[p][:plan.batches], self.layouts[p]["slots"],
                                      self.device, self.autocast, True, plan.rounds, self.patches.get((p, h)),
                                      self.unpatch, head=self.head(h))
            self.spent += (time.perf_counter() - t0) * 1e3
            self.rows[(p, h)].update({f"{m}_ms": round(ms, 3) for m, ms in t.items()})
            self.say(f"--padding auto: {_name((p, h, None))}: "
                     + ", ".join(f"{m} {ms:.1f} ms" for m, ms in t.items()))

    def one_round(self, key: tuple) -> list[float]:
        """Each of the candidate's batches once: ms per token slot."""
        p, h, m = key
        loss = self.head(h).loss
        times = []
        with self.passes.as_method(m, self.patches.get((p, h)), self.unpatch):
            for b in self.batches[p][:self.plan.batches]:
                ms = self.timer(key, b, lambda b=b: self.passes.timed_pass(self.model, b, self.device,
                                                                           self.autocast, loss))
                self.spent += ms
                times.append(ms / b["input_ids"].numel())
        return times

    def warm_up(self, timed: list[tuple]) -> tuple[list[tuple], dict]:
        """The warm-up round: each candidate, while the budget holds its estimate (scaled as those before it
        ran); then fewer candidates, as the prior orders, until a round fits. (those kept, key -> a round's ms)"""
        round_ms, scale = {}, 1.0
        for key in timed:
            est = self.per_slot * self.layouts[key[0]]["slots"] * self.plan.batches * scale
            if self.spent + est > self.budget_ms and len(round_ms) >= 2:
                self.not_timed(key)
                continue
            got = self.one_round(key)
            round_ms[key] = sum(t * b["input_ids"].numel() for t, b in zip(got, self.batches[key[0]]))
            scale = max(scale, round_ms[key] / est * scale)
        timed = list(round_ms)
        while len(timed) > 2 and self.spent + sum(round_ms[k] for k in timed) > self.budget_ms:
            self.not_timed(timed.pop())
        self.say(f"--padding auto: round 0/{self.plan.rounds} (warm-up) done, {self.spent / 1e3:.1f} s of "
                 f"{self.budget_ms / 1e3:.1f} s")
        return timed, round_ms

    def rounds(self, timed: list[tuple], round_ms: dict) -> dict[tuple, list[list[float]]]:
        """The timed rounds, while the budget holds one more: key -> each round's ms per token slot."""
        rounds = self.plan.rounds
        per_slot_ms: dict[tuple, list[list[float]]] = {k: [] for k in timed}
        for i in range(1, rounds + 1):
            if self.spent + sum(round_ms[k] for k in timed) > self.budget_ms:  # slower than the first pass said
                self.say(f"--padding auto: the budget is spent after {i - 1} of {rounds} timed rounds")
                break
            for key in timed:
                per_slot_ms[key].append(self.one_round(key))
            self.say(f"--padding auto: round {i}/{rounds} done, {self.spent / 1e3:.1f} s of "
                     f"{self.budget_ms / 1e3:.1f} s")
        return per_slot_ms

    def record(self, per_slot_ms: dict) -> dict:
        """Each candidate's median and spread into its row (untimed all, where the warm-up took the budget)."""
        if not all(per_slot_ms.values()):
            why = "the budget ran out in the warm-up round"
            for key in per_slot_ms:
                self.not_timed(key)
            self.say(f"--padding auto: {why}; the prior's pick, untimed")
            return self.done(untimed=why)
        for key, ts in per_slot_ms.items():
            med, lo, hi = estimate(ts, self.layouts[key[0]]["slots"])
            self.rows[key[:2]].update({f"{key[2]}_ms": round(med, 3),
                                       f"{key[2]}_spread": [round(lo, 3), round(hi, 3)]})
            self.say(f"--padding auto: {_name(key)}: {med:.1f} ms a batch (spread {lo:.1f}-{hi:.1f}, "
                     f"{len(ts)} rounds)")
        return self.done()


def time_eager(timing: EagerTiming, methods, heads, replays: bool, micro: int) -> dict:
    """Time the eager candidates ((layout, head, method), in the prior's order) the budget affords, in
    interleaved rounds: every candidate on each of its batches, one warm-up round, then the timed rounds; each
    candidate's median and spread (``{method}_ms``, ``{method}_spread``: median -/+ spread,
    :func:`~.layout_prior.estimate`) go into its row. The budget is ``cfg.calib_budget`` of the run's estimated
    time: the first pass (the prior's first candidate) x the run's ``micro`` batches; the warm-up round's own
    times then say how many timed rounds (and candidates) it holds. Returns what the choice records of it."""
    timing.keys = [(p, h, m) for p in timing.layouts for h in heads for m in methods]
    timing.first_pass(micro)
    timed = timing.planned()
    if timed is None:
        return timing.done()
    if replays:
        timing.replayed(timed)
        return timing.done()
    timed, round_ms = timing.warm_up(timed)
    return timing.record(timing.rounds(timed, round_ms))
