"""dX = dY @ W over the active rows, zeros elsewhere, in one kernel.

The grid covers the worst case (all M rows). Program tile ``pid_m`` covers positions
``[pid_m * BLOCK_M, (pid_m + 1) * BLOCK_M)`` of the row permutation from the select pass. Tiles wholly past
the device-side count ``k`` hold inactive rows: they store zeros into those rows of dX and do no GEMM work;
a tile that straddles ``k`` loads its inactive rows as zeros, so they come out zero too. Every row of dX is
written exactly once, so dX needs no memset.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import FastLaunch
from .tiles import grouped_tile
from .tuning import cdiv, gemm_config


@triton.jit
def _dx_tile(
    dy_ptr, w_ptr, dx_ptr, perm_ptr, count, pid,
    M, N, K,
    stride_dym, stride_dyk, stride_wk, stride_wn, stride_dxm, stride_dxn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, IEEE: tl.constexpr, BIG: tl.constexpr, STAGES: tl.constexpr,
):
    """Output tile ``pid`` of dX (also called by the fused gradient kernel); STAGES: software-pipeline depth
    of its main loop (the fused kernel's other roles keep the launch's num_stages)."""
    # M rows of dY/dX, N = in_features, K = out_features.
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pos = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    in_m = pos < M
    rows = tl.load(perm_ptr + pos, mask=in_m, other=0)
    if BIG:
        rows = rows.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_mask = in_m[:, None] & (offs_n < N)[None, :]
    out_ptrs = dx_ptr + rows[:, None] * stride_dxm + offs_n[None, :] * stride_dxn
    if pid_m * BLOCK_M >= count:
        tl.store(out_ptrs, tl.zeros([BLOCK_M, BLOCK_N], dtype=dx_ptr.dtype.element_ty), mask=out_mask)
    else:
        active = pos < count
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = dy_ptr + rows[:, None] * stride_dym + offs_k[None, :] * stride_dyk
        b_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
        n_mask = (offs_n < N)[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if IEEE:
            # fp32: a two-level sum over blocks of 8 x BLOCK_K (see the dW kernel), pointers from k.
            for k0 in range(0, K, 8 * BLOCK_K):
                part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for k1 in range(k0, tl.minimum(k0 + 8 * BLOCK_K, K), BLOCK_K):
                    k_in = (k1 + offs_k) < K
                    a = tl.load(a_ptrs + k1 * stride_dyk, mask=active[:, None] & k_in[None, :], other=0.0)
                    b = tl.load(b_ptrs + k1 * stride_wk, mask=k_in[:, None] & n_mask, other=0.0)
                    part = tl.dot(a, b, part, input_precision="ieee")
                acc += part
        else:
            for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=active[:, None], other=0.0)
                    b = tl.load(b_ptrs, mask=n_mask, other=0.0)
                else:
                    k_in = (k0 + offs_k) < K
                    a = tl.load(a_ptrs, mask=active[:, None] & k_in[None, :], other=0.0)
                    b = tl.load(b_ptrs, mask=k_in[:, None] & n_mask, other=0.0)
                acc = tl.dot(a, b, acc)
                a_ptrs += BLOCK_K * stride_dyk
                b_ptrs += BLOCK_K * stride_wk
        tl.store(out_ptrs, acc.to(dx_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _dx_kernel(
    dy_ptr, w_ptr, dx_ptr, perm_ptr, count_ptr,
    M, N, K,
    stride_dym, stride_dyk, stride_wk, stride_wn, stride_dxm, stride_dxn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, IEEE: tl.constexpr, BIG: tl.constexpr, STAGES: tl.constexpr,
):
    _dx_tile(dy_ptr, w_ptr, dx_ptr, perm_ptr, tl.load(count_ptr), tl.program_id(0), M, N, K,
             stride_dym, stride_dyk, stride_wk, stride_wn, stride_dxm, stride_dxn,
             BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K, IEEE, BIG, STAGES)


_dx = FastLaunch(_dx_kernel)


def dx_rows(dy: torch.Tensor, weight: torch.Tensor, perm: torch.Tensor, count: torch.Tensor,
            interpret: bool = False, ieee: bool = True) -> torch.Tensor:
    """dX (M, in) = dY[perm[:k]] @ W scattered to rows perm[:k], zeros on the other rows."""
    m, k_dim = dy.shape
    n = weight.shape[1]
    dx = torch.empty((m, n), dtype=dy.dtype, device=dy.device)
    cfg = gemm_config("dx", dy.dtype, interpret)
    grid = (cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]),)
    big = max(dy.stride(0), dx.stride(0)) * m >= 2**31
    _dx[grid](dy, weight, dx, perm, count, m, n, k_dim,
                     dy.stride(0), dy.stride(1), weight.stride(0), weight.stride(1), dx.stride(0), dx.stride(1),
                     EVEN_K=k_dim % cfg["BLOCK_K"] == 0, IEEE=ieee, BIG=big, STAGES=cfg.get("num_stages", 1), **cfg)
    return dx
