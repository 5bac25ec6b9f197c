"""Merge the runs of ``benchmarks/gpu_suite.py compiled-longest`` (one whole-model bench entry per process, in
the order given, A B B A) into one bench result that the docs read as any other.

Each entry (layout, method, head, timing) gets the mean over its runs: of the step time (``ms``), of the forward
and backward, and batch by batch (``per_batch_ms``); its largest peak memory and recompile count; the compile
seconds of its first run (later runs of a warm machine find Inductor's cache: ``compile_s_runs`` lists them
all) and each run's step time (``runs_ms``). The model's ``order`` lists the runs as given, with their switches;
``summary`` is recomputed over the merged rows (:func:`sebp_probe.bench.bench_cases.summarize`). ``--runs``
keeps the runs whose run list entry it names exactly (``sebp:labelled@SEBP_FORWARD_ROWS=0``); by default those
without an environment switch.

Usage: python benchmarks/orders_collect.py DIR -o OUT.json [--tag TAG] [--runs ENTRY ...]
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sebp_probe.bench.bench_cases import summarize  # noqa: E402
from sebp_probe.bench.bench_model import AUTO_METHODS_GPU  # noqa: E402

KEY = ("layout", "method", "head", "timing")


def runs_of(folder: Path, tag: str = "") -> list[tuple[str, dict]]:
    """(the run list entry, its result) of each run in ``folder`` (of the session's ``TAG``), in run order (its
    commands.txt's lines)."""
    out = []
    for line in (folder / f"{tag}commands.txt").read_text().splitlines():
        entry, _, cmd = line.partition(": env")
        name = re.search(r"-o (\S+\.json)", cmd).group(1)
        path = folder / name
        if path.exists():
            out.append((entry, json.loads(path.read_text())))
    return out


def merge_rows(rows: list[dict]) -> dict:
    """One entry's rows (one per run) as one row (see the module docstring)."""
    mean = lambda k: round(statistics.fmean(r[k] for r in rows), 3)  # noqa: E731
    row = dict(rows[0])
    row.update(ms=mean("ms"), forward_ms=mean("forward_ms"), backward_ms=mean("backward_ms"),
               per_batch_ms=[round(statistics.fmean(v), 3) for v in zip(*(r["per_batch_ms"] for r in rows))],
               runs_ms=[r["ms"] for r in rows])
    peaks = [r["peak_gib"] for r in rows if r.get("peak_gib") is not None]
    row["peak_gib"] = max(peaks) if peaks else None
    if "recompiles" in row:
        row["recompiles"] = max(r["recompiles"] for r in rows)
    if "compile_s" in row:
        row["compile_s_runs"] = [r["compile_s"] for r in rows]
    for k in ("vs_dense_same_layout", "vs_fastest_baseline"):
        row.pop(k, None)
    return row


def merge(runs: list[tuple[str, dict]], keep: tuple[str, ...] = ()) -> dict:
    """The merged bench result of ``runs`` (see the module docstring)."""
    kept = [(e, d) for e, d in runs if (e in keep if keep else "@" not in e)]
    if not kept:
        raise SystemExit("no run to merge")
    first = kept[0][1]
    by_key: dict[tuple, list[dict]] = {}
    for _, d in kept:
        for r in d["models"][0]["rows"]:
            by_key.setdefault(tuple(r[k] for k in KEY), []).append(r)
    rows = [merge_rows(rs) for rs in by_key.values()]
    summary = summarize(rows, AUTO_METHODS_GPU)  # also each row's speedups
    model = dict(first["models"][0])
    sebp = next((d["models"][0]["sebp_layers"] for _, d in kept if d["models"][0].get("sebp_layers")), None)
    model.update(rows=rows, summary=summary, methods_run=sorted({r["method"] for r in rows}), sebp_layers=sebp,
                 skipped=[], order=[e for e, _ in runs], merged_runs=[e for e, _ in kept],
                 complete=all(d["models"][0]["complete"] for _, d in kept))
    model.pop("limits", None)  # per run: not merged
    return {**{k: v for k, v in first.items() if k != "models"},
            "command": " ; then ".join(d["command"] for _, d in kept), "models": [model]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("-o", "--output", type=Path, required=True)
    ap.add_argument("--runs", nargs="*", default=())
    ap.add_argument("--tag", default="")
    a = ap.parse_args(argv)
    out = merge(runs_of(a.folder, a.tag), tuple(a.runs))
    a.output.write_text(json.dumps(out, indent=1) + "\n")
    for r in out["models"][0]["rows"]:
        print(f"{r['layout']} {r['method']} {r['head']} {r['timing']}: {r['ms']} ms (runs {r['runs_ms']})")


if __name__ == "__main__":
    main()
