"""Sampled mode's cutoff from one pass over a backward's row norms: a histogram on an eighth-of-an-octave grid,
then a closed-form solve inside the one bucket that holds the answer (no sort, no iteration over the rows).

Row i has the norm w_i = ||dY_i|| (positive and finite; other rows are left out) and, for the variance rule,
the weight x_i = ||X_i||². Its bucket is read from the bits of its fp32 norm: the key k_i = bits(w_i) >> 20
(the exponent and the top three bits of the mantissa), and bucket j = k_max - k_i, counted down from the largest
norm's key; the last bucket, ``BUCKETS - 1``, also holds every smaller norm. Bucket j's rows lie in
[E_j, E_{j-1}) with the edges E_j = float(k_max - j << 20) (exact fp32 values, so the torch and Triton versions
bucket every row alike), E_{-1} = float(k_max + 1 << 20) above every norm, and E = 0 for the last bucket.

Both rules are monotone in the cutoff c and exact at the edges, from the buckets' counts n_j and sums:

- fixed share (:func:`solve_share`): f(c) = sum_i min(1, w_i / c), the expected kept rows, falls with c;
  f(E_j) = (rows in buckets <= j) + (sum of w over buckets > j) / E_j. The answer is f(c) = target.
- variance (:func:`solve_variance`): V(c) = sum_i x_i (c w_i - w_i²)₊ grows with c; V(E_j) = E_j A_{>j} - B_{>j}
  with A = sum x w and B = sum x w². The answer is the largest c with V(c) <= target.

Above E_{-1} both are closed forms (every row is sampled). Inside the bucket J whose edges bracket the target,
the bucket's rows are taken at their lower edge E_J for the share (each then counts min(1, E_J / c) <= its
min(1, w / c)) and as adding A_J (c - E_J) to the variance (>= their x w (c - w)₊): the cutoff solved from these
bounds keeps an expected share at least the target, and a variance at most the target, and is off by at most the
spread of one bucket's rows (widths of 1/8 to 1/16 of their norm). Any cutoff keeps the estimate unbiased; only
the budget's accuracy depends on it.
"""
from __future__ import annotations

import torch

BUCKETS = 256  # 32 octaves below the largest norm, 8 buckets an octave
SHIFT = 20  # fp32 bits dropped from a norm's key: 23 mantissa bits less the 3 kept


def _keys(v: torch.Tensor) -> torch.Tensor:
    return v.float().contiguous().view(torch.int32) >> SHIFT


def bucket_sums(w: torch.Tensor, x: torch.Tensor | None):
    """(k_max, counts, sums) of the rows with a positive finite norm ``w``: the largest norm's key (an int32
    scalar; 0 where there is none) and fp32 (BUCKETS,) per-bucket counts and sums: of w (``x`` None) or of
    x w and x w² (a (2, BUCKETS) tensor)."""
    w = w.float()
    pos = torch.isfinite(w) & (w > 0)
    wf = torch.where(pos, w, torch.zeros_like(w))
    k_max = _keys(wf.max() if w.numel() else w.new_zeros(()))
    j = (k_max - _keys(wf)).clamp(0, BUCKETS - 1).long()
    ones = pos.float()
    counts = torch.zeros(BUCKETS, device=w.device).index_add_(0, j, ones)
    if x is None:
        return k_max, counts, torch.zeros(BUCKETS, device=w.device).index_add_(0, j, wf)
    xw = torch.where(pos, x.float() * wf, torch.zeros_like(wf))
    sums = torch.zeros(2, BUCKETS, device=w.device).index_add_(1, j, torch.stack((xw, xw * wf)))
    return k_max, counts, sums


def _under(s: torch.Tensor) -> torch.Tensor:
    """The sums over the buckets after each (a reverse cumulative sum less the bucket's own: no cancellation
    against the total)."""
    return s.flip(0).cumsum(0).flip(0) - s


def edges(k_max: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (BUCKETS,) lower edges E_j and upper edges E_{j-1} of the buckets under ``k_max``."""
    j = torch.arange(BUCKETS, device=device, dtype=torch.int32)
    keys = k_max - j
    lo = torch.where((keys > 0) & (j < BUCKETS - 1), keys << SHIFT, torch.zeros_like(keys)).view(torch.float32)
    hi = torch.where(keys + 1 > 0, (keys + 1) << SHIFT, torch.zeros_like(keys)).view(torch.float32)
    return lo, hi


def solve_share(k_max: torch.Tensor, counts: torch.Tensor, sums: torch.Tensor, budget: float) -> torch.Tensor:
    """fp32 scalar cutoff whose expected kept share of the rows counted is at least ``budget`` (the module
    docstring); 0 at budget 1 or where no row is counted."""
    lo, hi = edges(k_max, counts.device)
    n = counts.sum()
    target = n * budget
    total = sums.sum()
    above = counts.cumsum(0)  # rows at or above E_j
    below = _under(sums)  # sum of w under E_j
    f = above + torch.where(lo > 0, below / lo.clamp(min=1e-30), torch.zeros_like(below))
    j = torch.arange(BUCKETS, device=counts.device)
    big = torch.full_like(j, BUCKETS - 1)
    jj = torch.where(f >= target, j, big).min()
    above_prev = torch.where(jj > 0, above.gather(0, (jj - 1).clamp(min=0)[None])[0], torch.zeros_like(n))
    c = (below[jj] + counts[jj] * lo[jj]) / (target - above_prev).clamp(min=1e-30)
    c = torch.minimum(torch.maximum(c, lo[jj]), hi[jj])
    top = total / target.clamp(min=1e-30)  # every row sampled: f(c) = total / c, where that is above E_{-1}
    c = torch.where(top >= hi[0], top, c)
    return torch.where((target > 0) & (budget < 1.0), c, torch.zeros_like(c))


def solve_variance(k_max: torch.Tensor, counts: torch.Tensor, sums: torch.Tensor,
                   target: torch.Tensor) -> torch.Tensor:
    """fp32 scalar: the cutoff with V(c) at most ``target`` (the module docstring; ``sums``: (2, BUCKETS) of
    x w and x w²); 0 (keep every row) where the target is 0 or no row carries a gradient."""
    lo, hi = edges(k_max, counts.device)
    a, b = sums[0], sums[1]
    a_all, b_all = a.sum(), b.sum()
    a_below, b_below = _under(a), _under(b)
    v = lo * a_below - b_below
    j = torch.arange(BUCKETS, device=counts.device)
    jj = torch.where(v <= target, j, torch.full_like(j, BUCKETS - 1)).min()
    c = (target + b_below[jj] + a[jj] * lo[jj]) / (a_below[jj] + a[jj]).clamp(min=1e-30)
    c = torch.minimum(torch.maximum(c, lo[jj]), hi[jj])
    top = (target + b_all) / a_all.clamp(min=1e-30)  # every row sampled: V(c) = c A - B
    c = torch.where(top >= hi[0], top, c)
    return torch.where((target > 0) & (a_all > 0), c, torch.zeros_like(c))
