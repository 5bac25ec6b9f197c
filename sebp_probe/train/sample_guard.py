"""``finetune --mode sampled --guard-every K``: the exact-gradient guard of sampled mode.

The first sampled step (after ``--sample-warmup``) and every Kth step after it, each sampled linear's first
backward of the step also computes the exact dW over the non-zero rows (one more GEMM on that step), and the
step's record in metrics.jsonl (``type: sample_guard``) gives, per layer, the cosine similarity and relative error
of the sampled dW against it, its measured relative variance ||dW_s - dW||² / ||dW||², the layer's variance
budget (``variance_tau`` x the SGD variance proxy of :mod:`sebp_kernels.sample_variance`, over ||dW||²) and the
share of non-zero rows kept. A layer whose measured relative variance is over ``MARGIN`` x its budget gets a
larger keep ratio from its next backward on: a fixed budget's share x ``RAISE`` for that layer (at most 1), or,
under ``--budget auto``, half its variance budget. The margin is the noise of one draw: the measured value
scatters around its expectation, the budget.
"""
from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator

import torch

from sebp_kernels.sample_variance import GUARD_FIELDS

from ..model.sampled import sampled_layers

MARGIN = 2.0
RAISE = 1.5


class SampleGuard:
    """The guard of one run: ``every`` None, or a model without sampled layers, checks nothing. ``warmup``:
    the optimizer steps before sampling starts (the first check is the step after them)."""

    def __init__(self, every: int | None, warmup: int, model: torch.nn.Module):
        self.every, self.warmup = every, warmup
        self.layers = sampled_layers(model) if every else {}

    def due(self, step: int) -> bool:
        """Is optimizer step ``step`` (1-based) checked?"""
        return bool(self.layers) and step > self.warmup and (step - self.warmup - 1) % self.every == 0

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around a step's micro-batches: arms every sampled layer on a checked step."""
        if self.due(step):
            for m in self.layers.values():
                m._sebp_sampler.armed = True
        yield

    def take(self, step: int) -> dict | None:
        """The record of the checked step just run (None on other steps), after raising the keep ratio of the
        layers over their budget."""
        if not self.due(step):
            return None
        layers = {}
        for name, m in self.layers.items():
            s = m._sebp_sampler
            s.armed = False
            if s.guard is None:  # no backward with dW this step (frozen, or not reached)
                continue
            rec = dict(zip(GUARD_FIELDS, s.guard.tolist()))
            s.guard = None
            rec["over"] = rec["rel_variance"] > MARGIN * rec["rel_budget"]
            if rec["over"]:
                rec["raised_to"] = _raise(m)
            layers[name] = rec
        return {"type": "sample_guard", "step": step, "layers": layers}


def _raise(m) -> dict:
    """A larger keep ratio for layer ``m`` (see the module docstring); the cutoff is solved afresh from its next
    backward's rows, so the raise takes effect at once."""
    s, cfg = m._sebp_sampler, m.sebp_config
    s.tau = None
    if cfg.budget == "auto":
        s.var_tau = 0.5 * (cfg.variance_tau if s.var_tau is None else s.var_tau)
        return {"var_tau": s.var_tau}
    s.share = min(1.0, RAISE * (float(cfg.budget) if s.share is None else s.share))
    return {"share": s.share}


def guard_summary(records: list[dict], every: int | None) -> dict | None:
    """summary.json's ``sampled.guard``: the checks, the worst cosine, the median relative error and each layer's
    raises (None without a check)."""
    checks = [r for r in records if r.get("type") == "sample_guard"]
    if not checks:
        return None
    per = [v for r in checks for v in r["layers"].values()]
    raised: dict[str, int] = {}
    for r in checks:
        for name, v in r["layers"].items():
            if v["over"]:
                raised[name] = raised.get(name, 0) + 1
    return {"every": every, "checks": len(checks), "steps": [r["step"] for r in checks],
            "min_cosine": min((v["cosine"] for v in per), default=None),
            "median_cosine": statistics.median(v["cosine"] for v in per) if per else None,
            "median_rel_error": statistics.median(v["rel_error"] for v in per) if per else None,
            "over_budget": sum(v["over"] for v in per), "layer_checks": len(per), "raised": raised}
