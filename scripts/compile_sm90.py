"""Compile the SEBP kernels for sm_90 without a GPU and report pipelining (cp.async) and wgmma use.

Catches frontend errors and unpipelined main loops before spending device time. Integer arguments get the
divisibility-by-16 hint the JIT gives real shapes; unit strides are constants, as the JIT specialises them.
"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sebp_kernels._triton import dw, dx, select
from sebp_kernels._triton.tuning import dw_configs, dx_configs

TARGET = GPUTarget("cuda", 90, 32)


def compile_one(name, fn, sig, consts, **opts):
    names = list(fn.arg_names)
    full = {}
    for n in names:
        full[n] = "constexpr" if n in consts else sig[n]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if n not in consts and (t.startswith("*") or t == "i32")}
    try:
        k = triton.compile(ASTSource(fn=fn, signature=full, constexprs=consts, attrs=attrs),
                           target=TARGET, options=opts)
    except Exception as e:  # report and go on
        print(f"{name:34s} FAIL {type(e).__name__}: {str(e)[:1500]}")
        return
    ptx = k.asm["ptx"]
    print(f"{name:34s} ok  cp.async={ptx.count('cp.async.cg') + ptx.count('cp.async.ca'):4d} "
          f"wgmma={ptx.count('wgmma.mma_async'):3d} shared={k.metadata.shared}")


def main():
    for dt in ("bf16", "fp16", "fp32"):
        p = "*" + dt
        compile_one(f"flags {dt}", select._row_flags_kernel,
                    dict(dy_ptr=p, flags_ptr="*i8", block_count_ptr="*i32", M="i32", N="i32", stride_m="i32",
                         eps="fp32"), dict(stride_n=1, MODE=1, BLOCK_R=16, BLOCK_C=512), num_warps=4)
        compile_one(f"sumsq {dt}", select._row_sumsq_kernel,
                    dict(dy_ptr=p, out_ptr="*fp32", M="i32", N="i32", stride_m="i32"),
                    dict(stride_n=1, BLOCK_R=16, BLOCK_C=512), num_warps=4)
        ieee = dt == "fp32"
        for cfg in dx_configs():
            kw = cfg.kwargs
            compile_one(f"dx {dt} {kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} s{cfg.num_stages}w{cfg.num_warps}",
                        dx._dx_kernel,
                        dict(dy_ptr=p, w_ptr=p, dx_ptr=p, perm_ptr="*i32", count_ptr="*i32", M="i32", N="i32",
                             K="i32", ROWS_HINT="i32", stride_dym="i32", stride_wk="i32", stride_dxm="i32"),
                        dict(stride_dyk=1, stride_wn=1, stride_dxn=1, EVEN_K=True, IEEE=ieee, **kw),
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        for cfg in dw_configs():
            kw = cfg.kwargs
            for part in (False, True):
                q = "*fp32" if part else p
                compile_one(f"dw {dt} {kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} "
                            f"s{cfg.num_stages}w{cfg.num_warps} p{int(part)}", dw._dw_kernel,
                            dict(dy_ptr=p, x_ptr=p, dw_ptr=q, db_ptr=q, perm_ptr="*i32", count_ptr="*i32",
                                 M="i32", N_OUT="i32", N_IN="i32", SPLIT="i32", ROWS_HINT="i32", stride_dym="i32",
                                 stride_xm="i32"),
                            dict(stride_dyo=1, stride_xi=1, HAS_DB=True, USE_PARTIAL=part, IEEE=ieee,
                                 ROW_ALIGN=64, MIN_CHUNK=512, **kw),
                            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            if dt != "bf16":
                break
    compile_one("compact", select._compact_kernel,
                dict(flags_ptr="*i8", block_count_ptr="*i32", perm_ptr="*i32", count_ptr="*i32", M="i32",
                     NB="i32"), dict(BLOCK_R=16, BLOCK_NB=1024), num_warps=4)
    compile_one("reduce", dw._dw_reduce_kernel,
                dict(part_ptr="*fp32", dbpart_ptr="*fp32", dw_ptr="*bf16", db_ptr="*bf16", count_ptr="*i32",
                     NUMEL="i32", N_OUT="i32", SPLIT="i32", NBLK_W="i32"),
                dict(HAS_DB=True, ROW_ALIGN=64, MIN_CHUNK=512, BLOCK=1024), num_warps=4)


if __name__ == "__main__":
    main()
