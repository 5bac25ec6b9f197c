"""Where the row selection's GPU time goes, and whether a one-launch variant (the last block to finish its
flags compacts all rows) beats the two launches (flags, then compact).

Times are CUDA-graph replays with the L2 cache flushed before each repeat, as in ``sebp-probe bench``
(``bench.time_methods``), bf16, right-padded rows at the bench's densities:

- ``read``: ``dy.amax()``, a torch reduction over all of dY, for scale (slower than the flags pass);
- ``flags``: the flags pass alone; ``compact``: the compact pass alone (flags precomputed);
- ``select``: both (what the SEBP backward runs now); ``compact_R``: the compact pass with R rows a program;
- ``one_CH``: flags, then the last program to finish compacts all M rows in chunks of CH (one launch);
- ``select_old``: the selection of the module file given with ``--old``, an earlier commit's ``select.py``
  with its relative imports made absolute, e.g. ``git show 02e3ee5:sebp_kernels/_triton/select.py |
  sed 's/^from \\./from sebp_kernels._triton./' > benchmarks/_old_select.py`` (the early-exit flags pass).

    python benchmarks/select_probe.py [out.json] [--old FILE]   (TRITON_INTERPRET=1: a CPU check of the variant)
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl

from sebp_kernels._triton import select
from sebp_kernels._triton.tuning import cdiv
from sebp_probe.bench.bench import _Flush, padded_rows, time_methods

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _flags_compact_kernel(
    dy_ptr, flags_ptr, perm_ptr, count_ptr, ticket_ptr,
    M, N, stride_m, stride_n, NB,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, CH: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < M
    n_valid = tl.sum(rmask.to(tl.int32), axis=0)
    row_ptrs = dy_ptr + rows.to(tl.int64)[:, None] * stride_m
    active = tl.zeros([BLOCK_R], dtype=tl.int32)
    n_active = tl.sum(active, axis=0)
    c0 = 0
    while (c0 < N) & (n_active < n_valid):
        cols = c0 + tl.arange(0, BLOCK_C)
        tile = tl.load(row_ptrs + cols[None, :] * stride_n, mask=rmask[:, None] & (cols < N)[None, :], other=0.0)
        active = tl.maximum(active, tl.max((tile != 0).to(tl.int32), axis=1))
        n_active = tl.sum(active, axis=0)
        c0 += BLOCK_C
    tl.store(flags_ptr + rows, active, mask=rmask)
    if tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == NB - 1:
        base = pid * 0
        local = tl.arange(0, CH)
        for c in range(0, M, CH):
            idx = c + local
            m = idx < M
            f = tl.load(flags_ptr + idx, mask=m, other=0, cache_modifier=".cg")
            excl = tl.cumsum(f, axis=0) - f
            pos = tl.where(f > 0, base + excl, M - 1 - (c - base + local - excl))
            tl.store(perm_ptr + pos, idx, mask=m)
            base += tl.sum(f, axis=0)
        tl.store(count_ptr, base)
        tl.atomic_xchg(ticket_ptr, 0)


def one_launch(dy, ch):
    m, n = dy.shape
    block_r, block_c, warps = select._row_blocks(n, INTERPRET)  # the early-exit flags pass's tiles
    nb = cdiv(m, block_r)
    dev = dy.device
    flags = torch.empty(m, dtype=torch.int32, device=dev)
    ticket = torch.zeros(1, dtype=torch.int32, device=dev)

    def run():
        perm = torch.empty(m, dtype=torch.int32, device=dev)
        count = torch.empty(1, dtype=torch.int32, device=dev)
        _flags_compact_kernel[(nb,)](dy, flags, perm, count, ticket, m, n, dy.stride(0), dy.stride(1), nb,
                                     BLOCK_R=block_r, BLOCK_C=block_c, CH=ch, num_warps=warps)
        return perm, count
    return run


def parts(dy, compact_rows=(None,)):
    """(flags alone, {rows: compact alone}) with the current kernels and tiles (rows None: the current
    choice)."""
    m, n = dy.shape
    block_r, block_c, unroll, warps = select._flag_blocks(n, INTERPRET)
    nb = cdiv(m, block_r)
    dev = dy.device
    flags = torch.empty(m, dtype=torch.int32, device=dev)
    counts = torch.empty(nb, dtype=torch.int32, device=dev)
    perm = torch.empty(m, dtype=torch.int32, device=dev)
    count = torch.empty(1, dtype=torch.int32, device=dev)

    def f():
        select._row_flags_kernel[(nb,)](dy, flags, counts, m, n, dy.stride(0), dy.stride(1), 0.0, MODE=0,
                                        BLOCK_R=block_r, BLOCK_C=block_c, UNROLL=unroll, num_warps=warps)

    def compact(rows):
        grid, kw = select.compact_plan(m, block_r, INTERPRET)
        if rows is not None:
            kw = dict(kw, ROWS=rows)
            grid = cdiv(m, rows)

        def c():
            select._compact_kernel[(grid,)](flags, counts, perm, count, m, **kw)
            return perm, count
        return c
    f()
    ref_perm, ref_count = select.select_rows_device(dy, "exact", interpret=INTERPRET)
    cs = {}
    for r in compact_rows:
        cs[r] = compact(r)
        p, k = cs[r]()
        assert torch.equal(p, ref_perm) and int(k) == int(ref_count), r
    return f, cs


def check(dy, ch):
    ref_perm, ref_count = select.select_rows_device(dy, "exact", interpret=INTERPRET)
    for _ in range(2):  # twice: the ticket must be back at zero
        perm, count = one_launch(dy, ch)()
        assert int(count) == int(ref_count), (int(count), int(ref_count))
        assert torch.equal(perm, ref_perm), "permutation differs"


def main():
    if INTERPRET:
        for m, n, ch in ((100, 24, 32), (64, 40, 16), (37, 8, 64)):
            for d in (0.0, 0.3, 1.0):
                dy = torch.randn(m, n) * (torch.rand(m) < d)[:, None]
                check(dy, ch)
            parts(dy, (None, 16, 32))
        print("one-launch selection and compact variants match select_rows_device (interpreter)")
        return
    args = sys.argv[1:]
    old = None
    if "--old" in args:
        i = args.index("--old")
        import importlib.util
        spec = importlib.util.spec_from_file_location("old_select", args[i + 1])
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        del args[i:i + 2]
    flush = _Flush()
    out = []
    shapes = ((16384, 3072, 512), (16384, 768, 512), (4096, 8192, 4096), (4096, 3072, 4096), (4096, 1024, 4096))
    for m, n, seq in shapes:
        for d in (0.1, 0.2, 0.5, 1.0):
            mask = padded_rows(m, seq, d, "cuda")
            dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * mask[:, None].to(torch.bfloat16)
            f, cs = parts(dy, (None, 128, 512, 1024))
            methods = {"read": (lambda: dy.amax(), True), "flags": (f, True), "compact": (cs.pop(None), True),
                       "select": (lambda: select.select_rows_device(dy, "exact"), True)}
            methods.update({f"compact_{r}": (c, True) for r, c in cs.items()})
            if old is not None:
                p_old, k_old = old.select_rows_device(dy, "exact")
                p_new, k_new = select.select_rows_device(dy, "exact")
                assert torch.equal(p_old, p_new) and int(k_old) == int(k_new)
                methods["select_old"] = (lambda: old.select_rows_device(dy, "exact"), True)
            for ch in (2048, 4096, 8192):
                check(dy, ch)
                methods[f"one_{ch}"] = (one_launch(dy, ch), True)
            us = {k: round(v * 1e3, 2) for k, v in time_methods(methods, 30, flush).items()}
            print(f"{m}x{n} d={d}: " + ", ".join(f"{k} {v}" for k, v in us.items()), flush=True)
            out.append({"m": m, "n": n, "density": d, "us": us})
    if args:
        import datetime
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "command": "python benchmarks/select_probe.py " + " ".join(sys.argv[1:]), "results": out},
                  open(args[0], "w"), indent=1)


if __name__ == "__main__":
    main()
