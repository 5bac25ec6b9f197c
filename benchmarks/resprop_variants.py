"""Ablations of ReSprop for the CPU experiment: is the quality lost at high reuse the fault of P, or of
dropping rows at all?

The product's ReSprop (``sebp_kernels.resprop``) reuses P = the previous step's dL/dY of one sample and keeps
the rows of D = dY - P with the largest norms. Each variant here changes one of those two choices, for the
duration of a ``with variant(name):`` block (it swaps the module's functions, which the backward looks up at
call time; the product itself has no such option):

- ``sample``: the product's rule (no change).
- ``mean``: P = the previous step's dL/dY averaged over the samples at each position (active rows only).
- ``fitted``: the product's P scaled by alpha, the least-squares fit of P to this step's dY over the active
  rows, clipped to [0, 1] (alpha = 0 where P does not predict dY: the variant then reduces to ``none``).
- ``none``: P = 0: no reuse, the kept rows are the largest rows of dY itself (SEBP's top-k rows).
- ``sampled``: P = 0, and the kept rows are drawn with probabilities proportional to their norms (about the
  same expected count), each scaled by 1 / its probability: an unbiased estimate of dY (dropout-like noise
  instead of a bias).
"""
from __future__ import annotations

import contextlib
import math

import torch

import sebp_kernels.resprop as R

VARIANTS = ("sample", "mean", "fitted", "none", "sampled")


def mean_source(dy: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
    """P (T, out): dL/dY (B, T, out) averaged over the samples active at each position; non-finite rows 0."""
    active = dy.any(-1) if active is None else active
    a = active.unsqueeze(-1).to(dy.dtype)
    p = (dy * a).sum(0) / a.sum(0).clamp_min(1)
    return p.masked_fill(~torch.isfinite(p).all(-1, keepdim=True), 0)


def zero_source(dy: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
    return torch.zeros_like(dy[0])


def fit_scale(dy: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """alpha in [0, 1] minimising ||dY - alpha P|| over the active rows of dY (*, T, out) (0-d tensor)."""
    t = dy.shape[-2]
    dy3 = dy.reshape(-1, t, dy.shape[-1]).float()
    pa = R.align(p, t).float() * dy3.any(-1, keepdim=True)
    num, den = (dy3 * pa).sum(), pa.square().sum()
    alpha = torch.where(den > 0, num / den.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return torch.nan_to_num(alpha, nan=0.0).clamp(0, 1)


def sampled_keep(generator: torch.Generator):
    """A ``keep_mask`` replacement: row i kept with probability q_i = min(1, c s_i) (s_i its norm, c set so
    that the q_i add up to the kept count), its D scaled by 1 / q_i in place; non-finite rows always kept."""
    def keep_mask(d2: torch.Tensor, active: torch.Tensor, reuse: float) -> torch.Tensor:
        scores = R.row_norms(d2)  # ranked as keep_mask ranks: +inf non-finite, -1 inactive
        scores = scores.masked_fill(~torch.isfinite(scores), math.inf).masked_fill(~active, -1.0)
        finite = torch.isfinite(scores)
        s = scores.clamp_min(0).masked_fill(~finite, 0)
        k = R.kept_count(reuse, active).to(torch.float32)
        capped = torch.zeros_like(s, dtype=torch.bool)
        for _ in range(8):  # water-filling: rows whose share would pass 1 are kept for sure
            free = s.masked_fill(capped, 0)
            q = torch.where(capped, 1.0, free * (k - capped.sum()).clamp_min(0) / free.sum().clamp_min(1e-30))
            capped = q >= 1
        q = q.clamp(0, 1)
        draw = torch.rand(q.shape, generator=generator).to(q.device)
        keep = (draw < q) & active | ~finite
        scale = torch.where(keep & finite, 1 / q.clamp_min(1e-12), torch.ones_like(q))
        d2.mul_(scale.to(d2.dtype).unsqueeze(1))
        return keep
    return keep_mask


@contextlib.contextmanager
def variant(name: str, seed: int = 0):
    """Run ReSprop under variant ``name`` (see the module docstring) inside the block."""
    if name not in VARIANTS:
        raise ValueError(f"unknown ReSprop variant {name!r}; choose one of {', '.join(VARIANTS)}")
    saved = {k: getattr(R, k) for k in ("reuse_source", "keep_mask", "resprop_grads")}
    grads = saved["resprop_grads"]

    def fitted_grads(dy, x, weight, p, reuse, *args, **kwargs):
        if p is not None:
            p = p * fit_scale(dy, p).to(p.dtype)
        return grads(dy, x, weight, p, reuse, *args, **kwargs)

    if name == "mean":
        R.reuse_source = mean_source
    elif name == "fitted":
        R.resprop_grads = fitted_grads
    elif name in ("none", "sampled"):
        R.reuse_source = zero_source
    if name == "sampled":
        R.keep_mask = sampled_keep(torch.Generator().manual_seed(seed))
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(R, k, v)


def parse(level: str) -> tuple[str, str]:
    """'0.9' -> ('0.9', 'sample'); '0.9:none' -> ('0.9', 'none'); 'dense' -> ('dense', 'sample')."""
    reuse, _, name = level.partition(":")
    name = name or "sample"
    if name not in VARIANTS:
        raise SystemExit(f"unknown ReSprop variant {name!r} in {level!r}; choose one of {', '.join(VARIANTS)}")
    if reuse != "dense" and not (reuse.replace(".", "", 1).isdigit() and 0 <= float(reuse) <= 1):
        raise SystemExit(f"a level is 'dense' or a reuse in [0, 1] (optionally ':variant'), got {level!r}")
    if reuse == "dense" and name != "sample":
        raise SystemExit(f"dense has no variant, got {level!r}")
    return reuse, name


__all__ = ["VARIANTS", "fit_scale", "mean_source", "parse", "sampled_keep", "variant", "zero_source"]
