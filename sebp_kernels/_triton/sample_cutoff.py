"""Sampled mode's cutoff update in one launch: the grid bisections of :func:`sebp_kernels.sampling.solve_tau`
(a fixed share) and :func:`sebp_kernels.sample_variance.solve_cutoff_for_variance` (``budget="auto"``), with
the sums that set their targets, in a single program that writes the layer's cutoff in place.

The torch versions launch some 60 small kernels a backward (a few per round of the bisection); one program
walking the row norms (a few KB, held in L2) for every round costs one launch. The rounds, candidates and
comparisons are the torch versions'; the sums run in another order and ``w / c`` is taken as ``w * (1 / c)``,
so the cutoff may differ from the reference's in its last bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import FastLaunch

GRID = 16  # candidates a round, as the torch versions


@triton.jit
def _pick(lo, cand, idx, G: tl.constexpr):
    """(ext[idx], ext[min(idx + 1, G)]) of ext = [lo, cand...]: the next interval of the bisection."""
    g = tl.arange(0, G)
    new_lo = tl.where(idx == 0, lo, tl.sum(tl.where(g == idx - 1, cand, 0.0), axis=0))
    new_hi = tl.sum(tl.where(g == tl.minimum(idx + 1, G) - 1, cand, 0.0), axis=0)
    return new_lo, new_hi


@triton.jit
def _finite(w_ptr, rows, m):
    """The norms of ``rows`` (0 where ``m`` is off), a non-finite one as 0, as the torch rules take them."""
    w = tl.load(w_ptr + rows, mask=m, other=0.0)
    return tl.where((w == w) & (w < float("inf")), w, 0.0)


@triton.jit(do_not_specialize=["M"])
def _cutoff_kernel(
    w_ptr, xn2_ptr, q_ptr, dw_norm_ptr, tau_ptr, M, budget, var_tau,
    AUTO: tl.constexpr, HAS_DW: tl.constexpr, ROUNDS: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    steps = (tl.arange(0, G) + 1).to(tl.float32) * (1.0 / G)  # exact: G is a power of two
    # Pass 0: the sums that set the target and the first interval (non-finite norms count as 0).
    zero = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), axis=0)
    n_pos, s_w, s1, s2, s_v = zero, zero, zero, zero, zero
    for c0 in range(0, M, BLOCK):
        rows = c0 + offs
        m = rows < M
        w = _finite(w_ptr, rows, m)
        n_pos += tl.sum((w > 0).to(tl.float32), axis=0)
        if AUTO:
            xn2 = tl.load(xn2_ptr + rows, mask=m, other=0.0)
            q = tl.load(q_ptr + rows, mask=m, other=1.0)
            a = w * w * xn2
            s1 += tl.sum(w * xn2, axis=0)
            s2 += tl.sum(a, axis=0)
            s_v += tl.sum(tl.maximum(1.0 / q - 1.0, 0.0) * a, axis=0)
        else:
            s_w += tl.sum(w, axis=0)
    lo = zero
    if AUTO:
        g_sq = zero
        if HAS_DW:  # ||G||² from the sample: E||dW||² = ||G||² + V_s
            dwn = tl.load(dw_norm_ptr)
            g_sq = dwn * dwn - s_v
        target = var_tau * tl.maximum(s2 - g_sq / tl.maximum(n_pos, 1.0), 0.0)
        hi = (target + s2) / tl.maximum(s1, 1e-30)
        for _ in tl.static_range(ROUNDS):
            cand = lo + (hi - lo) * steps
            var = tl.zeros([G], dtype=tl.float32)
            for c0 in range(0, M, BLOCK):
                rows = c0 + offs
                m = rows < M
                w = _finite(w_ptr, rows, m)
                xn2 = tl.load(xn2_ptr + rows, mask=m, other=0.0)
                d = cand[:, None] * w[None, :] - (w * w)[None, :]
                var += tl.sum(xn2[None, :] * tl.where(d > 0, d, 0.0), axis=1)
            lo, hi = _pick(lo, cand, tl.sum((var <= target).to(tl.int32), axis=0), G)
        tau = tl.where((target > 0) & (s1 > 0), lo, 0.0)
    else:
        target = n_pos * budget
        hi = s_w / tl.maximum(target, 1.0)
        for _ in tl.static_range(ROUNDS):
            cand = lo + (hi - lo) * steps
            r = 1.0 / cand
            share = tl.zeros([G], dtype=tl.float32)
            for c0 in range(0, M, BLOCK):
                rows = c0 + offs
                m = rows < M
                w = _finite(w_ptr, rows, m)
                t = w[None, :] * r[:, None]
                t = tl.where(t == t, tl.minimum(t, 1.0), 1.0)  # 0 / 0: NaN, counted as 1 as torch's nan_to_num
                share += tl.sum(tl.where(m[None, :], t, 0.0), axis=1)
            lo, hi = _pick(lo, cand, tl.sum((share >= target).to(tl.int32), axis=0), G)
        tau = tl.where((target > 0) & (budget < 1.0), lo, 0.0)
    tl.store(tau_ptr, tau)


_cutoff = FastLaunch(_cutoff_kernel)


def update_cutoff_device(tau: torch.Tensor, w: torch.Tensor, q: torch.Tensor, xn2: torch.Tensor | None,
                         dw: torch.Tensor | None, share: float, var_tau: float, interpret: bool = False) -> None:
    """Write into ``tau`` (the layer's fp32 cutoff, a device scalar) the cutoff of its next backward from this
    backward's row norms ``w`` and keep probabilities ``q``: with ``xn2`` (||X_i||², ``budget="auto"``) the
    variance rule under ``var_tau`` (``dw``: the sampled dW, None where not computed), else the fixed ``share``.
    One launch, no host sync."""
    auto = xn2 is not None
    dw_norm = torch.linalg.vector_norm(dw, dtype=torch.float32) if auto and dw is not None else tau
    _cutoff[(1,)](w, xn2 if auto else w, q, dw_norm, tau, w.shape[0], float(share), float(var_tau), AUTO=auto,
                  HAS_DW=auto and dw is not None, ROUNDS=5 if auto else 4, G=GRID, BLOCK=256 if interpret else 512,
                  num_warps=1 if interpret else 8)
