"""Can the row selection hide under the GEMMs? (bf16, exact mode, CUDA-graph timings, microseconds)

Per BERT-base / Llama-3.2-3B layer shape at densities 0.1 / 0.2 / 0.5 (right padding):

- ``ideal``: cuBLAS dX and dW (and db) on the k active rows laid out contiguously (the bench's ideal);
- ``select``, ``grads``: the two halves of the SEBP backward alone; ``sebp``: both, one after the other;
- ``concurrent``: the selection of a *different* dY on a second stream while the gradient kernel runs on
  this one (independent work: how much of the selection the GPU can overlap at all);
- ``pipe2`` / ``pipe4``: a prototype pipeline of the real backward: dY cut into 2 or 4 row chunks, chunk
  c+1 selected on a second stream while chunk c's gradients run here; the chunks' dW and db are added
  afterwards (in bf16: a timing prototype, not the production path), the dX chunks stay separate tensors.

    python scripts/overlap_probe.py out.json
"""
import sys

import torch

from sebp_kernels._triton.backward import _ieee
from sebp_kernels._triton.grads import grads_rows
from sebp_kernels._triton.select import _sm_count, select_rows_device

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from dense_gap import bench, layer_shapes, operands, padded, write_rows  # noqa: E402


def forked(side, fn):
    """Run ``fn`` on stream ``side``, ordered after the work queued so far and joined back afterwards."""
    cur = torch.cuda.current_stream()
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        out = fn()
    return out


def pipeline(dy, x, w, b, chunks, side, ie, n_sm):
    """The chunked prototype: select chunk c+1 on ``side`` while chunk c's gradients run here."""
    cur = torch.cuda.current_stream()
    m = dy.shape[0]
    step = -(-m // chunks)
    parts = [(dy[i:i + step], x[i:i + step]) for i in range(0, m, step)]
    sel = [None] * len(parts)
    sel[0] = select_rows_device(parts[0][0], "exact")
    dxs, dws, dbs = [], [], []
    for c, (dyc, xc) in enumerate(parts):
        if c + 1 < len(parts):
            sel[c + 1] = forked(side, lambda c=c: select_rows_device(parts[c + 1][0], "exact"))
        perm, count = sel[c]
        dx, dw, db = grads_rows(dyc, xc, w, perm, count, True, True, b, ie, n_sm)
        dxs.append(dx), dws.append(dw), dbs.append(db)
        cur.wait_stream(side)
    dw = dws[0]
    for extra in dws[1:]:
        dw = dw + extra
    if b:
        db = dbs[0]
        for extra in dbs[1:]:
            db = db + extra
    return dxs, dw


def main(path):
    dev = torch.device("cuda")
    n_sm = _sm_count(dev)
    side = torch.cuda.Stream()
    rows = []
    for shape, g in layer_shapes(dev):
        x, w, dy_full = operands(shape, g)
        other_full = torch.randn(dy_full.shape, device=dev, dtype=torch.bfloat16, generator=g)
        for d in (0.1, 0.2, 0.5):
            dy, mask = padded(dy_full, shape, d)
            other, _ = padded(other_full, shape, d)
            act = mask.nonzero().squeeze(1)
            dy_k, x_k = dy.index_select(0, act).contiguous(), x.index_select(0, act).contiguous()
            perm, count = select_rows_device(dy, "exact")
            ie, b = _ieee(dy.dtype), shape.bias
            r = {"shape": shape.name, "density": d, "k": int(act.numel())}
            r["ideal"] = bench(lambda: (dy_k @ w, dy_k.t() @ x_k, dy_k.sum(0) if b else None))
            r["select"] = bench(lambda: select_rows_device(dy, "exact"))
            r["grads"] = bench(lambda: grads_rows(dy, x, w, perm, count, True, True, b, ie, n_sm))

            def sebp():
                p, c = select_rows_device(dy, "exact")
                return grads_rows(dy, x, w, p, c, True, True, b, ie, n_sm)

            def concurrent():
                sel = forked(side, lambda: select_rows_device(other, "exact"))
                out = grads_rows(dy, x, w, perm, count, True, True, b, ie, n_sm)
                torch.cuda.current_stream().wait_stream(side)
                return sel, out

            r["sebp"] = bench(sebp)
            r["concurrent"] = bench(concurrent)
            for c in (2, 4):
                r[f"pipe{c}"] = bench(lambda c=c: pipeline(dy, x, w, b, c, side, ie, n_sm))
            r["share_sebp"] = round(r["ideal"] / r["sebp"], 3)
            r["share_pipe_best"] = round(r["ideal"] / min(r["pipe2"], r["pipe4"]), 3)
            r["overlap_hidden"] = round((r["select"] + r["grads"] - r["concurrent"]) / r["select"], 3)
            print(r, flush=True)
            rows.append(r)
    write_rows(path, rows)


if __name__ == "__main__":
    main(sys.argv[1])
