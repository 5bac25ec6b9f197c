"""Why the SEBP dW is slower than cuBLAS's: the gather, the row masks, or Triton's GEMM on Hopper? (bf16, us)

dW = dY[active]ᵀ X[active] is where the fused gradient kernel loses most to cuBLAS (``dense_gap.py``). Per
BERT-base / Llama-3.2-3B layer shape and density, dW alone, timed as the per-layer bench (CUDA-graph replay,
CUDA events, L2 flushed, methods taking turns):

- ``cublas``: ``dy_k.t() @ x_k`` on the active rows laid out contiguously (the ideal's dW);
- ``sebp``: the fused gradient kernel with only dW asked for, rows known (its permutation and count);
- ``ptr_gather``: a textbook Triton dW with the kernel's tile (128 x 256 x 64, 8 warps, 3 stages) over the
  same permutation, full row blocks without masks and one masked tail; ``ptr``: the same on the contiguous
  rows (no gather);
- ``tma``: the same tile on the contiguous rows with TMA loads (host tensor descriptors), 3 and 4 stages;
  ``tma_128``: a 128 x 128 tile, 4 stages; ``tma_dev``: ``tma`` with descriptors made by each program;
- ``persist`` / ``persist_flat`` / ``persist_tma_flat``: one program per SM walking the tiles, the tile loop
  plain or flattened into the K loop (``tl.range(..., flatten=True)``: the next tile's loads can start under
  this tile's epilogue, which matters when K, the active rows, is short), with pointer or TMA loads.

If ``tma`` comes near ``cublas`` while ``ptr`` does not, the loads are what is missing (and a gather that TMA
can do, on whole runs of active rows, is worth building); if neither does, it is Triton's GEMM schedule on
this GPU.

    python benchmarks/dw_tma_probe.py out.json [--repeats 20]
"""
import sys

import torch
import triton
import triton.language as tl

from sebp_kernels._triton.backward import _ieee
from sebp_kernels._triton.grads import grads_rows
from sebp_kernels._triton.select import _sm_count, select_rows_device
from sebp_kernels._triton.tiles import grouped_tile
from sebp_probe.bench.bench import _Flush, time_methods

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from dense_gap import layer_shapes, operands, padded, run_probe, write_rows  # noqa: E402


@triton.jit
def _dw_ptr(dy_ptr, x_ptr, dw_ptr, perm_ptr, K, N_OUT, N_IN, s_dy, s_x, s_dw,
            GATHER: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    pm, pn = grouped_tile(tl.program_id(0), N_OUT, N_IN, BM, BN, GROUP_M)
    offs_o = pm * BM + tl.arange(0, BM)
    offs_i = pn * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    full = K // BK * BK
    for j in range(0, full, BK):
        rows = tl.load(perm_ptr + j + offs_k) if GATHER else j + offs_k
        a = tl.load(dy_ptr + rows[:, None] * s_dy + offs_o[None, :])
        b = tl.load(x_ptr + rows[:, None] * s_x + offs_i[None, :])
        acc = tl.dot(tl.trans(a), b, acc)
    if full < K:
        pos = full + offs_k
        valid = pos < K
        rows = tl.load(perm_ptr + pos, mask=valid, other=0) if GATHER else pos
        a = tl.load(dy_ptr + rows[:, None] * s_dy + offs_o[None, :], mask=valid[:, None], other=0.0)
        b = tl.load(x_ptr + rows[:, None] * s_x + offs_i[None, :], mask=valid[:, None], other=0.0)
        acc = tl.dot(tl.trans(a), b, acc)
    tl.store(dw_ptr + offs_o[:, None] * s_dw + offs_i[None, :], acc.to(dw_ptr.dtype.element_ty))


@triton.jit
def _dw_tma(dy, x, dw_ptr, K, N_OUT, N_IN, s_dy, s_x, s_dw, DEVICE: tl.constexpr,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """``dy``, ``x``: host tensor descriptors, or (``DEVICE``) pointers this program makes descriptors of."""
    pm, pn = grouped_tile(tl.program_id(0), N_OUT, N_IN, BM, BN, GROUP_M)
    if DEVICE:
        dy_desc = tl.make_tensor_descriptor(dy, shape=[K, N_OUT], strides=[s_dy, 1], block_shape=[BK, BM])
        x_desc = tl.make_tensor_descriptor(x, shape=[K, N_IN], strides=[s_x, 1], block_shape=[BK, BN])
    else:
        dy_desc = dy
        x_desc = x
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for j in range(0, K, BK):  # rows past K come in as zeros (TMA bounds)
        a = dy_desc.load([j, pm * BM])
        b = x_desc.load([j, pn * BN])
        acc = tl.dot(a.T, b, acc)
    offs_o = pm * BM + tl.arange(0, BM)
    offs_i = pn * BN + tl.arange(0, BN)
    tl.store(dw_ptr + offs_o[:, None] * s_dw + offs_i[None, :], acc.to(dw_ptr.dtype.element_ty))


@triton.jit
def _dw_persist(dy_ptr, x_ptr, dy_desc, x_desc, dw_ptr, K, N_OUT, N_IN, s_dy, s_x, s_dw,
                PROGRAMS: tl.constexpr, TMA: tl.constexpr, FLATTEN: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    offs_k = tl.arange(0, BK)
    for t in tl.range(tl.program_id(0), tl.cdiv(N_OUT, BM) * tl.cdiv(N_IN, BN), PROGRAMS, flatten=FLATTEN):
        pm, pn = grouped_tile(t, N_OUT, N_IN, BM, BN, GROUP_M)
        offs_o = pm * BM + tl.arange(0, BM)
        offs_i = pn * BN + tl.arange(0, BN)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for j in range(0, K, BK):
            if TMA:
                a = dy_desc.load([j, pm * BM])
                b = x_desc.load([j, pn * BN])
            else:
                rows = j + offs_k
                a = tl.load(dy_ptr + rows[:, None] * s_dy + offs_o[None, :], mask=rows[:, None] < K, other=0.0)
                b = tl.load(x_ptr + rows[:, None] * s_x + offs_i[None, :], mask=rows[:, None] < K, other=0.0)
            acc = tl.dot(tl.trans(a), b, acc)
        tl.store(dw_ptr + offs_o[:, None] * s_dw + offs_i[None, :], acc.to(dw_ptr.dtype.element_ty))


def dw_persist(dy_k, x_k, dw, programs, tma, flatten, bm=128, bn=256, bk=64, warps=8, stages=3):
    from triton.tools.tensor_descriptor import TensorDescriptor
    n_out, n_in = dw.shape
    a = TensorDescriptor.from_tensor(dy_k, [bk, bm]) if tma else dy_k
    b = TensorDescriptor.from_tensor(x_k, [bk, bn]) if tma else x_k
    tiles = triton.cdiv(n_out, bm) * triton.cdiv(n_in, bn)
    _dw_persist[(min(programs, tiles),)](dy_k, x_k, a, b, dw, dy_k.shape[0], n_out, n_in, dy_k.stride(0),
                                         x_k.stride(0), dw.stride(0), PROGRAMS=min(programs, tiles), TMA=tma,
                                         FLATTEN=flatten, BM=bm, BN=bn, BK=bk, GROUP_M=8, num_warps=warps,
                                         num_stages=stages)
    return dw


def dw_ptr(dy, x, dw, perm, k, gather, bm=128, bn=256, bk=64, warps=8, stages=3):
    n_out, n_in = dw.shape
    grid = (triton.cdiv(n_out, bm) * triton.cdiv(n_in, bn),)
    _dw_ptr[grid](dy, x, dw, perm, k, n_out, n_in, dy.stride(0), x.stride(0), dw.stride(0), GATHER=gather,
                  BM=bm, BN=bn, BK=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    return dw


def dw_tma_dev(dy_k, x_k, dw, bm=128, bn=256, bk=64, warps=8, stages=3):
    """The ``tma`` kernel with its descriptors made on the device, by each program (Triton's allocator gives
    them memory at launch)."""
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    return dw_tma(dy_k, x_k, dw, bm, bn, bk, warps, stages, device=True)


def dw_tma(dy_k, x_k, dw, bm=128, bn=256, bk=64, warps=8, stages=3, device=False):
    from triton.tools.tensor_descriptor import TensorDescriptor
    n_out, n_in = dw.shape
    grid = (triton.cdiv(n_out, bm) * triton.cdiv(n_in, bn),)
    a = dy_k if device else TensorDescriptor.from_tensor(dy_k, [bk, bm])
    b = x_k if device else TensorDescriptor.from_tensor(x_k, [bk, bn])
    _dw_tma[grid](a, b, dw, dy_k.shape[0], n_out, n_in, dy_k.stride(0), x_k.stride(0), dw.stride(0),
                  DEVICE=device, BM=bm, BN=bn, BK=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    return dw


def main(path, repeats):
    dev = torch.device("cuda")
    n_sm = _sm_count(dev)
    flush = _Flush()
    rows = []
    for shape, g in layer_shapes(dev):
        x, w, dy_full = operands(shape, g)
        for d in (0.1, 0.2, 0.5):
            dy, mask = padded(dy_full, shape, d)
            act = mask.nonzero().squeeze(1)
            k = int(act.numel())
            dy_k, x_k = dy.index_select(0, act).contiguous(), x.index_select(0, act).contiguous()
            perm, count = select_rows_device(dy, "exact")
            ie = _ieee(dy.dtype)
            ref = (dy_k.float().t() @ x_k.float())
            dw = torch.empty(w.shape, device=dev, dtype=w.dtype)
            methods = {
                "cublas": (lambda: dy_k.t() @ x_k, True),
                "sebp": (lambda: grads_rows(dy, x, w, perm, count, False, True, False, ie, n_sm), True),
                "ptr_gather": (lambda: dw_ptr(dy, x, dw, perm, k, True), True),
                "ptr": (lambda: dw_ptr(dy_k, x_k, dw, perm, k, False), True),
                "tma": (lambda: dw_tma(dy_k, x_k, dw), True),
                "tma_s4": (lambda: dw_tma(dy_k, x_k, dw, stages=4), True),
                "tma_128": (lambda: dw_tma(dy_k, x_k, dw, bn=128, stages=4), True),
                "tma_dev": (lambda: dw_tma_dev(dy_k, x_k, dw), True),
                "persist": (lambda: dw_persist(dy_k, x_k, dw, n_sm, False, False), True),
                "persist_flat": (lambda: dw_persist(dy_k, x_k, dw, n_sm, False, True), True),
                "persist_tma_flat": (lambda: dw_persist(dy_k, x_k, dw, n_sm, True, True), True),
            }
            err = {}
            for name, (fn, _) in methods.items():
                out = fn()
                out = out[1] if isinstance(out, tuple) else out
                err[name] = round(float((out.float() - ref).abs().max() / ref.abs().max()), 5)
            us = {name: round(ms * 1000, 1) for name, ms in time_methods(methods, repeats, flush).items()}
            r = {"shape": shape.name, "density": d, "k": k, "us": us, "rel_err": err,
                 "vs_cublas": {name: round(v / us["cublas"], 3) for name, v in us.items()}}
            print(r, flush=True)
            rows.append(r)
    write_rows(path, rows)


if __name__ == "__main__":
    run_probe(main)
