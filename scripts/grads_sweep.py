"""Tile settings of the fused gradient kernel (dX, dW, db in one launch) over the BERT-base and Llama-3.2-3B
layer shapes, with the active rows known (no selection pass: the GEMM part alone), against the current
setting (``tuning.DW_CONFIG`` tiles for both roles, ``DX_CONFIG``'s pipeline depth for dX) and against the
ideal (cuBLAS on the k active rows laid out contiguously). Timed as ``sebp-probe bench`` times: CUDA-graph
replays, L2 flushed before each repeat, the settings taking turns within each repeat; bf16, right-padded rows.

    python scripts/grads_sweep.py [out.json]
"""
import datetime
import json
import sys

import torch
import triton

from sebp_kernels import SEBPConfig
from sebp_kernels._triton import grads, tuning
from sebp_kernels._triton.backward import sebp_backward_triton
from sebp_kernels._triton.select import select_rows_device
from dense_gap import layer_shapes, operands  # (scripts/ is the first entry of sys.path when a script in it runs)
from sebp_probe.bench import _Flush, _prepared, padded_rows, time_methods

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages of dW, pipeline depth of dX)
SETTINGS = [
    (128, 256, 64, 8, 8, 3, 4),  # current
    (128, 256, 64, 8, 8, 4, 4),
    (128, 256, 64, 4, 8, 3, 4),
    (128, 256, 64, 16, 8, 3, 4),
    (128, 256, 32, 8, 8, 5, 5),
    (128, 128, 64, 8, 4, 4, 4),
    (128, 128, 64, 8, 8, 4, 4),
    (256, 128, 64, 8, 8, 3, 3),
]


def use(setting):
    bm, bn, bk, gm, warps, stages, dx_stages = setting
    tuning.DW_CONFIG.update(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=warps, num_stages=stages)
    tuning.DX_CONFIG.update(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=warps, num_stages=dx_stages)
    grads._PLANS._plans.clear()
    grads._grads.clear()


def main():
    dev = torch.device("cuda")
    flush = _Flush()
    cfg = SEBPConfig("exact")
    keep_dw, keep_dx = dict(tuning.DW_CONFIG), dict(tuning.DX_CONFIG)
    out = []
    for shape, g in layer_shapes(dev):
        x, w, full = operands(shape, g)
        m = shape.rows
        for density in (0.1, 0.2, 0.5):
            mask = padded_rows(m, shape.seq, density, dev)
            rows = mask.nonzero().squeeze(1)
            dy = full * mask.unsqueeze(1).to(torch.bfloat16)
            dy_k, x_k = dy[rows].contiguous(), x[rows].contiguous()
            known = select_rows_device(dy, "exact")
            bias = shape.bias
            want = sebp_backward_triton(dy, x, w, cfg, True, True, bias, rows=known)
            methods = {"ideal": (lambda: (dy_k @ w, dy_k.t() @ x_k, dy_k.sum(0) if bias else None), True)}
            for s in SETTINGS:
                use(s)
                got = sebp_backward_triton(dy, x, w, cfg, True, True, bias, rows=known)
                for a, b in zip(got, want):
                    if a is not None:
                        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
                # captured now, while this setting is in force (the graph keeps its kernel); time_methods
                # then replays it eagerly
                replay = _prepared(lambda: sebp_backward_triton(dy, x, w, cfg, True, True, bias, rows=known),
                                   True)
                methods["x".join(map(str, s))] = (replay, False)
            us = {k: round(v * 1e3, 2) for k, v in time_methods(methods, 20, flush).items()}
            cur = "x".join(map(str, SETTINGS[0]))
            best = min((k for k in us if k != "ideal"), key=us.get)
            print(f"{shape.name} d={density}: ideal {us['ideal']}, current {us[cur]}, best {best} {us[best]}",
                  flush=True)
            out.append({"shape": shape.name, "density": density, "us": us})
    tuning.DW_CONFIG.clear()
    tuning.DW_CONFIG.update(keep_dw)
    tuning.DX_CONFIG.clear()
    tuning.DX_CONFIG.update(keep_dx)
    report(out, [k for k in out[0]["us"] if k != "ideal"], "grads_sweep.py", {"settings": SETTINGS})


def report(out: list, keys: list, script: str, extra: dict) -> None:
    """Print each setting's mean ratio to the best one over all points (``out[i]["us"]``), best first, and
    with an output path as the first argument write the results there with the GPU, versions, date and
    command (also used by ``zero_programs_sweep.py``)."""
    score = {k: sum(o["us"][k] / min(o["us"][j] for j in keys) for o in out) / len(out) for k in keys}
    for k in sorted(score, key=score.get):
        print(f"mean ratio to the best setting {score[k]:.3f}: {k}")
    if len(sys.argv) > 1:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "command": f"python scripts/{script} " + sys.argv[1], **extra,
                   "results": out, "mean_ratio_to_best": score}, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
