"""Does a driver memset (or a device-to-device copy) of dX's zero rows hide beside the fused gradient kernel?

``scripts/coresidency_probe.py`` found that a zero fill made by a kernel (``Tensor.zero_``) on a second stream
mostly runs after the gradient kernel: that kernel holds every SM. A fill that needs no SM would hide. This
probe times, per BERT-base / Llama-3.2-3B layer shape at densities 0.1 and 0.2 (right padding, bf16, exact
mode, CUDA-graph replays, microseconds), as many bytes as dX's zero rows written by

- ``zero_``: ``Tensor.zero_`` (an elementwise kernel);
- ``memset``: the driver's ``cuMemsetD32Async``;
- ``copy``: the driver's ``cuMemcpyDtoDAsync`` from a zeroed buffer of the same size;

each alone (``<fill>``), on a second stream while the gradient kernel runs (``<fill>_both``), and after it
(``<fill>_serial``); ``<fill>_hidden`` = (grads + fill - both) / fill: 1 when the fill costs nothing beside
the kernel, 0 when it runs after it.

    python scripts/memset_probe.py out.json
"""
import ctypes
import sys

import torch

from sebp_kernels._triton.backward import _ieee
from sebp_kernels._triton.grads import grads_rows
from sebp_kernels._triton.select import _sm_count

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from dense_gap import bench, selected, write_rows  # noqa: E402

_cuda = ctypes.CDLL("libcuda.so.1")
_cuda.cuMemsetD32Async.argtypes = [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p]
_cuda.cuMemcpyDtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]


def _check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} failed: CUresult {rc}")


def memset(buf):
    """Zero ``buf`` (a multiple of 4 bytes) with the driver's memset on the current stream."""
    n = buf.numel() * buf.element_size()
    _check(_cuda.cuMemsetD32Async(buf.data_ptr(), 0, n // 4, torch.cuda.current_stream().cuda_stream),
           "cuMemsetD32Async")


def copy_from(src):
    def run(buf):
        n = buf.numel() * buf.element_size()
        _check(_cuda.cuMemcpyDtoDAsync_v2(buf.data_ptr(), src.data_ptr(), n, torch.cuda.current_stream().cuda_stream),
               "cuMemcpyDtoDAsync")
    return run


def main(path):
    dev = torch.device("cuda")
    n_sm = _sm_count(dev)
    side = torch.cuda.Stream()
    rows = []
    for shape, x, w, d, dy, k, perm, count in selected(dev, (0.1, 0.2)):
        ie, b = _ieee(dy.dtype), shape.bias
        n = (shape.rows - k) * shape.in_features
        n += n % 2  # whole 4-byte words
        buf = torch.empty(n, dtype=dy.dtype, device=dev)
        zeros = torch.zeros_like(buf)

        def grads():
            return grads_rows(dy, x, w, perm, count, True, True, b, ie, n_sm)

        r = {"shape": shape.name, "density": d, "k": k, "fill_mib": round(n * 2 / 2**20, 1), "grads": bench(grads)}
        for name, fill in (("zero_", torch.Tensor.zero_), ("memset", memset), ("copy", copy_from(zeros))):

            def both(fill=fill):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fill(buf)
                out = grads()
                torch.cuda.current_stream().wait_stream(side)
                return out

            def serial(fill=fill):
                fill(buf)
                return grads()

            r[name] = bench(lambda fill=fill: fill(buf))
            r[name + "_both"] = bench(both)
            r[name + "_serial"] = bench(serial)
            r[name + "_hidden"] = round((r["grads"] + r[name] - r[name + "_both"]) / r[name], 3)
        print(r, flush=True)
        rows.append(r)
    write_rows(path, rows)


if __name__ == "__main__":
    main(sys.argv[1])
