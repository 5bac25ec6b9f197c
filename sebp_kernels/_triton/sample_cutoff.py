"""Sampled mode's cutoff update in one launch: :mod:`sebp_kernels.sample_buckets` (the fixed share's rule and the
variance rule of ``budget="auto"``, with the sums that set their targets) on the device, writing the layer's
cutoff in place.

Each program reads the largest norm (from the flags pass's per-block maxima), builds the bucket histogram of
its share of the rows (a one-hot sum over 256 buckets) and stores it as a partial; the last program to take a
ticket adds the partials in program order (a result that depends only on the data) and solves the rule in
closed form. The sums run in another order than torch's, and a row whose norm sits on a bucket's edge is
bucketed alike (the keys are the norms' bits), so the cutoff differs from the reference's in its last bits only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..sample_buckets import BUCKETS, SHIFT
from .dw import _tickets
from .launch import FastLaunch
from .select import _sm_count
from .tuning import cdiv


@triton.jit
def _finite(w_ptr, rows, m):
    """The norms of ``rows`` (0 where ``m`` is off), a non-finite one as 0, as the torch rules take them."""
    w = tl.load(w_ptr + rows, mask=m, other=0.0)
    return tl.where((w == w) & (w < float("inf")), w, 0.0)


@triton.jit
def _at(v, j, jj):
    """v[jj] of a bucket vector (0 where jj is outside)."""
    return tl.sum(tl.where(j == jj, v, 0.0), axis=0)


@triton.jit
def _under(v):
    """The sums over the buckets after each (as :func:`sebp_kernels.sample_buckets._under`)."""
    return tl.cumsum(v, axis=0, reverse=True) - v


@triton.jit(do_not_specialize=["M", "P", "N_WMAX"])
def _cutoff_kernel(
    w_ptr, xn2_ptr, q_ptr, wmax_ptr, dw_norm_ptr, tau_ptr, part_ptr, ticket_ptr, M, P, N_WMAX, budget, var_tau,
    AUTO: tl.constexpr, HAS_DW: tl.constexpr, B: tl.constexpr, SHIFT: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_MAX: tl.constexpr, BLOCK_P: tl.constexpr,
):
    pid = tl.program_id(0)
    j = tl.arange(0, B)
    # the largest finite norm, and its key
    top = tl.zeros([BLOCK_MAX], dtype=tl.float32)
    for s in range(0, N_WMAX, BLOCK_MAX):
        idx = s + tl.arange(0, BLOCK_MAX)
        top = tl.maximum(top, _finite(wmax_ptr, idx, idx < N_WMAX))
    k_max = tl.max(top, axis=0).to(tl.int32, bitcast=True) >> SHIFT
    # this program's histogram: counts, and sums of w (a fixed share) or of x w and x w² (auto)
    cnt = tl.zeros([B], dtype=tl.float32)
    h1 = tl.zeros([B], dtype=tl.float32)
    h2 = tl.zeros([B], dtype=tl.float32)
    s_v = tl.sum(tl.zeros([CHUNK], dtype=tl.float32), axis=0)
    for c0 in range(pid * CHUNK, M, P * CHUNK):
        rows = c0 + tl.arange(0, CHUNK)
        m = rows < M
        w = _finite(w_ptr, rows, m)
        jr = tl.minimum(tl.maximum(k_max - (w.to(tl.int32, bitcast=True) >> SHIFT), 0), B - 1)
        hot = (jr[:, None] == j[None, :]) & (w > 0)[:, None]
        cnt += tl.sum(hot.to(tl.float32), axis=0)
        if AUTO:
            xw = tl.load(xn2_ptr + rows, mask=m, other=0.0) * w
            h1 += tl.sum(tl.where(hot, xw[:, None], 0.0), axis=0)
            h2 += tl.sum(tl.where(hot, (xw * w)[:, None], 0.0), axis=0)
            q = tl.load(q_ptr + rows, mask=m, other=1.0)
            s_v += tl.sum(tl.maximum(1.0 / q - 1.0, 0.0) * xw * w, axis=0)
        else:
            h1 += tl.sum(tl.where(hot, w[:, None], 0.0), axis=0)
    base = part_ptr + pid * (4 * B)
    tl.store(base + j, cnt)
    tl.store(base + B + j, h1)
    tl.store(base + 2 * B + j, h2)
    tl.store(base + 3 * B + j, tl.where(j == 0, s_v, 0.0))
    # release our partial, acquire everyone else's; the last to arrive solves
    if tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == P - 1:
        cnt = tl.zeros([B], dtype=tl.float32)
        h1 = tl.zeros([B], dtype=tl.float32)
        h2 = tl.zeros([B], dtype=tl.float32)
        s_v = tl.sum(tl.zeros([B], dtype=tl.float32), axis=0)
        for p0 in range(0, P, BLOCK_P):
            ps = p0 + tl.arange(0, BLOCK_P)
            offs = ps[:, None] * (4 * B) + j[None, :]
            pm = (ps < P)[:, None]
            cnt += tl.sum(tl.load(part_ptr + offs, mask=pm, other=0.0, cache_modifier=".cg"), axis=0)
            h1 += tl.sum(tl.load(part_ptr + B + offs, mask=pm, other=0.0, cache_modifier=".cg"), axis=0)
            h2 += tl.sum(tl.load(part_ptr + 2 * B + offs, mask=pm, other=0.0, cache_modifier=".cg"), axis=0)
            s_v += tl.sum(tl.sum(tl.load(part_ptr + 3 * B + offs, mask=pm, other=0.0, cache_modifier=".cg"),
                                 axis=1), axis=0)
        keys = k_max - j
        lo = tl.where((keys > 0) & (j < B - 1), keys << SHIFT, 0).to(tl.float32, bitcast=True)
        hi = tl.where(keys + 1 > 0, (keys + 1) << SHIFT, 0).to(tl.float32, bitcast=True)
        hi0 = ((k_max + 1) << SHIFT).to(tl.float32, bitcast=True)
        if AUTO:
            a_all = tl.sum(h1, axis=0)
            b_all = tl.sum(h2, axis=0)
            g_sq = 0.0
            if HAS_DW:  # ||G||² from the sample: E||dW||² = ||G||² + V_s
                dwn = tl.load(dw_norm_ptr)
                g_sq = dwn * dwn - s_v
            n = tl.maximum(tl.sum(cnt, axis=0), 1.0)
            target = var_tau * tl.maximum(b_all - tl.div_rn(g_sq, n), 0.0)
            a_below = _under(h1)
            b_below = _under(h2)
            v = lo * a_below - b_below
            jj = tl.min(tl.where(v <= target, j, B - 1), axis=0)
            lo_j = _at(lo, j, jj)
            a_j = _at(h1, j, jj)
            c = tl.div_rn(target + _at(b_below, j, jj) + a_j * lo_j,
                          tl.maximum(_at(a_below, j, jj) + a_j, 1e-30))
            c = tl.minimum(tl.maximum(c, lo_j), _at(hi, j, jj))
            top_c = tl.div_rn(target + b_all, tl.maximum(a_all, 1e-30))
            c = tl.where(top_c >= hi0, top_c, c)
            tau = tl.where((target > 0) & (a_all > 0), c, 0.0)
        else:
            target = tl.sum(cnt, axis=0) * budget
            total = tl.sum(h1, axis=0)
            above = tl.cumsum(cnt, axis=0)
            below = _under(h1)
            f = above + tl.where(lo > 0, tl.div_rn(below, tl.maximum(lo, 1e-30)), 0.0)
            jj = tl.min(tl.where(f >= target, j, B - 1), axis=0)
            lo_j = _at(lo, j, jj)
            c = tl.div_rn(_at(below, j, jj) + _at(cnt, j, jj) * lo_j,
                          tl.maximum(target - _at(above, j, jj - 1), 1e-30))
            c = tl.minimum(tl.maximum(c, lo_j), _at(hi, j, jj))
            top_c = tl.div_rn(total, tl.maximum(target, 1e-30))
            c = tl.where(top_c >= hi0, top_c, c)
            tau = tl.where((target > 0) & (budget < 1.0), c, 0.0)
        tl.store(tau_ptr, tau)
        tl.atomic_xchg(ticket_ptr, 0)  # for the next launch (and graph replay)


_cutoff = FastLaunch(_cutoff_kernel)


def update_cutoff_device(tau: torch.Tensor, w: torch.Tensor, q: torch.Tensor, xn2: torch.Tensor | None,
                         dw: torch.Tensor | None, share: float, var_tau: float, interpret: bool = False,
                         wmax: torch.Tensor | None = None) -> None:
    """Write into ``tau`` (the layer's fp32 cutoff, a device scalar) the cutoff of its next backward from this
    backward's row norms ``w`` and keep probabilities ``q``: with ``xn2`` (||X_i||², ``budget="auto"``) the
    variance rule under ``var_tau`` (``dw``: the sampled dW, None where not computed), else the fixed ``share``.
    ``wmax``: fp32 values whose largest finite one is the largest finite norm (the flags pass's per-block
    maxima; ``w`` itself by default). One launch (two with ``dw``: its norm), no host sync."""
    auto = xn2 is not None
    m = w.shape[0]
    dev = w.device
    dw_norm = torch.linalg.vector_norm(dw, dtype=torch.float32) if auto and dw is not None else tau
    chunk = 16 if interpret else 64
    programs = max(1, min(cdiv(m, chunk), 4 if interpret else max(16, _sm_count(dev) // 2)))
    part = torch.empty(programs * 4 * BUCKETS, dtype=torch.float32, device=dev)
    wmax = w if wmax is None else wmax
    _cutoff[(programs,)](w, xn2 if auto else w, q, wmax, dw_norm, tau, part, _tickets(dev, 1), m, programs,
                         wmax.shape[0], float(share), float(var_tau), AUTO=auto, HAS_DW=auto and dw is not None,
                         B=BUCKETS, SHIFT=SHIFT, CHUNK=chunk, BLOCK_MAX=64 if interpret else 1024, BLOCK_P=4,
                         num_warps=1 if interpret else 4)
