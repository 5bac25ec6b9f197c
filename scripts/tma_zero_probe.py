"""Can GEMM programs write dX's zero rows through TMA stores without slowing down? (bf16, H100/H200, us)

A kernel's zero fill on a second stream (``scripts/coresidency_probe.py``) and the driver's memset
(``scripts/memset_probe.py``) both run after a GEMM kernel that holds every SM, and zeros stored with
``tl.store`` by the GEMM programs themselves slowed them down (commit 94088a0). A TMA store is issued by one
thread and carried out by the SM's copy engine while the warps go on, so it might hide.

The probe kernel computes C = A @ B (dX's computing tiles: A = dY's active rows, B = W) in the fused kernel's
dX tile (128 x 256, K step 64, 4 stages, 8 warps), and its programs also zero a buffer Z as large as dX's zero
rows, in tiles of ZBM x 256, program p taking tiles p, p + programs, ...:

- ``gemm``: no zeros; ``gemm+fill``: the GEMM, then ``Z.zero_()`` (what the kernel does now, roughly);
- ``st_before``: ``tl.store`` of each zero tile before the GEMM;
- ``tma_before`` / ``tma_after``: TMA stores (``tl.make_tensor_descriptor``) before / after the K loop;
- ``tma_loop``: one TMA store per K step, inside the K loop, until the program's tiles are done.

``hidden`` = (gemm + fill - t) / fill for each variant t. Shapes: dX of BERT-base attention 768 -> 768 and
FFN down 3072 -> 768 (16384 rows, seq 512) and Llama-3.2-3B down 8192 -> 3072 (4096 rows), densities 0.1
and 0.2, right padding.

    python scripts/tma_zero_probe.py out.json
"""
import json
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

from sebp_probe.bench import environment


@triton.jit
def _zero_tiles(desc, z_ptr, first, step, n_tiles, ZM, N, ZBM: tl.constexpr, BN: tl.constexpr, TMA: tl.constexpr):
    n_tn = tl.cdiv(N, BN)
    for z in range(first, n_tiles, step):
        r0 = (z // n_tn) * ZBM
        c0 = (z % n_tn) * BN
        if TMA:
            desc.store([r0, c0], tl.zeros([ZBM, BN], dtype=z_ptr.dtype.element_ty))
        else:
            rr = r0 + tl.arange(0, ZBM)
            cc = c0 + tl.arange(0, BN)
            tl.store(z_ptr + rr[:, None] * N + cc[None, :], tl.zeros([ZBM, BN], dtype=z_ptr.dtype.element_ty),
                     mask=(rr < ZM)[:, None] & (cc < N)[None, :])


@triton.jit
def _gemm_zero(a_ptr, b_ptr, c_ptr, z_ptr, M, N, K, ZM, MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, ZBM: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    n_tn = tl.cdiv(N, BN)
    pid_m = pid // n_tn
    pid_n = pid % n_tn
    n_zt = tl.cdiv(ZM, ZBM) * n_tn
    desc = tl.make_tensor_descriptor(z_ptr, shape=[ZM, N], strides=[N, 1], block_shape=[ZBM, BN])
    if MODE == 1:
        _zero_tiles(desc, z_ptr, pid, n_prog, n_zt, ZM, N, ZBM, BN, False)
    if MODE == 2:
        _zero_tiles(desc, z_ptr, pid, n_prog, n_zt, ZM, N, ZBM, BN, True)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    a_ptrs = a_ptr + offs_m[:, None] * K + offs_k[None, :]
    b_ptrs = b_ptr + offs_k[:, None] * N + offs_n[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    z = pid
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        a = tl.load(a_ptrs, mask=(offs_m < M)[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=(offs_n < N)[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BK
        b_ptrs += BK * N
        if MODE == 4:
            if z < n_zt:
                desc.store([(z // n_tn) * ZBM, (z % n_tn) * BN], tl.zeros([ZBM, BN], dtype=z_ptr.dtype.element_ty))
                z += n_prog
    if MODE == 4:
        _zero_tiles(desc, z_ptr, z, n_prog, n_zt, ZM, N, ZBM, BN, True)
    if MODE == 3:
        _zero_tiles(desc, z_ptr, pid, n_prog, n_zt, ZM, N, ZBM, BN, True)
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


MODES = {"gemm": 0, "st_before": 1, "tma_before": 2, "tma_after": 3, "tma_loop": 4}
SHAPES = [("bert-base attn 768->768", 16384, 512, 768, 768), ("bert-base ffn down 3072->768", 16384, 512, 768, 3072),
          ("llama-3.2-3b down 8192->3072", 4096, 4096, 3072, 8192)]


def main(path):
    dev = torch.device("cuda")
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    rows = []
    for name, m_all, seq, k_dim, n in SHAPES:
        for d in (0.1, 0.2):
            m = (m_all // seq) * round(d * seq)
            zm = m_all - m
            a = torch.randn(m, k_dim, device=dev, dtype=torch.bfloat16)
            b = torch.randn(k_dim, n, device=dev, dtype=torch.bfloat16) / k_dim**0.5
            c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            z = torch.full((zm, n), 1.0, device=dev, dtype=torch.bfloat16)
            r = {"shape": name, "density": d, "k": m, "zero_mib": round(zm * n * 2 / 2**20, 1)}
            for zbm in (32, 64):
                grid = (triton.cdiv(m, 128) * triton.cdiv(n, 256),)
                for mode, code in MODES.items():
                    if zbm == 64 and code == 0:
                        continue
                    key = mode if code == 0 else f"{mode}_{zbm}"

                    def run(code=code, zbm=zbm):
                        _gemm_zero[grid](a, b, c, z, m, n, k_dim, zm, MODE=code, BM=128, BN=256, BK=64, ZBM=zbm,
                                         STAGES=4, num_warps=8)
                    try:
                        z.fill_(1.0)
                        run()
                        torch.cuda.synchronize()
                        ok = bool((z == 0).all()) if code else True
                        ok = ok and torch.allclose(c.float(), (a.float() @ b.float()), atol=0.1, rtol=0.02)
                        r[key] = round(do_bench_cudagraph(run, rep=40, return_mode="median") * 1000, 1)
                        if not ok:
                            r[key + "_wrong"] = True
                    except Exception as err:  # noqa: BLE001 (a variant that does not compile: record it)
                        r[key + "_error"] = str(err).splitlines()[0][:200]
            r["fill"] = round(do_bench_cudagraph(z.zero_, rep=40, return_mode="median") * 1000, 1)

            def gemm_fill():
                _gemm_zero[grid](a, b, c, z, m, n, k_dim, zm, MODE=0, BM=128, BN=256, BK=64, ZBM=32, STAGES=4,
                                 num_warps=8)
                z.zero_()
            r["gemm+fill"] = round(do_bench_cudagraph(gemm_fill, rep=40, return_mode="median") * 1000, 1)
            for key in list(r):
                if key.startswith(("st_", "tma_")) and isinstance(r[key], float):
                    r[key + "_hidden"] = round((r["gemm"] + r["fill"] - r[key]) / r["fill"], 2)
            print(r, flush=True)
            rows.append(r)
    with open(path, "w") as f:
        json.dump({"environment": environment(), "command": " ".join(sys.argv), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
