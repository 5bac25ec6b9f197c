"""How many programs should zero the dirty rows of a kept dX (``dx.ZERO_PROGRAMS_PER_SM``)?

For each BERT-base and Llama-3.2-3B layer shape and density 0.05-0.5, with the active rows known (the kernels
alone), times the fused gradient kernel writing a fresh dX (every zero row) and writing into a
``ZeroRowBuffer`` with 1, 2, 4 and 8 zero programs per SM, against the ideal (cuBLAS on the k active rows laid
out contiguously). A kept dX takes turns between right- and left-padded rows of the same density (each call
zeroes the other's k rows), as ``sebp-probe bench`` does. Timed as the bench times: CUDA-graph replays, L2
flushed before each repeat, the methods taking turns within each repeat; bf16.

    python scripts/zero_programs_sweep.py [out.json]
"""
import torch
from dense_gap import layer_shapes, operands  # (scripts/ is the first entry of sys.path when a script in it runs)
from grads_sweep import report

from sebp_kernels import SEBPConfig
from sebp_kernels._triton import dx as dx_module
from sebp_kernels._triton.backward import sebp_backward_triton
from sebp_kernels._triton.select import select_rows_device
from sebp_kernels.zero_rows import ZeroRowBuffer
from sebp_probe.bench import _Flush, _prepared, padded_rows, time_methods

PER_SM = (1, 2, 4, 8)


def main():
    dev = torch.device("cuda")
    flush = _Flush()
    cfg = SEBPConfig("exact")
    keep = dx_module.ZERO_PROGRAMS_PER_SM
    out = []
    for shape, g in layer_shapes(dev):
        x, w, full = operands(shape, g)
        m, n_in = shape.rows, shape.in_features
        for density in (0.05, 0.1, 0.2, 0.5):
            mask = padded_rows(m, shape.seq, density, dev)
            rows = mask.nonzero().squeeze(1)
            dy = full * mask.unsqueeze(1).to(torch.bfloat16)
            dy_b = full * mask.flip(0).unsqueeze(1).to(torch.bfloat16)
            dy_k, x_k = dy[rows].contiguous(), x[rows].contiguous()
            known, known_b = select_rows_device(dy, "exact"), select_rows_device(dy_b, "exact")
            bias = shape.bias
            want = sebp_backward_triton(dy, x, w, cfg, True, True, bias, rows=known)
            methods = {
                "ideal": (lambda: (dy_k @ w, dy_k.t() @ x_k, dy_k.sum(0) if bias else None), True),
                "fresh": (lambda: sebp_backward_triton(dy, x, w, cfg, True, True, bias, rows=known), True)}
            pooled, alive = {}, []  # the graphs write into the buffers: keep each alive while they replay
            for v in PER_SM:
                dx_module.ZERO_PROGRAMS_PER_SM = v
                buf = ZeroRowBuffer(m, n_in, torch.bfloat16, dev)
                alive.append(buf)
                for _ in range(2):  # the buffer's first calls zero everything; then the check holds
                    sebp_backward_triton(dy_b, x, w, cfg, True, True, bias, rows=known_b, dx_buffer=buf)
                    got = sebp_backward_triton(dy, x, w, cfg, True, True, bias, rows=known, dx_buffer=buf)
                for a, b in zip(got, want):
                    if a is not None:
                        assert torch.equal(a, b)
                # captured now, while this setting is in force (the plan keys on it)
                methods[f"kept{v}"] = (_prepared(lambda: sebp_backward_triton(
                    dy, x, w, cfg, True, True, bias, rows=known, dx_buffer=buf), True), False)
                methods[f"kept{v}_b"] = (_prepared(lambda: sebp_backward_triton(
                    dy_b, x, w, cfg, True, True, bias, rows=known_b, dx_buffer=buf), True), False)
                pooled[f"kept{v}_b"] = f"kept{v}"
            dx_module.ZERO_PROGRAMS_PER_SM = keep
            us = {k: round(v * 1e3, 2) for k, v in time_methods(methods, 20, flush, pooled).items()}
            share = {k: round(us["ideal"] / v, 3) for k, v in us.items() if k != "ideal"}
            print(f"{shape.name} d={density}: us {us}; share of ideal {share}", flush=True)
            out.append({"shape": shape.name, "density": density, "us": us, "share_of_ideal": share})
    report(out, [k for k in out[0]["us"] if k.startswith("kept")], "zero_programs_sweep.py", {"per_sm": PER_SM})


if __name__ == "__main__":
    main()
