"""``bench --scope model --probe``: what a ``finetune --probe-every`` step costs over an unprobed one.

For each eager and compiled entry of the dense and SEBP methods the bench ran (the models ``finetune`` probes),
on the same model, batches and settings, a probed step takes turns with an unprobed one on each batch of the
layout: ``warmup`` rounds untimed, then ``repeats`` rounds, each arm first in every other round. A probed step is
what ``finetune --probe-every`` runs on a probed step (:class:`~sebp_probe.train.probe_steps.StepProbe`): the
collector's hooks on the model for that step (one collector per run, as finetune makes it), the step's own forward
and backward, the counts reduced on the device and sent to the host in one copy nothing waits for. The record made
from them after the step (:meth:`~sebp_probe.train.probe_steps.StepProbe.take_timed`, host work out of finetune's
step time, paid once per probed step all the same) is timed apart: ``record_ms``. Every step is timed by the wall
clock from a synchronized device to a synchronized device (a finetune step waits for its loss anyway), the
optimizer left out as in the rest of the bench (it costs both arms the same, so the ratios here are the largest
a training step can see).

A compiled entry's probed step runs compiled, the statistics inside its graphs
(:mod:`~sebp_probe.analysis.graph_tap`): the entry's first step compiles the unprobed graphs, a probed step
after it the probed ones (``probe_graphs``: how many), both untimed; ``recompiles``: graphs Dynamo compiled
after those two steps, probed steps among them (the compiled row of the bench counts its own, without probes,
to compare). ``probed_step_runs``: ``eager`` or ``compiled``, as the entry. ``spread``: the median absolute deviation
of the unprobed steps over their median (mean over batches), the noise a ratio is read against (None under 3
repeats).
``unprobed_host_ms``/``probed_host_ms``: the same steps' host time, from the start until the step returned with
its last kernel queued (medians, mean over batches): where the probed host time nears its wall time, the step
waits on the host (hooks, launches), not on the device.
``layers``/``rows``: what the last probed step's record holds, a check that the hooks ran.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable

import torch

from ..data.train_data import to_device
from ..train.compiling import dynamo_counts
from ..train.probe_steps import StepProbe
from .bench_compile import compiled_step

METHODS = ("dense", "sebp")  # what finetune --probe-every probes here; the peers' entries are skipped
TIMINGS = ("eager", "compiled")


def probe_plan(keys) -> tuple[list[tuple], list[dict]]:
    """Of the bench's entry keys (layout, method, head, timing) that ran: those probed, and the others with why
    not."""
    run, skipped = [], []
    for key in keys:
        why = (f"{key[3]} timing: finetune probes eager or compiled steps" if key[3] not in TIMINGS else
               f"finetune --probe-every is measured on dense and SEBP models, not {key[1]}"
               if key[1] not in METHODS else None)
        if why:
            skipped.append(dict(zip(("layout", "method", "head", "timing"), key), reason=why))
        else:
            run.append(key)
    return run, skipped


def _wall_ms(fn: Callable[[], None], cuda: bool) -> tuple[float, float]:
    """(wall ms from a synchronized device to a synchronized device, host ms: until ``fn`` returned, its last
    launch queued)."""
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, (t1 - t0) * 1e3


def interleaved(probe: StepProbe, loss_fn: Callable[[], torch.Tensor], batch: dict, repeats: int, warmup: int,
                cuda: bool) -> dict:
    """One batch: the medians of the probed and unprobed steps taking turns, with the last probed step's record
    size (see the module docstring)."""
    from sebp_kernels import label_checks

    model, record = probe.model, None

    def plain() -> None:
        loss_fn().backward()

    def probed() -> None:
        with probe.step(1) as around, around(batch):
            loss_fn().backward()

    arms = {"unprobed": plain, "probed": probed}
    times: dict[str, list[float]] = {a: [] for a in arms}
    host: dict[str, list[float]] = {a: [] for a in arms}
    record_ms: list[float] = []
    with label_checks.deferred() as checks:
        for i in range(warmup + repeats):
            names = list(arms)
            for name in names[i % len(names):] + names[:i % len(names)]:  # each arm first in turn
                model.zero_grad(set_to_none=True)
                ms, host_ms = _wall_ms(arms[name], cuda)
                checks.check()
                if name == "probed":  # the record, after the step as in finetune: timed apart
                    record = probe.take_timed(1)
                    if i >= warmup:
                        record_ms.append(record["record_ms"])
                if i >= warmup:
                    times[name].append(ms)
                    host[name].append(host_ms)
    model.zero_grad(set_to_none=True)
    med = {a: statistics.median(t) for a, t in times.items()}
    spread = (statistics.median(abs(t - med["unprobed"]) for t in times["unprobed"]) / med["unprobed"]
              if repeats >= 3 else None)  # fewer repeats say nothing of the noise
    return {**{f"{a}_ms": m for a, m in med.items()},
            **{f"{a}_host_ms": statistics.median(t) for a, t in host.items()}, "spread": spread,
            "record_ms": statistics.median(record_ms),
            "layers": len(record["layers"]),
            "rows": sum(e["rows"] for e in record["layers"].values())}


def probe_overhead(model_for: Callable, step_for: Callable, batches: dict[str, list[dict]], keys,
                   task: str | None, device: torch.device, repeats: int, warmup: int, pad_mask: bool = True,
                   compile: str | None = None,
                   compile_backend: str = "inductor", compile_scope: str = "layers",
                   progress: Callable[[str], None] | None = None) -> dict:
    """The ``probe`` part of a whole-model result: a row per probed entry of ``keys`` (see the module
    docstring) and the entries skipped. ``model_for(method, head)``: a context giving the entry's model (as the
    bench runs it); ``step_for(method, head)``: its step function ``(model, batch) -> loss``; ``batches``: each
    layout's batches (CPU); ``pad_mask`` False: padded layouts without their mask, as the bench runs them."""
    cuda = device.type == "cuda"
    run, skipped = probe_plan(keys)
    rows = []
    for n, (layout, method, head, timing) in enumerate(run, 1):
        if progress:
            progress(f"probe: {layout}, {method}, {head} head, {timing} ({n}/{len(run)})")
        on_device = [to_device({k: v for k, v in b.items() if pad_mask or layout == "packed" or k != "attention_mask"},
                               device) for b in batches[layout]]
        compiled = timing == "compiled"
        with model_for(method, head) as m, contextlib.ExitStack() as undo:
            probe = StepProbe(1, m, task, compiled, None)  # one per run, as finetune makes it
            undo.callback(probe.close)
            step, graphs = step_for(method, head), None
            if compiled:
                step, restore = compiled_step(m, step, on_device, compile, compile_backend, compile_scope)
                if restore is not None:
                    undo.callback(restore)
                graphs = _compiles(probe, lambda: step(m, on_device[0]), on_device[0])
            per = [interleaved(probe, lambda b=b: step(m, b), b, repeats, warmup, cuda) for b in on_device]
            if compiled:
                graphs = (graphs[0], dynamo_counts()[0] - graphs[1])
        if compiled:
            torch._dynamo.reset()
        rows.append(_row((layout, method, head, timing), per, graphs))
    return {"rows": rows, "skipped": skipped, "repeats": repeats, "warmup": warmup}


def _compiles(probe: StepProbe, loss_fn: Callable[[], torch.Tensor], batch: dict) -> tuple[int, int]:
    """A compiled entry's first two steps, untimed: unprobed (its graphs), then probed (the probed graphs);
    returns (graphs the probed step compiled, graphs compiled so far)."""
    probe.model.zero_grad(set_to_none=True)
    loss_fn().backward()
    before = dynamo_counts()[0]
    probe.model.zero_grad(set_to_none=True)
    with probe.step(1) as around, around(batch):
        loss_fn().backward()
    probe.take(1)
    probe.model.zero_grad(set_to_none=True)
    after = dynamo_counts()[0]
    return after - before, after


def _row(key: tuple, per: list[dict], graphs: tuple[int, int] | None) -> dict:
    mean = lambda k: statistics.fmean(p[k] for p in per)  # noqa: E731
    unprobed, probed = mean("unprobed_ms"), mean("probed_ms")
    row = dict(zip(("layout", "method", "head", "timing"), key), unprobed_ms=round(unprobed, 3),
               probed_ms=round(probed, 3), unprobed_host_ms=round(mean("unprobed_host_ms"), 3),
               probed_host_ms=round(mean("probed_host_ms"), 3), ratio=round(probed / unprobed, 4),
               record_ms=round(mean("record_ms"), 3),
               probed_step_runs=key[3],
               spread=None if per[0]["spread"] is None else round(mean("spread"), 4),
               per_batch_ratio=[round(p["probed_ms"] / p["unprobed_ms"], 4) for p in per],
               layers=per[-1]["layers"], rows=per[-1]["rows"])
    if graphs is not None:
        row.update(probe_graphs=graphs[0], recompiles=graphs[1])
    return row


def probe_lines(model_result: dict) -> list[str]:
    """The probe's rows as plain lines for the terminal."""
    probe = model_result.get("probe")
    if not probe:
        return []
    name = model_result["case"]["name"]
    lines = [f"{name}, --probe: a probed step (finetune --probe-every) against an unprobed one, interleaved "
             "(wall ms; a compiled entry's probed step runs compiled, its probed graphs compiled once, untimed)"]
    for r in probe["rows"]:
        graphs = f", {r['recompiles']} recompiles" if r.get("recompiles") is not None else ""
        noise = "noise unknown: under 3 repeats" if r["spread"] is None else f"noise +-{100 * r['spread']:.1f}%"
        host = (f"; host until the last launch {r['unprobed_host_ms']:.2f} -> {r['probed_host_ms']:.2f} ms"
                if "probed_host_ms" in r else "")  # rows of earlier results have no host split
        host += f"; the record after it {r['record_ms']:.2f} ms" if "record_ms" in r else ""
        lines.append(f"  {r['layout']} {r['method']} {r['head']} {r['timing']}: {r['unprobed_ms']:.2f} -> "
                     f"{r['probed_ms']:.2f} ms, {r['ratio']:.3f}x{graphs} ({noise}){host}")
    lines += [f"  not probed: {s['layout']} {s['method']} {s['head']} {s['timing']} ({s['reason']})"
              for s in probe["skipped"]]
    return lines
