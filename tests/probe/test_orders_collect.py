"""benchmarks/orders_collect.py: the runs of gpu_suite.py compiled-longest, one entry each, merged into one bench result."""
import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "orders_collect", Path(__file__).resolve().parents[2] / "benchmarks" / "orders_collect.py")
oc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oc)


def _run(method: str, ms: list[float], compile_s: float, recompiles: int = 0) -> dict:
    rows = [{"layout": "longest", "method": method, "head": "labelled", "timing": t, "ms": sum(ms) / len(ms),
             "forward_ms": 1.0, "backward_ms": 2.0, "peak_gib": 3.0, "per_batch_ms": ms,
             **({"compile_s": compile_s, "recompiles": recompiles} if t == "compiled" else {})}
            for t in ("eager", "compiled")]
    model = {"case": {"name": "c"}, "rows": rows, "complete": True, "limits": [], "summary": {},
             "sebp_layers": {"labelled": {"linears": 7}} if method == "sebp" else {}}
    return {"command": f"bench --methods {method}:labelled", "environment": {"gpu": "G"}, "models": [model]}


def _folder(tmp_path: Path, runs: list[tuple[str, dict]]) -> Path:
    lines = []
    for n, (entry, data) in enumerate(runs, 1):
        (tmp_path / f"c_longest_{n}.json").write_text(json.dumps(data))
        lines.append(f"{entry}: env  python3 -m sebp_probe bench c --methods x -o c_longest_{n}.json")
    (tmp_path / "commands.txt").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_runs_of_one_entry_merge_batch_by_batch(tmp_path):
    folder = _folder(tmp_path, [("dense:labelled", _run("dense", [10.0, 20.0], 9.0)),
                                ("sebp:labelled", _run("sebp", [8.0, 12.0], 7.0, 1)),
                                ("sebp:labelled", _run("sebp", [6.0, 14.0], 2.0)),
                                ("dense:labelled", _run("dense", [12.0, 18.0], 1.0)),
                                ("sebp:labelled@SEBP_FORWARD_ROWS=0", _run("sebp", [50.0, 50.0], 1.0))])
    out = oc.merge(oc.runs_of(folder))
    (model,) = out["models"]
    rows = {(r["method"], r["timing"]): r for r in model["rows"]}
    sebp, dense = rows[("sebp", "compiled")], rows[("dense", "compiled")]
    assert sebp["per_batch_ms"] == [7.0, 13.0] and sebp["runs_ms"] == [10.0, 10.0] and sebp["ms"] == 10.0
    assert sebp["compile_s"] == 7.0 and sebp["compile_s_runs"] == [7.0, 2.0] and sebp["recompiles"] == 1
    assert dense["per_batch_ms"] == [11.0, 19.0] and dense["ms"] == 15.0
    assert sebp["vs_dense_same_layout"] == pytest.approx(1.5)  # summarize() recomputed over the merged rows
    assert model["summary"]["compiled"]["fastest"]["method"] == "sebp"
    assert model["order"][-1] == "sebp:labelled@SEBP_FORWARD_ROWS=0" and len(model["merged_runs"]) == 4
    assert model["sebp_layers"] == {"labelled": {"linears": 7}} and "limits" not in model
    assert isinstance(out["command"], str) and out["environment"] == {"gpu": "G"}
    # --runs: exactly the entries named, a switched one among them
    picked = oc.merge(oc.runs_of(folder), ("dense:labelled", "sebp:labelled@SEBP_FORWARD_ROWS=0"))
    rows = {(r["method"], r["timing"]): r for r in picked["models"][0]["rows"]}
    assert rows[("sebp", "compiled")]["ms"] == 50.0
    with pytest.raises(SystemExit, match="no run to merge"):
        oc.merge(oc.runs_of(folder), ("cce:labelled",))
