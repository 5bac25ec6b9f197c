"""Run ``python -m sebp_probe ARGS`` and log each Triton JIT compile and each training step's start, to stderr.

A compile in the middle of a run (a kernel specialised anew for an argument that changed) stalls that step by
seconds, and under FSDP the other process with it. Each compile line names the kernel, the seconds since the
start, its warps and stages and the constexprs that pick its variant; for the fused gradient and compaction
kernels also the arguments Triton specialised (``ATTRS``: 16-byte alignment or divisibility by 16) and the
signature (``SIG``), which tell two compiles of the same variant apart. Used for
results/finetune_gpu_h200/raw/jit_s40.log.

Usage: python benchmarks/jit_log.py finetune MODEL DATA [finetune options] 2> jit.log
"""
from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

T0 = time.time()
KEEP = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "DO_DX", "DO_DW", "DO_DB", "EVEN_K", "BIG", "DX_REUSE", "DX_MIN_K", "MIN_K",
        "HAS_BIAS", "DX_STAGES", "STAGES", "IEEE", "DX_ZERO_PROGRAMS")
DETAIL = ("_grads_kernel", "_compact_kernel")  # the kernels whose specialised arguments are logged too


def _named(keys: dict, names: dict) -> dict:
    """``keys`` (Triton's, by argument index or (index,) tuples) by argument name."""
    return {names.get(k[0] if isinstance(k, tuple) else k, k): v for k, v in keys.items()}


def compile_line(kernel: str, seconds: float, info: dict, names: dict) -> list[str]:
    """The log lines of one compile: ``info`` is the ``compile`` dict Triton passes its JIT hook."""
    consts = {k: v for k, v in _named(info.get("constants") or {}, names).items() if k in KEEP}
    lines = [f"JIT {seconds:7.1f}s {kernel} warps={info.get('num_warps')} stages={info.get('num_stages')} {consts}"]
    if kernel in DETAIL:
        attrs = info.get("configs")
        attrs = attrs[0] if isinstance(attrs, (list, tuple)) and attrs else attrs
        lines.append(f"   ATTRS {_named(attrs or {}, names)}")
        lines.append(f"   SIG {_named(info.get('signature') or {}, names)}")
    return lines


def _hook(*_, **kw):
    fn = kw.get("fn")
    try:
        names = dict(enumerate(p.name for p in fn.jit_function.params))
    except AttributeError:
        names = {}
    for line in compile_line(getattr(fn, "name", "?"), time.time() - T0, kw.get("compile") or {}, names):
        print(line, file=sys.stderr, flush=True)
    return False  # compile as usual


def main() -> None:
    from triton import knobs

    from sebp_probe.train import train_step

    knobs.runtime.jit_cache_hook = _hook
    run, steps = train_step.MicroBatches.run, [0]

    def logged(self, *a, **k):
        steps[0] += 1
        print(f"STEP {steps[0]} {time.time() - T0:7.1f}s", file=sys.stderr, flush=True)
        return run(self, *a, **k)

    train_step.MicroBatches.run = logged
    sys.argv = ["sebp_probe", *sys.argv[1:]]
    runpy.run_module("sebp_probe", run_name="__main__")


if __name__ == "__main__":
    main()
