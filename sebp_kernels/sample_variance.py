"""The variance that sampled mode adds to dW, against the minibatch SGD variance: the rule of ``budget="auto"``
and the numbers of the exact-gradient guard (:mod:`.sampling`).

Row i of a linear's dW = dYᵀ X is the rank-one g_i = dY_i ⊗ X_i, with ||g_i||² = w_i² ||X_i||² (w_i = ||dY_i||).
Keeping row i with probability q_i and scaling it by 1/q_i (independent draws) adds to dW the variance (summed
over its elements)

    V_s = sum_i (1 / q_i - 1) w_i² ||X_i||²;  with q_i = min(1, w_i / c):  V_s(c) = sum_i ||X_i||² (c w_i - w_i²)₊

which grows with the cutoff c. The minibatch SGD variance is estimated from the same rows, each taken as one draw
of the data: V_sgd = sum_i ||g_i||² - ||G||² / n over the n non-zero rows (G = dW; rows of one sequence are not
independent, so this is a proxy, lower than the per-example variance where a sequence's rows agree). VCAS's
rule keeps the sampling variance under tau x V_sgd (tau = 0.025); here the cutoff solving V_s(c) = tau V_sgd
is found on the device from each backward's own norms, for the layer's next backward: the smallest keep ratio
under the variance budget, per layer, with no extra pass and no host sync.
"""
from __future__ import annotations

import torch

from .sample_buckets import bucket_sums, solve_variance


def _finite(w: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(w), w, torch.zeros_like(w)).float()


def sampling_variance(w: torch.Tensor, xn2: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """fp32 scalar: the variance V_s that keep probabilities ``q`` add to dW (rows of weight ``w`` = ||dY_i||,
    ``xn2`` = ||X_i||²; rows with q = 1 or w = 0 add nothing)."""
    w = _finite(w)
    return ((1.0 / q.float() - 1.0).clamp(min=0) * w * w * xn2.float()).sum()


def sgd_variance(w: torch.Tensor, xn2: torch.Tensor, g_sq: torch.Tensor) -> torch.Tensor:
    """fp32 scalar: the minibatch SGD variance proxy sum ||g_i||² - ||G||² / n (``g_sq`` = ||G||²), at least 0."""
    w = _finite(w)
    n = (w > 0).sum().clamp(min=1).float()
    return ((w * w * xn2.float()).sum() - g_sq.float() / n).clamp(min=0)


def solve_cutoff_for_variance(w: torch.Tensor, xn2: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """fp32 scalar cutoff c with V_s(c) <= ``target``, the largest up to a bucket's rows (one pass over the rows,
    :mod:`.sample_buckets`; V_s grows with c, so this is the smallest keep ratio under the target). 0 (keep every
    row) where the target is 0 or no row carries dW."""
    return solve_variance(*bucket_sums(w, xn2), target)


GUARD_FIELDS = ("cosine", "rel_error", "rel_variance", "rel_budget", "rel_expected", "kept_share")


def guard_numbers(dw: torch.Tensor, exact: torch.Tensor, w: torch.Tensor, xn2: torch.Tensor, q: torch.Tensor,
                  active: torch.Tensor, kept: torch.Tensor, var_tau: float) -> torch.Tensor:
    """fp32 (6,) on the device, in :data:`GUARD_FIELDS` order, for one backward whose sampled dW is ``dw`` and
    exact dW ``exact``: their cosine similarity, ||dw - exact|| / ||exact||, the measured relative variance
    ||dw - exact||² / ||exact||², the layer's budget tau x V_sgd / ||exact||², the expected V_s / ||exact||² of
    the probabilities ``q`` over the ``active`` rows, and the share of active rows ``kept``."""
    d, e = dw.float(), exact.float()
    e_sq = (e * e).sum()
    err_sq = ((d - e) ** 2).sum()
    cos = (d * e).sum() / ((d * d).sum().sqrt() * e_sq.sqrt()).clamp(min=1e-30)
    norm = e_sq.clamp(min=1e-30)
    qa = torch.where(active, q.float(), torch.ones_like(q.float()))
    budget = var_tau * sgd_variance(torch.where(active, w, torch.zeros_like(w)), xn2, e_sq)
    share = kept.sum().float() / active.sum().clamp(min=1).float()
    return torch.stack([torch.where(e_sq > 0, cos, torch.ones_like(cos)), (err_sq / norm).sqrt(), err_sq / norm,
                        budget / norm, sampling_variance(w, xn2, qa) / norm, share])
