"""dW = dY[active]ᵀ X[active] and db = dY[active].sum(0), reducing over the gathered rows in fp32.

dW: each program owns an (out, in) tile and walks a contiguous range of the compacted row list. When the
tiles alone cannot fill the GPU (small layers), the rows are split over up to ``SPLIT`` programs per tile
(``SPLIT`` is chosen on the host for the worst case, all M rows). A split's range is
``chunk = max(ceil(k / SPLIT), MIN_CHUNK)`` rows (rounded to ``ROW_ALIGN``), computed on the device from the
device-side count k, so few rows use few splits and a single split writes dW directly. With several
splits, each writes an fp32 partial and takes a ticket from a per-tile counter; the last to arrive adds the
partials in split order (so the result depends only on the data, never on timing), writes dW and resets the
counter. One launch, no reduce pass.

The permutation lists the active rows in increasing order, so a range whose two ends are as far apart as its
length is one run of consecutive rows of dY (a batch of one right- or left-padded sequence, or every row
active): it is read as a plain strided block, with no index loads and no row masks but on its last block.
On an H100 (a probe of the kernels' internals; ``results/kernels.json`` run dw_alone holds the figures with
strided reads) that took dW alone at the Llama-3.2-3B shapes (batch 1) from 175.0 to 152.4 us (down_proj, d = 0.5)
and from 62.7 to 60.5 us (d = 0.1).

db has its own small kernel of the same shape (column blocks x row splits, last arriver adds the partials).
Summing dY inside the dW kernel would need the dY tile in registers, which takes the programs that do it
off the asynchronous copy path: on an H200 those programs ran about 3x slower and set the kernel's time.
"""
from __future__ import annotations

import functools
import threading

import torch
import triton
import triton.language as tl

from .launch import FastLaunch
from .tiles import _split_rows, _store_split, grouped_tile
from .tuning import cdiv, gemm_config

ROW_ALIGN = 64  # split boundaries are multiples of this (and so of every BLOCK_K)
MIN_CHUNK = 2048  # rows per split at least: a split must amortise its partial's write and read (measured)


@triton.jit
def _scaled(a, scale_ptr, rows, valid):
    """The (rows, cols) tile ``a`` of dY with each row multiplied by its fp32 factor ``scale_ptr[rows]`` (sampled
    mode's 1/q), rounded back to dY's dtype as the torch reference rounds ``dy * scale``."""
    s = tl.load(scale_ptr + rows, mask=valid, other=0.0)
    return (a.to(tl.float32) * s[:, None]).to(a.dtype)


@triton.jit
def _dw_loop(
    dy_ptr, x_ptr, perm_ptr, start, end,
    offs_o, offs_i, o_mask, i_mask,
    stride_dym, stride_dyo, stride_xm, stride_xi,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr, BIG: tl.constexpr, scale_ptr, SCALED: tl.constexpr,
):
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    if IEEE:
        # fp32: sum blocks of 8 x BLOCK_K rows apart, then add them up (a two-level sum keeps the rounding
        # error near cuBLAS's; a single fused accumulator over thousands of rows doubles it).
        for j0 in range(start, end, 8 * BLOCK_K):
            part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for j in range(j0, tl.minimum(j0 + 8 * BLOCK_K, end), BLOCK_K):
                pos = j + offs_k
                valid = pos < end
                rows = tl.load(perm_ptr + pos, mask=valid, other=0).to(tl.int64)
                a = tl.load(dy_ptr + rows[:, None] * stride_dym + offs_o[None, :] * stride_dyo,
                            mask=valid[:, None] & o_mask[None, :], other=0.0)
                if SCALED:
                    a = _scaled(a, scale_ptr, rows, valid)
                b = tl.load(x_ptr + rows[:, None] * stride_xm + offs_i[None, :] * stride_xi,
                            mask=valid[:, None] & i_mask[None, :], other=0.0)
                part = tl.dot(tl.trans(a), b, part, input_precision="ieee")
            acc += part
    else:
        # The permutation lists the active rows in increasing order, so the range is one run of consecutive
        # rows exactly when its ends are (end - start - 1) apart: a batch of one sequence, any full-density
        # range. Such a range needs no index loads, and its full blocks no row masks.
        has = end > start
        first = tl.load(perm_ptr + start, mask=has, other=0)
        last = tl.load(perm_ptr + tl.maximum(end - 1, start), mask=has, other=0)
        if has & (last - first == end - 1 - start):
            full = start + (end - start) // BLOCK_K * BLOCK_K
            for j in range(start, full, BLOCK_K):
                rows = first - start + j + offs_k
                if BIG:
                    rows = rows.to(tl.int64)
                a = tl.load(dy_ptr + rows[:, None] * stride_dym + offs_o[None, :] * stride_dyo,
                            mask=o_mask[None, :], other=0.0)
                if SCALED:
                    a = _scaled(a, scale_ptr, rows, rows >= 0)
                b = tl.load(x_ptr + rows[:, None] * stride_xm + offs_i[None, :] * stride_xi,
                            mask=i_mask[None, :], other=0.0)
                acc = tl.dot(tl.trans(a), b, acc)
            if full < end:
                valid = (full + offs_k) < end
                rows = first - start + full + offs_k
                if BIG:
                    rows = rows.to(tl.int64)
                a = tl.load(dy_ptr + rows[:, None] * stride_dym + offs_o[None, :] * stride_dyo,
                            mask=valid[:, None] & o_mask[None, :], other=0.0)
                if SCALED:
                    a = _scaled(a, scale_ptr, rows, valid)
                b = tl.load(x_ptr + rows[:, None] * stride_xm + offs_i[None, :] * stride_xi,
                            mask=valid[:, None] & i_mask[None, :], other=0.0)
                acc = tl.dot(tl.trans(a), b, acc)
        else:
            # The row indices of the next block are loaded one iteration ahead (measured: faster than
            # letting the pipeliner order them, than 2-D index tiles, and than separate index loads for dY
            # and X).
            pos = start + offs_k
            rows = tl.load(perm_ptr + pos, mask=pos < end, other=0)
            for j in range(start, end, BLOCK_K):
                nxt = j + BLOCK_K + offs_k
                rows_next = tl.load(perm_ptr + nxt, mask=nxt < end, other=0)
                if BIG:
                    rows = rows.to(tl.int64)
                valid = (j + offs_k) < end
                a = tl.load(dy_ptr + rows[:, None] * stride_dym + offs_o[None, :] * stride_dyo,
                            mask=valid[:, None] & o_mask[None, :], other=0.0)  # (BLOCK_K, BLOCK_M) of dY
                if SCALED:
                    a = _scaled(a, scale_ptr, rows, valid)
                b = tl.load(x_ptr + rows[:, None] * stride_xm + offs_i[None, :] * stride_xi,
                            mask=valid[:, None] & i_mask[None, :], other=0.0)  # (BLOCK_K, BLOCK_N) of X
                acc = tl.dot(tl.trans(a), b, acc)
                rows = rows_next
    return acc


@triton.jit
def _dw_tile(
    dy_ptr, x_ptr, dw_ptr, part_ptr, perm_ptr, count, ticket_ptr, pid, pid_s,
    M, N_OUT, N_IN, SPLIT,
    stride_dym, stride_dyo, stride_xm, stride_xi,
    IEEE: tl.constexpr, BIG: tl.constexpr, ROW_ALIGN: tl.constexpr, MIN_CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    scale_ptr, SCALED: tl.constexpr,
):
    """Split ``pid_s`` of dW tile ``pid`` (also called by the fused gradient kernel).
    part_ptr: fp32 partials [SPLIT, N_OUT*N_IN] (unused when SPLIT == 1); ticket_ptr: one int32 counter per
    tile, zero between launches. ``SCALED``: each row of dY is multiplied by ``scale_ptr``'s factor first."""
    pid_m, pid_n = grouped_tile(pid, N_OUT, N_IN, BLOCK_M, BLOCK_N, GROUP_M)
    start, end, n_split = _split_rows(count, pid_s, SPLIT, ROW_ALIGN, MIN_CHUNK)
    if pid_s < n_split:
        offs_o = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_i = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        o_mask = offs_o < N_OUT
        i_mask = offs_i < N_IN
        acc = _dw_loop(dy_ptr, x_ptr, perm_ptr, start, end, offs_o, offs_i, o_mask, i_mask,
                       stride_dym, stride_dyo, stride_xm, stride_xi, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, BIG,
                       scale_ptr, SCALED)
        offs = offs_o.to(tl.int64)[:, None] * N_IN + offs_i[None, :]
        _store_split(dw_ptr, offs, part_ptr, offs, tl.cast(N_OUT, tl.int64) * N_IN, ticket_ptr, pid, acc,
                     o_mask[:, None] & i_mask[None, :], pid_s, n_split)


@triton.jit(do_not_specialize=["M", "SPLIT", "count_ptr"])
def _dw_kernel(
    dy_ptr, x_ptr, dw_ptr, part_ptr, perm_ptr, count_ptr, ticket_ptr, scale_ptr,
    M, N_OUT, N_IN, SPLIT,
    stride_dym, stride_dyo, stride_xm, stride_xi,
    IEEE: tl.constexpr, BIG: tl.constexpr, ROW_ALIGN: tl.constexpr, MIN_CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SCALED: tl.constexpr,
):
    _dw_tile(dy_ptr, x_ptr, dw_ptr, part_ptr, perm_ptr, tl.load(count_ptr), ticket_ptr,
             tl.program_id(0), tl.program_id(1), M, N_OUT, N_IN, SPLIT,
             stride_dym, stride_dyo, stride_xm, stride_xi,
             IEEE, BIG, ROW_ALIGN, MIN_CHUNK, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, scale_ptr, SCALED)


@triton.jit
def _db_cols(
    dy_ptr, db_ptr, part_ptr, perm_ptr, count, ticket_ptr, pid, pid_s,
    M, N, SPLIT, stride_m, stride_n,
    ROW_ALIGN: tl.constexpr, MIN_CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    scale_ptr, SCALED: tl.constexpr,
):
    """Split ``pid_s`` of db column block ``pid``: the sum of the active rows of dY (``SCALED``: each times its
    ``scale_ptr`` factor), fp32, the last arriver adds the splits (also called by the fused gradient kernel)."""
    start, end, n_split = _split_rows(count, pid_s, SPLIT, ROW_ALIGN, MIN_CHUNK)
    if pid_s < n_split:
        cols = pid * BLOCK_C + tl.arange(0, BLOCK_C)
        c_mask = cols < N
        offs_r = tl.arange(0, BLOCK_R)
        acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)  # one partial sum per row slot: short chains
        rows = tl.load(perm_ptr + start + offs_r, mask=start + offs_r < end, other=0)
        for j in range(start, end, BLOCK_R):
            nxt = j + BLOCK_R + offs_r
            rows_next = tl.load(perm_ptr + nxt, mask=nxt < end, other=0)  # one block ahead
            valid = (j + offs_r) < end
            v = tl.load(dy_ptr + rows.to(tl.int64)[:, None] * stride_m + cols[None, :] * stride_n,
                        mask=valid[:, None] & c_mask[None, :], other=0.0)
            if SCALED:
                v = _scaled(v, scale_ptr, rows, valid)
            acc += v.to(tl.float32)
            rows = rows_next
        _store_split(db_ptr, cols, part_ptr, cols, N, ticket_ptr, pid, tl.sum(acc, axis=0), c_mask, pid_s, n_split)


@triton.jit(do_not_specialize=["M", "SPLIT", "count_ptr"])
def _db_kernel(
    dy_ptr, db_ptr, part_ptr, perm_ptr, count_ptr, ticket_ptr, scale_ptr,
    M, N, SPLIT, stride_m, stride_n,
    ROW_ALIGN: tl.constexpr, MIN_CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    SCALED: tl.constexpr,
):
    _db_cols(dy_ptr, db_ptr, part_ptr, perm_ptr, tl.load(count_ptr), ticket_ptr, tl.program_id(0),
             tl.program_id(1), M, N, SPLIT, stride_m, stride_n, ROW_ALIGN, MIN_CHUNK, BLOCK_R, BLOCK_C,
             scale_ptr, SCALED)


_dw = FastLaunch(_dw_kernel)
_db = FastLaunch(_db_kernel)


_TICKETS: dict = {}  # device -> int32 counters, zero between launches


def _tickets(device: torch.device, n: int) -> torch.Tensor:
    """Counters for the last-arriver reductions. Allocated once per device; kernels on one stream run one
    after the other, so they can share them. They are made on a helper thread, outside any CUDA-graph memory
    pool this thread may be warming up or recording into: such a pool takes this thread's allocations, and
    torch.compile's ``reduce-overhead`` mode refuses to record when one outlives the graph (counters first made
    during a compiled model's warm-up run would). While this thread captures a graph the helper thread may not
    allocate, so they are made here; warm up before capturing."""
    buf = _TICKETS.get(device)
    if buf is None or buf.numel() < n:
        def make():
            return torch.zeros(max(n, 4096), dtype=torch.int32, device=device)

        direct = device.type != "cuda" or torch.cuda.is_current_stream_capturing()  # CPU: the interpreter
        buf = _TICKETS[device] = make() if direct else _on_helper_thread(make, device)
    return buf


def _on_helper_thread(make, device: torch.device) -> torch.Tensor:
    """``make()`` on another thread (outside this thread's CUDA-graph pool), finished on the GPU on return."""
    out = []

    def run():
        try:
            with torch.cuda.device(device):
                t = make()
                torch.cuda.current_stream().synchronize()
                out.append(t)
        except BaseException as err:  # noqa: BLE001 (raised again on the calling thread)
            out.append(err)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


@functools.lru_cache(maxsize=1024)
def dw_splits(n_out: int, n_in: int, m: int, n_sm: int, block_m: int = 128, block_n: int = 128,
              other_work: int = 0) -> int:
    """Most row splits per dW tile (used when all m rows are active), at most 8, none that would leave a split
    fewer than MIN_CHUNK rows.

    Alone (``other_work`` 0), the fewest splits that fill the GPU in whole waves (>= 85%). Sharing a launch
    with other tiles of the same size (the dX tiles of the fused kernel: ``other_work`` = their count times
    their reduction length), those tiles fill the waves, and a split only has to keep one dW tile (m rows)
    from outlasting an even share of all the work. Measured on an H100 at density 1.0 (``dense_gap.py``,
    2026-11-22): this picks the fastest of 1, 2 and 4 splits at all seven BERT-base and Llama-3.2-3B shapes;
    at the five where the waves rule chose otherwise (2-7 splits) it cost 6-16% more GPU time, mostly in fp32
    partials that need not exist."""
    tiles = cdiv(n_out, block_m) * cdiv(n_in, block_n)
    most = max(1, min(8, m // MIN_CHUNK))
    if other_work:
        return min(most, max(1, cdiv(m * n_sm, tiles * m + other_work)))
    best = 1
    for s in range(1, 9):
        if s > 1 and m < s * MIN_CHUNK:
            break
        best = s
        waves = cdiv(tiles * s, n_sm)
        if tiles * s / (waves * n_sm) >= 0.85:
            break
    return best


DB_BLOCK_C = 128
DB_BLOCK_R = 64
DB_MIN_CHUNK = 128


@functools.lru_cache(maxsize=1024)
def _db_splits(m: int, cols: int, n_sm: int, min_chunk: int) -> int:
    """Row splits of the db kernel: about four programs per SM at full density."""
    return max(1, min(cdiv(4 * n_sm, cols), m // min_chunk, 64))


def db_rows(dy: torch.Tensor, perm: torch.Tensor, count: torch.Tensor, n_sm: int = 1,
            interpret: bool = False, split: int | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """db (out,) = dY[perm[:count]].sum(0) (``scale``: each row times its fp32 factor), accumulated in fp32;
    deterministic."""
    m, n = dy.shape
    block_c, block_r, min_chunk = (16, 8, 8) if interpret else (DB_BLOCK_C, DB_BLOCK_R, DB_MIN_CHUNK)
    cols = cdiv(n, block_c)
    if split is None:
        split = _db_splits(m, cols, n_sm, min_chunk)
    db = torch.empty(n, dtype=dy.dtype, device=dy.device)
    part = torch.empty(split * n, dtype=torch.float32, device=dy.device) if split > 1 else db
    _db[(cols, split)](dy, db, part, perm, count, _tickets(dy.device, cols), perm if scale is None else scale,
                       m, n, split, dy.stride(0), dy.stride(1), ROW_ALIGN=block_r, MIN_CHUNK=min_chunk,
                       BLOCK_R=block_r, BLOCK_C=block_c, SCALED=scale is not None, num_warps=1 if interpret else 4)
    return db


def dw_db_rows(dy: torch.Tensor, x: torch.Tensor, perm: torch.Tensor, count: torch.Tensor,
               need_db: bool, split: int | None = None, interpret: bool = False, ieee: bool = True,
               w_dtype: torch.dtype | None = None, n_sm: int = 1, scale: torch.Tensor | None = None):
    """(dW, db or None) over rows perm[:count]; at most ``split`` row splits per dW tile (None: chosen from
    the shapes and ``n_sm``, see :func:`dw_splits`). ``scale`` (fp32, M): each row of dY times its factor."""
    m, n_out = dy.shape
    n_in = x.shape[1]
    dev = dy.device
    cfg = gemm_config("dw", dy.dtype, interpret)
    if split is None:
        split = dw_splits(n_out, n_in, m, n_sm, cfg["BLOCK_M"], cfg["BLOCK_N"])
    dw = torch.empty((n_out, n_in), dtype=w_dtype or x.dtype, device=dev)
    tiles = cdiv(n_out, cfg["BLOCK_M"]) * cdiv(n_in, cfg["BLOCK_N"])
    part = torch.empty(split * n_out * n_in, dtype=torch.float32, device=dev) if split > 1 else dw
    align, min_chunk = (16, 16) if interpret else (ROW_ALIGN, MIN_CHUNK)
    big = max(dy.stride(0), x.stride(0)) * m >= 2**31
    _dw[(tiles, split)](
        dy, x, dw, part, perm, count, _tickets(dev, tiles), perm if scale is None else scale,
        m, n_out, n_in, split, dy.stride(0), dy.stride(1), x.stride(0), x.stride(1),
        IEEE=ieee, BIG=big, ROW_ALIGN=align, MIN_CHUNK=min_chunk, SCALED=scale is not None, **cfg)
    db = db_rows(dy, perm, count, n_sm, interpret, split if interpret else None, scale) if need_db else None
    return dw, db
