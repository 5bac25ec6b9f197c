"""Where a model bench entry's step spends its time: torch.profiler over one step of each of a layout's batches.

    python benchmarks/step_profile.py --case qwen2.5-0.5b-sft --layout packed \
        --entries dense:labelled,cce:labelled --compile --out-dir /tmp/prof

The entries are the model bench's (``sebp-probe bench --scope model``: method:head, on the same pool of batches,
bf16); ``--compile`` compiles each layer as the bench's ``layers`` scope does, after ``--warmup`` steps a batch
(compiles included there). Per entry, ``<entry>.txt`` in ``--out-dir``: the operators by device time and by
host time, and the wall and device milliseconds of the profiled steps. A diagnosis, not a benchmark: the
profiler's own cost is in its wall times; time entries with ``sebp-probe bench``.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: the repository's packages

from sebp_probe.bench.bench_cases import MODEL_CASES  # noqa: E402
from sebp_probe.train.compiling import compile_layers, layer_compile_options  # noqa: E402
from sebp_probe.bench.bench_model import _pool, _step_fn, build_model, sebp_patched  # noqa: E402
from sebp_probe.data.train_data import to_device  # noqa: E402
from sebp_probe.model.packing import attention_backend  # noqa: E402


class HostCalls:
    """Host milliseconds of each eager SEBP linear backward (``SEBPLinearFunction.backward``, the layers a
    compiled run leaves eager) while active, and with ``cprofile`` a cProfile of those calls (on the thread that
    runs them: autograd's device thread). Patches the class's backward while entered."""

    def __init__(self):
        self.ms: list[float] = []
        self.slow: list[str] = []  # what each call over SLOW_MS did: its shapes, path, compiles, ticket growth
        self.stats: pstats.Stats | None = None
        self.active = self.cprofile = False

    SLOW_MS = 5.0

    def __enter__(self):
        from sebp_kernels.functional import SEBPLinearFunction

        self._orig = SEBPLinearFunction.__dict__["backward"]
        fn = self._orig.__func__

        def backward(ctx, dy):
            if not self.active:
                return fn(ctx, dy)
            prof = cProfile.Profile() if self.cprofile else None
            before = _kernel_state(dy.device)
            density = getattr(ctx.state, "density", None)
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            try:
                return fn(ctx, dy)
            finally:
                if prof is not None:
                    prof.disable()
                    if self.stats is None:
                        self.stats = pstats.Stats(prof)
                    else:
                        self.stats.add(prof)
                ms = (time.perf_counter() - t0) * 1e3
                self.ms.append(ms)
                if ms > self.SLOW_MS:
                    after = _kernel_state(dy.device)
                    self.slow.append(f"{ms:.1f} ms: dY {tuple(dy.shape)}, W {tuple(ctx.saved_tensors[1].shape)}, "
                                     f"density before {density}, after {getattr(ctx.state, 'density', None)}; "
                                     f"compiled kernels {before[0]} -> {after[0]}, tickets {before[1]} -> {after[1]}")

        SEBPLinearFunction.backward = staticmethod(backward)
        self._cls = SEBPLinearFunction
        return self

    def __exit__(self, *exc):
        self._cls.backward = self._orig

    def summary(self, what: str) -> str:
        ms, self.ms = self.ms, []
        slow, self.slow = self.slow, []
        if not ms:
            return f"{what}: no eager SEBP linear backward ran\n"
        q = sorted(ms)
        return (f"{what}: {len(ms)} calls, host ms median {statistics.median(q):.3f}, p90 {q[int(0.9 * (len(q) - 1))]:.3f}, "
                f"max {q[-1]:.3f}, sum {sum(q):.1f}\n" + "".join(f"  slow call {line}\n" for line in slow))

    def cprofile_table(self) -> str:
        if self.stats is None:
            return "no cProfile\n"
        buf = io.StringIO()
        self.stats.stream = buf
        self.stats.sort_stats("tottime").print_stats(30)
        return buf.getvalue()


def _kernel_state(device: torch.device) -> tuple[int, int]:
    """(Triton kernels compiled so far by the SEBP launchers, int32 tickets allocated on ``device``): what a slow
    call may have grown (-1 where this Triton keeps its caches elsewhere)."""
    from sebp_kernels._triton import dw, dx, grads, select

    try:
        compiled = sum(len(c[0]) for k in (grads._grads, dx._dx, select._row_flags, select._compact)
                       for c in k.fn.device_caches.values())
    except (AttributeError, TypeError, IndexError):
        compiled = -1
    tickets = dw._TICKETS.get(device)
    return compiled, -1 if tickets is None else tickets.numel()


def _timed_steps(model, step, batches: list[dict], repeats: int) -> list[float]:
    """Each batch's step (forward, backward) in ms of wall, the GPU synchronized around it: the median of
    ``repeats``."""
    out = []
    for b in batches:
        times = []
        for _ in range(repeats):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(model, b).backward()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        out.append(statistics.median(times))
    return out


def profile_entry(model, case, method: str, head: str, batches: list[dict], warmup: int, compile: bool,
                  norms: bool = False, acts: bool = False, shapes: bool = False, stack: bool = False,
                  host_calls: bool = False) -> str:
    step = _step_fn(method, head)
    calls = HostCalls() if host_calls and method == "sebp" else None
    extra = ""
    torch._dynamo.reset()
    with (sebp_patched(model, case, head, "exact", norms, acts, False) if method == "sebp"
          else contextlib.nullcontext()):
        # compiled after the patch, as the bench compiles: SEBP layers carry their keys as graph inputs
        undo = compile_layers(model, **layer_compile_options("default", one_shape=False)) if compile else None
        try:
            for b in batches:
                for _ in range(warmup):
                    model.zero_grad(set_to_none=True)
                    step(model, b).backward()
            torch.cuda.synchronize()
            if host_calls:  # before the profiler: its launch hooks and records cost host time of their own
                with calls or contextlib.nullcontext():
                    if calls is not None:
                        calls.active = True
                    rows = [int(b["input_ids"].numel()) for b in batches]
                    ms = _timed_steps(model, step, batches, 3)
                    extra += "steps without the profiler (median of 3, ms; rows): " + ", ".join(
                        f"{r}:{t:.1f}" for r, t in zip(rows, ms)) + f"; total {sum(ms):.1f}\n"
                    if calls is not None:
                        extra += calls.summary("eager SEBP linear backwards (no profiler)")
                        calls.cprofile = True
                        for b in batches:
                            model.zero_grad(set_to_none=True)
                            step(model, b).backward()
                        torch.cuda.synchronize()
                        extra += calls.summary("eager SEBP linear backwards (under cProfile)")
                        extra += "cProfile of those calls, by own time\n" + calls.cprofile_table()
                        calls.active = False
            kinds = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            t0 = time.perf_counter()
            with torch.profiler.profile(activities=kinds, record_shapes=shapes, with_stack=stack) as prof:
                for b in batches:
                    model.zero_grad(set_to_none=True)
                    step(model, b).backward()
                torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
        finally:
            if undo is not None:
                undo()
            model.zero_grad(set_to_none=True)
    table = prof.key_averages()
    # the kernels' own rows (as the table's "Self CUDA time total"): an operator's row repeats its kernels' time
    device_ms = sum(e.self_device_time_total for e in table
                    if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation) / 1e3
    fused = "+norms" * norms + "+acts" * acts if method == "sebp" else ""
    return (f"{method}{fused}:{head}{' compiled (layers)' if compile else ''}: {len(batches)} steps, wall {wall:.1f} ms "
            f"(profiled), device busy {device_ms:.1f} ms\n" + (f"\n{extra}" if extra else "") + "\nby device time\n"
            + table.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=80)
            + "\n\nby host time\n" + table.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=80)
            + ("\n\nby device time and input shapes\n" + prof.key_averages(group_by_input_shape=True).table(
                sort_by="self_cuda_time_total", row_limit=60, max_name_column_width=60, max_shapes_column_width=120)
               if shapes else "")
            + ("\n\nby own host time and Python stack (5 frames)\n" + prof.key_averages(group_by_stack_n=5).table(
                sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60) if stack else ""))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--case", default="qwen2.5-0.5b-sft", choices=list(MODEL_CASES))
    p.add_argument("--layout", default="packed")
    p.add_argument("--entries", default="dense:labelled,cce:labelled", help="method:head, comma-separated")
    p.add_argument("--batches", type=int, default=6, help="the pool's batches (the bench's --model-batches)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="each layer compiled, as the bench's layers scope")
    p.add_argument("--norms", action="store_true", help="SEBP entries: the norms too (the bench's --norms)")
    p.add_argument("--acts", action="store_true", help="SEBP entries: the MLP activations too (the bench's --acts)")
    p.add_argument("--shapes", action="store_true", help="also a table by operator and input shapes")
    p.add_argument("--stack", action="store_true",
                   help="also a table by own host time and Python stack (where a step's host time goes)")
    p.add_argument("--host-calls", action="store_true",
                   help="before the profile: each batch's step timed without a profiler, and the host time of the "
                        "eager SEBP linear backwards (a compiled run's eager layers), then under cProfile")
    p.add_argument("--out-dir", required=True)
    opts = p.parse_args()
    if not torch.cuda.is_available():
        p.error("the profile needs a CUDA GPU")
    case, dev = MODEL_CASES[opts.case], torch.device("cuda")
    model = build_model(case, torch.bfloat16, dev)
    batches, _ = _pool(case, model.config, opts.batches, 0, attention_backend(model), True)
    on_device = [to_device(b, dev) for b in batches[opts.layout]]
    out = Path(opts.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for entry in opts.entries.split(","):
        method, head = entry.split(":")
        text = profile_entry(model, case, method, head, on_device, opts.warmup, opts.compile, opts.norms, opts.acts,
                             opts.shapes, opts.stack, opts.host_calls)
        fused = "_norms" * opts.norms + "_acts" * opts.acts if method == "sebp" else ""
        name = f"{opts.case}_{opts.layout}_{method}_{head}{fused}{'_compiled' if opts.compile else ''}.txt"
        command = " ".join(["python", "benchmarks/step_profile.py", *sys.argv[1:]])
        (out / name).write_text(f"command: {command}\n{text}\n")
        print(text.split("\nby device time")[0], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
