"""How many SMs the persistent dW programs should get when the active rows are one run (bf16, us).

In the fused gradient kernel, with the active rows one run of dY (a batch of one padded sequence), dW is done
by ``grads.RUN_SHARE`` of the SMs' worth of persistent programs (``dw._dw_run``) while the dX programs take
the other SMs. Per Llama-3.2-3B layer shape (batch 1, right padding) and density, the whole SEBP backward
(selection included) and the fused kernel alone (rows known), timed as the per-layer bench, for shares 0
(the run path off: the tiles as before), 0.25, 0.5, 0.75 and 1, against the ideal.

    python scripts/run_share_sweep.py out.json [--repeats 20]
"""
import argparse
import sys

import torch

from sebp_kernels import SEBPConfig
from sebp_kernels._triton import grads as G
from sebp_kernels._triton import dw as DW
from sebp_kernels._triton import sebp_backward_triton
from sebp_kernels._triton.select import select_rows_device
from sebp_probe.bench import _Flush, resolve_shapes, time_methods

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from dense_gap import operands, padded, write_rows  # noqa: E402

SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)


def with_share(share, fn):
    def run():
        G.RUN_SHARE = share
        DW.RUN_TMA = share > 0
        try:
            return fn()
        finally:
            G.RUN_SHARE, DW.RUN_TMA = 0.5, True
    return run


def main(path, repeats):
    dev = torch.device("cuda")
    flush = _Flush()
    rows = []
    for shape in resolve_shapes("llama-3.2-3b"):
        x, w, dy_full = operands(shape, torch.Generator(device=dev).manual_seed(0))
        for d in (0.05, 0.1, 0.2, 0.5):
            dy, mask = padded(dy_full, shape, d)
            act = mask.nonzero().squeeze(1)
            dy_k, x_k = dy.index_select(0, act).contiguous(), x.index_select(0, act).contiguous()
            known = select_rows_device(dy, "exact")
            cfg, b = SEBPConfig("exact"), shape.bias
            methods = {"ideal": (lambda: (dy_k @ w, dy_k.t() @ x_k), True)}
            for s in SHARES:
                methods[f"sebp_{s}"] = (with_share(s, lambda: sebp_backward_triton(dy, x, w, cfg, True, True, b)),
                                        True)
                methods[f"rows_{s}"] = (with_share(s, lambda: sebp_backward_triton(dy, x, w, cfg, True, True, b,
                                                                                    rows=known)), True)
            us = {n: round(ms * 1000, 1) for n, ms in time_methods(methods, repeats, flush).items()}
            r = {"shape": shape.name, "density": d, "k": int(act.numel()), "us": us,
                 "share_of_ideal": {n: round(us["ideal"] / v, 3) for n, v in us.items() if n != "ideal"}}
            print(r, flush=True)
            rows.append(r)
    write_rows(path, rows)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    main(a.out, a.repeats)
