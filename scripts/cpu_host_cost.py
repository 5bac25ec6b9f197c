"""Host time of the Triton SEBP backward's launch path on a machine without a GPU.

A stand-in CUDA driver lets Triton compile the kernels for sm_90 and run its whole host-side launch path
(binding, specialisation, cache lookup, the compiled launcher's Python side); only the C launcher call is a
no-op. The tensors are CPU tensors, so torch.empty costs what the CPU allocator costs. Good for comparing
host-side changes on one machine; absolute numbers differ from a GPU host's (``scripts/host_cost.py``).

    python scripts/cpu_host_cost.py
"""
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaDriver


class _Utils:
    def load_binary(self, name, kernel, shared, device):
        return (0, 0, 0, 0, 1024)

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132}


class _Launcher:
    def __init__(self, src, metadata):
        pass

    def __call__(self, *args):
        pass


class _StandInDriver(CudaDriver):
    def __init__(self):
        self.utils = _Utils()
        self.launcher_cls = _Launcher

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    @staticmethod
    def is_active():
        return True


def main():
    triton.runtime.driver.set_active(_StandInDriver())
    from triton import knobs

    from sebp_kernels import SEBPConfig
    from sebp_kernels._triton import backward as B
    from sebp_kernels._triton import grads as G
    from sebp_kernels._triton import launch as L
    from sebp_kernels._triton import select as S

    L._stream = lambda dev: 0  # take the compiled-launcher path as on a CUDA build
    for fl in (G._grads, S._row_flags, S._compact):
        fl._hooks = knobs.runtime
    B.supported = lambda *a, **k: True
    B._sm_count = lambda device: 132
    m, o, i = 4096, 768, 768
    dy = torch.randn(m, o, dtype=torch.bfloat16)
    dy[::3] = 0
    x = torch.randn(m, i, dtype=torch.bfloat16)
    w = torch.randn(o, i, dtype=torch.bfloat16)
    cfg = SEBPConfig()
    B.sebp_backward_triton(dy, x, w, cfg)  # compiles (for sm_90, not run)
    perm, count = S.select_rows_device(dy, "exact")

    def per_call(fn, n=1000, rounds=7):
        """The fastest of ``rounds`` rounds of ``n`` calls (other load on the machine only adds time)."""
        for _ in range(50):
            fn()
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - t0) / n * 1e6)
        return best

    from sebp_kernels._triton import norm as N

    for fl in (N._norm_bwd, N._sum_parts):
        fl._hooks = knobs.runtime
    nw, nb = torch.randn(i, dtype=torch.bfloat16), torch.randn(i, dtype=torch.bfloat16)
    mean, rstd = torch.randn(m), torch.rand(m)
    norm = lambda: N.norm_backward_triton(x, x, nw, mean, rstd, True, True, True, 132, False, nb.dtype)  # noqa: E731
    norm()  # compiles
    for name, fn in (("sebp_backward_triton", lambda: B.sebp_backward_triton(dy, x, w, cfg)),
                     ("norm_backward_triton (LayerNorm)", norm),
                     ("select_rows_device", lambda: S.select_rows_device(dy, "exact")),
                     ("grads_rows", lambda: G.grads_rows(dy, x, w, perm, count, True, True, True, False, 132)),
                     ("torch.empty (4096, 768) bf16", lambda: torch.empty((m, i), dtype=torch.bfloat16))):
        print(f"{name:32s} {per_call(fn):7.1f} us/call")


if __name__ == "__main__":
    main()
