"""Where a training run's steps spend their time, on each process: torch.profiler over a few optimizer steps of
every run the command makes (``finetune --compare`` makes two), hooked in through torch's global optimizer
step hook, so any training command runs unchanged.

    accelerate launch [...] benchmarks/step_trace.py --out /tmp/trace --steps 10:13 -- \\
        -m sebp_probe finetune MODEL DATA [...]

For each run (an optimizer, numbered as first seen) and process, ``<out>/run<i>_rank<r>.txt``: the wall
milliseconds of the profiled steps, the device time of every other kernel, copy and fill (on any stream: FSDP's
copy-in and copy-out too) merged into busy intervals and the share of the wall they cover, the collectives'
(NCCL) busy time and the part of it nothing else overlaps, and the operators by device time. Annotation spans
(``FSDP::all_gather``, ``nccl:all_reduce``: they lie over the kernels they name) are not device work. A run
shorter than the profiled steps writes nothing. A diagnosis, not a benchmark: the profiler's own cost is in the
wall times.
"""
from __future__ import annotations

import argparse
import itertools
import os
import runpy
import sys
import time
import weakref
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _uncovered(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the merged intervals ``a`` not covered by the merged intervals ``b``."""
    total, j = 0.0, 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                total += b[k][0] - cur
            cur = max(cur, b[k][1])
            k += 1
        total += max(0.0, e - cur)
    return total


def summarize(prof, wall_ms: float, steps: int) -> str:
    kernels = [e for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]
    comm = _merged([(e.time_range.start, e.time_range.end) for e in kernels if "nccl" in e.name.lower()])
    comp = _merged([(e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower()])
    busy = _length(comp)
    lines = [f"profiled steps: {steps}, wall {wall_ms / steps:.1f} ms a step",
             f"compute kernels busy: {busy / 1e3 / steps:.1f} ms a step ({busy / (1e3 * wall_ms):.0%} of the wall)",
             f"collectives busy: {_length(comm) / 1e3 / steps:.1f} ms a step; not under compute: "
             f"{_uncovered(comm, comp) / 1e3 / steps:.1f} ms a step",
             "", prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=45, max_name_column_width=70)]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", default="10:13", help="first:end optimizer steps of each run to profile (1-based)")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- -m MODULE args... or -- SCRIPT args...")
    a = ap.parse_args()
    first, end = (int(x) for x in a.steps.split(":"))
    if not 2 <= first < end:
        ap.error("--steps FIRST:END needs 2 <= FIRST < END (the profile starts after step FIRST-1's optimizer step)")
    rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    a.out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    runs = weakref.WeakKeyDictionary()  # optimizer -> {run, n, prof, t0} (an id could be reused by the next run's)
    seen = itertools.count(1)
    open_: list[dict] = []  # the run being profiled: one at a time, so a run that ends inside its profiled
    # steps keeps the later runs from being profiled

    def close(state: dict, write: bool) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = (time.perf_counter() - state["t0"]) * 1e3
        prof, state["prof"] = state["prof"], None
        prof.__exit__(None, None, None)
        open_.clear()
        if write:
            (a.out / f"run{state['run']}_rank{rank}.txt").write_text(summarize(prof, wall, end - first))

    def hook(opt, args, kwargs):
        if opt not in runs:
            runs[opt] = {"run": next(seen), "n": 0, "prof": None, "t0": 0.0}
        state = runs[opt]
        state["n"] += 1
        if state["n"] == first - 1 and not open_:  # the profiled steps start after this one
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            state["prof"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                               torch.profiler.ProfilerActivity.CUDA])
            state["prof"].__enter__()
            state["t0"] = time.perf_counter()
            open_.append(state)
        elif state["n"] == end - 1 and state["prof"] is not None:
            close(state, write=True)

    handle = register_optimizer_step_post_hook(hook)
    try:
        if rest[:1] == ["-m"]:
            sys.argv = [rest[1], *rest[2:]]
            runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = rest
            runpy.run_path(rest[0], run_name="__main__")
    finally:
        handle.remove()
        if open_:  # a run that ended inside its profiled steps: nothing to report
            close(open_[0], write=False)


if __name__ == "__main__":
    main()
