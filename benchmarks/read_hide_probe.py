"""How much of the ideal's speedup is reachable at all when dY's inactive rows must be read? (bf16, us)

Whatever finds the active rows of a dY it was not told about must read every element of its inactive rows
(a row is inactive only if all of it is zero, or below eps). The bench's ideal does not: it is handed the
k active rows laid out contiguously. This probe gives that read its best chance, with nothing of SEBP in
the way: the ideal's own cuBLAS GEMMs (dX, dW, db on the contiguous rows) and a plain streaming read of as
many bytes as dY's inactive rows (a separate buffer: no dependency between the two), timed as the per-layer
bench times (CUDA-graph replay, CUDA events, L2 flushed before each repeat, methods taking turns):

- ``ideal``: the GEMMs alone; ``read``: the read alone on a full grid (``read_torch``: ``torch.amax`` of the
  same buffer, for the bandwidth a torch reduction gets); ``serial``: the GEMMs, then the read;
- ``conc_<s>``: the read with ``s`` programs (a grid-stride loop) started first on a second stream, the
  GEMMs on this one, both in the same graph (``s`` = 8 a SM down to 1 per 8 SMs: the fewer, the more SMs
  are left to the GEMMs), and ``conc_gemm_first``: the GEMMs queued first;
- ``sebp``: the current SEBP backward (selection + fused gradient kernel) on the real right-padded dY;
- ``share_serial`` = ideal / serial, ``share_best`` = ideal / the fastest of serial and the ``conc_*``: the
  largest share of the ideal's speedup seen for any backward that reads those bytes, if its GEMMs were
  cuBLAS's; ``hidden``: the fraction of the read's own time that the best concurrent run saved.

    python benchmarks/read_hide_probe.py out.json [--repeats 20]
"""
import sys

import torch
import triton
import triton.language as tl

from sebp_kernels import SEBPConfig
from sebp_kernels._triton import sebp_backward_triton
from sebp_kernels._triton.select import _sm_count
from sebp_probe.bench.bench import _Flush, time_methods

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from dense_gap import layer_shapes, operands, padded, run_probe, write_rows  # noqa: E402

BLOCK = 8192  # elements a program loads per step (16 KiB of bf16)


@triton.jit
def _read_kernel(src_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Grid-stride read of ``n`` elements, two blocks a step; each program stores the max it saw (so the
    loads cannot be dropped)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK * 2
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(pid * BLOCK * 2, n, step):
        o1 = off + tl.arange(0, BLOCK)
        o2 = o1 + BLOCK
        v1 = tl.load(src_ptr + o1, mask=o1 < n, other=0.0)
        v2 = tl.load(src_ptr + o2, mask=o2 < n, other=0.0)
        acc = tl.maximum(acc, tl.maximum(v1.to(tl.float32), v2.to(tl.float32)))
    tl.store(out_ptr + pid, tl.max(acc, axis=0))


def read(buf, out, programs):
    _read_kernel[(programs,)](buf, out, buf.numel(), BLOCK=BLOCK, num_warps=8)


def main(path, repeats):
    dev = torch.device("cuda")
    n_sm = _sm_count(dev)
    side = torch.cuda.Stream()
    flush = _Flush()
    grids = {"8/sm": 8 * n_sm, "1/sm": n_sm, "1/2sm": n_sm // 2, "1/4sm": n_sm // 4, "1/8sm": n_sm // 8}
    out = torch.empty(8 * n_sm, device=dev, dtype=torch.float32)
    rows = []
    for shape, g in layer_shapes(dev):
        x, w, dy_full = operands(shape, g)
        m, n_out = dy_full.shape
        for d in (0.1, 0.2, 0.5):
            dy, mask = padded(dy_full, shape, d)
            act = mask.nonzero().squeeze(1)
            k = int(act.numel())
            dy_k, x_k = dy.index_select(0, act).contiguous(), x.index_select(0, act).contiguous()
            buf = torch.randn((m - k) * n_out, device=dev, dtype=torch.bfloat16, generator=g)
            b = shape.bias

            def ideal():
                return dy_k @ w, dy_k.t() @ x_k, (dy_k.sum(0) if b else None)

            def serial():
                r = ideal()
                read(buf, out, grids["8/sm"])
                return r

            def concurrent(programs, gemm_first=False):
                def run():
                    cur = torch.cuda.current_stream()
                    side.wait_stream(cur)
                    r = ideal() if gemm_first else None
                    with torch.cuda.stream(side):
                        read(buf, out, programs)
                    r = r if gemm_first else ideal()
                    cur.wait_stream(side)
                    return r
                return run

            methods = {
                "ideal": (ideal, True),
                "read": (lambda: read(buf, out, grids["8/sm"]), True),
                "read_torch": (lambda: torch.amax(buf), True),
                "serial": (serial, True),
                **{f"conc_{name}": (concurrent(p), True) for name, p in grids.items()},
                "conc_gemm_first": (concurrent(grids["8/sm"], True), True),
                "sebp": (lambda: sebp_backward_triton(dy, x, w, SEBPConfig("exact"), True, True, b), True),
            }
            us = {name: round(ms * 1000, 1) for name, ms in time_methods(methods, repeats, flush).items()}
            best = min(v for name, v in us.items() if name == "serial" or name.startswith("conc_"))
            r = {"shape": shape.name, "density": d, "k": k, "read_mb": round(buf.numel() * 2 / 1e6, 1),
                 "us": us, "read_tb_s": round(buf.numel() * 2 / (us["read"] * 1e6), 2),
                 "share_sebp": round(us["ideal"] / us["sebp"], 3),
                 "share_serial": round(us["ideal"] / us["serial"], 3),
                 "share_best": round(us["ideal"] / best, 3),
                 "hidden": round((us["serial"] - best) / us["read"], 3)}
            print(r, flush=True)
            rows.append(r)
            del buf
    write_rows(path, rows)


if __name__ == "__main__":
    run_probe(main)
