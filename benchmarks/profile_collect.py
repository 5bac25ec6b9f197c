"""Sum up the operator tables of ``benchmarks/step_profile.py`` into one JSON (wall and GPU-busy ms per entry).

    python benchmarks/profile_collect.py OUT.json TABLE.txt ... [--meta META.json] [--set key=value ...]

Per table: its entry and whether it was compiled, the steps, the profiled wall ms (its first line) and the
kernels' GPU time (the table's "Self CUDA time total": each kernel once). ``--meta``: the tool, command, date,
device and versions are copied from that JSON (an earlier summary of the same session; OUT itself may be it);
``--set``: a top-level field (``device=...``, ``versions.torch=...``).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HEAD = re.compile(r"^(?P<entry>\S+?)(?P<compiled> compiled \(layers\))?: (?P<steps>\d+) steps, wall (?P<wall>[\d.]+) ms")
TOTAL = re.compile(r"^Self CUDA time total: (?P<value>[\d.]+)(?P<unit>ms|us|s)$")
UNIT_MS = {"s": 1e3, "ms": 1.0, "us": 1e-3}
META = ("tool", "command", "date", "device", "versions", "note")


def summary(path: Path) -> dict:
    lines = path.read_text().splitlines()
    head = next((HEAD.match(line) for line in lines if HEAD.match(line)), None)
    total = next((TOTAL.match(line.strip()) for line in lines if TOTAL.match(line.strip())), None)
    if head is None or total is None:
        raise SystemExit(f"{path}: not a step_profile.py table (no header line or no 'Self CUDA time total')")
    return {"file": path.name, "entry": head["entry"], "compiled": head["compiled"] is not None,
            "steps": int(head["steps"]), "wall_ms_profiled": float(head["wall"]),
            "device_busy_ms": round(float(total["value"]) * UNIT_MS[total["unit"]], 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("tables", nargs="+")
    p.add_argument("--meta", help="a JSON whose tool, command, date, device, versions and note are kept")
    p.add_argument("--set", action="append", default=[], help="key=value (versions.NAME=value for a version)")
    opts = p.parse_args()
    out: dict = {}
    if opts.meta:
        old = json.loads(Path(opts.meta).read_text())
        out.update({k: old[k] for k in META if k in old})
    for kv in opts.set:
        key, _, value = kv.partition("=")
        if key.startswith("versions."):
            out.setdefault("versions", {})[key.split(".", 1)[1]] = value
        else:
            out[key] = value
    out["device_busy_ms"] = ("the kernels' GPU time, each kernel once (the table's 'Self CUDA time total'; the "
                             "'device busy' of a table's first line before 2026-11-27 counted each kernel twice)")
    out["entries"] = [summary(Path(t)) for t in opts.tables]
    out["collected_by"] = " ".join(["python", "benchmarks/profile_collect.py", *sys.argv[1:]])
    Path(opts.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
