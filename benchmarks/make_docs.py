#!/usr/bin/env python3
"""Fill the generated blocks of README.md and docs/*.md from the JSON files under results/.

Every measured number in the documentation comes from a committed JSON file through this script; nothing
measured is typed into the prose. A page holds generated markdown between two markers:

    <!-- BEGIN generated:NAME -->
    ...what the generator registered as NAME returns...
    <!-- END generated:NAME -->

    python benchmarks/make_docs.py            # rewrite every block in place
    python benchmarks/make_docs.py --check    # exit 1 with one line naming the stale blocks

A generator is a small function decorated with ``@block("NAME")``. It takes a :class:`Page` (which loads
JSON from results/ and links to it from the page being written) and returns markdown. Every table starts
with a caption line (:func:`caption`) naming the GPU, the software versions, the date and the command that
the JSON file records. To document a new table: put its JSON in a folder of its own under results/, write a
generator here, and put the markers in the page. Standard library only.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!-- (BEGIN|END) generated:([A-Za-z0-9_.-]+) -->")

GENERATORS: dict[str, Callable[["Page"], str]] = {}


class DocsError(Exception):
    """A page or a result file that the blocks cannot be made from (one line)."""


def block(name: str):
    """Register the decorated function as the generator of the blocks called ``name``."""
    def register(fn):
        if name in GENERATORS:
            raise ValueError(f"two generators for the block {name!r}")
        GENERATORS[name] = fn
        return fn
    return register


# ------------------------------------------------------------------------------------------ result files

class Source:
    """One JSON file under results/: ``rel`` its path there, ``data`` its content."""

    def __init__(self, rel: str, data: dict):
        self.rel = rel
        self.data = data

    def env(self) -> dict:
        """GPU, versions and date, whether the file keeps them under ``environment`` or at its top level."""
        env = self.data.get("environment")
        return env if isinstance(env, dict) else self.data

    def rows(self, key: str = "rows") -> list:
        return self.data[key]


class Page:
    """What a generator sees: the results of the repository at ``root`` and the page it writes into."""

    def __init__(self, root: Path, doc: Path):
        self.root = root
        self.doc = doc
        self._cache: dict[str, Source] = {}

    def load(self, rel: str) -> Source:
        """The JSON file ``results/<rel>``."""
        if rel not in self._cache:
            path = self.root / "results" / rel
            try:
                data = json.loads(path.read_text())
            except FileNotFoundError:
                raise DocsError(f"results/{rel} does not exist") from None
            except json.JSONDecodeError as err:
                raise DocsError(f"results/{rel} is not valid JSON: {err}") from None
            self._cache[rel] = Source(rel, data)
        return self._cache[rel]

    def link(self, rel: str) -> str:
        """A markdown link from this page to ``results/<rel>``."""
        target = os.path.relpath(self.root / "results" / rel, self.doc.parent)
        return f"[`results/{rel}`]({Path(target).as_posix()})"


# ------------------------------------------------------------------------------------- shared formatting

def command(text: str) -> str:
    """The recorded command as a reader runs it: output paths of the device machine become ``OUT/<name>``,
    and a bare script path gets its ``python``."""
    words = [("OUT/" + w.rsplit("/", 1)[-1]) if w.startswith("/") else w for w in text.split()]
    if words and words[0].endswith(".py"):
        words.insert(0, "python")
    return " ".join(words)


def _setting(src: Source) -> str:
    env = src.env()
    parts = [env.get("gpu") or "unknown GPU"]
    versions = [f"{name} {env[key]}" for key, name in (("torch", "torch"), ("triton", "triton"), ("cuda", "CUDA"))
                if env.get(key)]
    date = str(env.get("date", ""))[:10]
    return f"{parts[0]} ({', '.join(versions)}), {date}" if versions else f"{parts[0]}, {date}"


def caption(page: Page, *sources: Source) -> str:
    """The caption line(s) of a table: for each GPU / versions / date, the commands and the files they wrote."""
    groups: dict[str, list[Source]] = {}
    for src in sources:
        groups.setdefault(_setting(src), []).append(src)
    lines = []
    for setting, group in groups.items():
        runs = "; ".join(f"`{command(s.data.get('command', '?'))}` → {page.link(s.rel)}" for s in group)
        lines.append(f"*Measured on {setting}: {runs}.*")
    return "\n\n".join(lines)


def table(header: list[str], rows: list[list[str]], align: str) -> str:
    """A markdown table; ``align`` has one letter per column, ``l`` or ``r``."""
    if len(align) != len(header) or any(len(r) != len(header) for r in rows):
        raise ValueError("a table row, the header and the alignment differ in length")
    rule = ["---" if a == "l" else "---:" for a in align]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [header, rule, *rows])


def captioned(page: Page, sources: list[Source], body: str) -> str:
    return f"{caption(page, *sources)}\n\n{body}"


def f2(x: float) -> str:
    return f"{x:.2f}"


def f1(x: float) -> str:
    return f"{x:.1f}"


def f3(x: float) -> str:
    return f"{x:.3f}"


def times(x: float) -> str:
    return f"{x:.2f}x"


def slash(values) -> str:
    return " / ".join(values)


def span(values, fmt=f2) -> str:
    """``lo-hi`` of ``values`` (one number when they agree after formatting)."""
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def dens(d: float) -> str:
    return f"{d:g}"


def size(n_bytes: int) -> str:
    return f"{n_bytes / 1024:.1f} KiB" if n_bytes >= 1024 else f"{n_bytes} B"


def short_gpu(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``H100``: the model number, where the name has one."""
    found = re.search(r"\b([A-Z]+\d{2,4}[A-Za-z]?)\b", name)
    return found.group(1) if found else name


# ----------------------------------------------------------------------------------- per-layer benchmark

LAYER_FILES = ("layers_bert-base.json", "layers_llama-3.2-3b.json")
TARGET_DENSITIES = (0.1, 0.2, 0.5)  # the densities whose shares the summaries count
GOAL = 0.9  # the share of the ideal's speedup that the summaries count points against


def layer_runs(page: Page, folder: str) -> tuple[list[Source], dict[str, dict[float, dict]]]:
    """The per-layer bench files of ``folder`` and their entries: layer name -> density -> entry."""
    sources = [page.load(f"{folder}/{f}") for f in LAYER_FILES]
    by_layer: dict[str, dict[float, dict]] = {}
    for src in sources:
        for entry in src.rows("layers"):
            by_layer.setdefault(entry["shape"]["name"], {})[entry["density"]] = entry
    return sources, by_layer


def share(entry: dict, method: str, floor: str = "ideal") -> float:
    """The share of ``floor``'s speedup over dense that ``method`` reaches: floor time / method time."""
    return entry["ms"][floor] / entry["ms"][method]


def _shape_cells(entries: dict[float, dict]) -> list[str]:
    any_entry = next(iter(entries.values()))
    return [any_entry["shape"]["name"], str(any_entry["shape"]["rows"])]


def _shares(entries: dict[float, dict], method: str, floor: str = "ideal") -> str:
    return slash(f2(share(entries[d], method, floor)) for d in TARGET_DENSITIES)


def _layers_speedup(page: Page, folder: str) -> str:
    sources, layers = layer_runs(page, folder)
    rows = []
    for entries in layers.values():
        sp = {d: e["speedup_vs_dense"] for d, e in entries.items()}
        rows.append(_shape_cells(entries) + [
            f"{entries[0.2]['ms']['dense']:.3f}",
            *(f"{times(sp[d]['ideal'])} / {times(sp[d]['triton'])}" for d in (0.05, 0.1, 0.2, 0.5)),
            f"{times(sp[1.0]['triton'])} / {times(sp[1.0]['triton_adaptive'])}",
            times(entries[0.2]["triton_vs_torch_ref"]),
        ])
    header = ["layer", "M", "dense ms (d = 0.2)", "d = 0.05: ideal / SEBP", "d = 0.1", "d = 0.2", "d = 0.5",
              "d = 1: kernels / `SEBPLinear`", "SEBP / torch SEBP, d = 0.2"]
    return captioned(page, sources, table(header, rows, "lrrrrrrrr"))


def _layers_share(page: Page, folder: str) -> str:
    sources, layers = layer_runs(page, folder)
    rows = []
    for entries in layers.values():
        rows.append(_shape_cells(entries) + [
            _shares(entries, "triton"),
            _shares(entries, "triton", "ideal_io"),
            slash(f2(entries[d]["ms"]["ideal"] / entries[d]["ms"]["ideal_io"]) for d in TARGET_DENSITIES),
            slash(f"{entries[d]['io_bytes'] / 2**20:.0f}" for d in TARGET_DENSITIES),
        ])
    header = ["layer", "M", "SEBP / ideal", "SEBP / ideal +io", "ideal / ideal +io", "MiB ideal +io adds"]
    note = "Each cell: d = " + " / ".join(dens(d) for d in TARGET_DENSITIES) + "."
    return captioned(page, sources, table(header, rows, "lrrrrr") + "\n\n" + note)


def _layers_kept(page: Page, folder: str) -> str:
    sources, layers = layer_runs(page, folder)
    methods = ("triton", "triton_reuse", "triton_rows", "triton_rows_reuse")
    rows = [_shape_cells(entries) + [_shares(entries, m) for m in methods] for entries in layers.values()]
    header = ["layer", "M", "selection", "selection, dX kept", "rows known", "rows known, dX kept"]
    note = "Share of the ideal's speedup; each cell: d = " + " / ".join(dens(d) for d in TARGET_DENSITIES) + "."
    return captioned(page, sources, table(header, rows, "lrrrrr") + "\n\n" + note)


def _points(layers: dict[str, dict[float, dict]], method: str, floor: str = "ideal") -> list[float]:
    return [share(e[d], method, floor) for e in layers.values() for d in TARGET_DENSITIES]


@block("layers_speedup_h100")
def layers_speedup_h100(page: Page) -> str:
    return _layers_speedup(page, "layers_h100")


@block("layers_share_h100")
def layers_share_h100(page: Page) -> str:
    return _layers_share(page, "layers_h100")


@block("layers_share_h200")
def layers_share_h200(page: Page) -> str:
    return _layers_share(page, "layers_h200")


@block("layers_kept_h100")
def layers_kept_h100(page: Page) -> str:
    return _layers_kept(page, "layers_h100")


@block("layers_summary")
def layers_summary(page: Page) -> str:
    (s100, h100), (s200, h200) = layer_runs(page, "layers_h100"), layer_runs(page, "layers_h200")

    def pair(fn) -> str:
        return f"{fn(h100)} on the H100, {fn(h200)} on the H200"

    def rng(method, floor="ideal"):  # three decimals: a share of 0.897 is below 0.9
        return lambda layers: span(_points(layers, method, floor), f3)

    def reach(method):
        return lambda layers: str(sum(p >= GOAL for p in _points(layers, method)))

    def allow_below(layers) -> str:
        return str(sum(e[d]["ms"]["ideal"] / e[d]["ms"]["ideal_io"] < GOAL
                       for e in layers.values() for d in TARGET_DENSITIES))

    def fill(layers) -> str:
        return span([e[d]["fill_tb_s"] for e in layers.values() for d in e]) + " TB/s"

    n = len(h100) * len(TARGET_DENSITIES)
    lines = [
        f"- Share of the ideal's speedup at d = {dens(TARGET_DENSITIES[0])}-{dens(TARGET_DENSITIES[-1])} "
        f"({n} points a GPU): {pair(rng('triton'))}.",
        f"- Share of `ideal +io`'s speedup at the same points: {pair(rng('triton', 'ideal_io'))}.",
        f"- Points where `ideal +io` itself is below {GOAL} of the ideal: {pair(allow_below)}.",
        f"- Points at {GOAL} of the ideal or more with the selection pass: {pair(reach('triton'))}; with the rows "
        f"known: {pair(reach('triton_rows'))}; with the rows known and dX kept: {pair(reach('triton_rows_reuse'))}.",
        f"- Fill bandwidth that prices `ideal +io`: {pair(fill)}.",
    ]
    return captioned(page, s100 + s200, "\n".join(lines))


# ------------------------------------------------------------------------------------- selection pass

@block("select_h100")
def select_h100(page: Page) -> str:
    src = page.load("select_h100/select_probe.json")
    by_shape: dict[tuple, dict[float, dict]] = {}
    for r in src.rows("results"):
        by_shape.setdefault((r["m"], r["n"]), {})[r["density"]] = r["us"]
    densities = sorted({d for points in by_shape.values() for d in points})
    rows = []
    for (m, n), points in by_shape.items():
        rows.append([f"{m} x {n}", slash(f1(points[d]["select"]) for d in densities),
                     span([points[d]["compact"] for d in densities], f1),
                     f1(points[densities[0]]["read"]),
                     f1(min(v for k, v in points[densities[0]].items() if k.startswith("one_")))])
    header = ["dY (M x out)", "selection at d = " + " / ".join(dens(d) for d in densities) + ", us",
              "compaction alone, us", "`amax` over dY, us", f"one launch, d = {dens(densities[0])}, us"]
    return captioned(page, [src], table(header, rows, "lrrrr"))


# ----------------------------------------------------------------------------------------- dW alone

@block("dw_alone_h100")
def dw_alone_h100(page: Page) -> str:
    src = page.load("dw_alone_h100/dw_tma_probe.json")
    by_shape: dict[str, dict[float, dict]] = {}
    for r in src.rows():
        by_shape.setdefault(r["shape"], {})[r["density"]] = r
    rows = []
    for name, points in by_shape.items():
        ds = sorted(points)
        rows.append([name, slash(f1(points[d]["us"]["cublas"]) for d in ds),
                     *(slash(f2(points[d]["vs_cublas"][k]) for d in ds) for k in ("sebp", "ptr", "tma"))])
    ds = sorted(next(iter(by_shape.values())))
    note = "Each cell: d = " + " / ".join(dens(d) for d in ds) + "; the last three columns are times over cuBLAS's."
    header = ["layer", "cuBLAS, us", "SEBP dW (rows known)", "textbook Triton dW, pointer loads",
              "textbook Triton dW, TMA loads"]
    return captioned(page, [src], table(header, rows, "lrrrr") + "\n\n" + note)


# ------------------------------------------------------------------------------------------ read-hide

READ_HIDE = ("read_hide_h100/read_hide_probe.json", "read_hide_h200/read_hide_probe.json")


def _by_shape(rows: list[dict]) -> dict[str, dict[float, dict]]:
    out: dict[str, dict[float, dict]] = {}
    for r in rows:
        out.setdefault(r["shape"], {})[r["density"]] = r
    return out


@block("read_hide")
def read_hide(page: Page) -> str:
    h100, h200 = (page.load(rel) for rel in READ_HIDE)
    a, b = _by_shape(h100.rows()), _by_shape(h200.rows())
    rows = []
    for name, points in a.items():
        ds = sorted(points)
        rows.append([name, slash(f2(points[d]["share_best"]) for d in ds),
                     slash(f2(points[d]["share_sebp"]) for d in ds),
                     slash(f2(b[name][d]["share_best"]) for d in ds),
                     slash(f2(b[name][d]["share_sebp"]) for d in ds),
                     slash(f2(points[d]["hidden"]) for d in ds)])
    ds = sorted(next(iter(a.values())))
    note = ("Shares of the ideal's speedup; each cell: d = " + " / ".join(dens(d) for d in ds)
            + ". *Hidden*: the part of the read's own time that the best arrangement saved.")
    header = ["layer", "H100: cuBLAS + read, best", "H100: SEBP backward", "H200: cuBLAS + read, best",
              "H200: SEBP backward", "H100: read hidden"]
    return captioned(page, [h100, h200], table(header, rows, "lrrrrr") + "\n\n" + note)


@block("read_hide_summary")
def read_hide_summary(page: Page) -> str:
    srcs = [page.load(rel) for rel in READ_HIDE]
    lines = []
    for gpu, src in zip(("H100", "H200"), srcs):
        rows = src.rows()
        below = [r for r in rows if r["share_best"] < GOAL]
        where = f" ({span([r['share_best'] for r in below], f3)} there)" if below else ""
        lines.append(f"- {gpu}: the best arrangement stays below {GOAL} of the ideal at {len(below)} of "
                     f"{len(rows)} points{where}; the read alone ran at {span([r['read_tb_s'] for r in rows], f1)} "
                     f"TB/s; the SEBP backward reached {span([r['share_sebp'] for r in rows], f3)} of the ideal.")
    worst = min(srcs[0].rows(), key=lambda r: r["share_best"])
    ideal, read = worst["us"]["ideal"], worst["us"]["read"]
    lines.append(
        f"- The hardest point on the H100, {worst['shape']} at d = {dens(worst['density'])}: the ideal takes "
        f"{f1(ideal)} us, so {GOAL} of its speedup leaves {f1(ideal / GOAL - ideal)} us for reading "
        f"{f1(worst['read_mb'])} MB of inactive rows, which alone took {f1(read)} us; the best arrangement "
        f"hid {worst['hidden'] * 100:.0f}% of it.")
    return captioned(page, srcs, "\n".join(lines))


# ------------------------------------------------------------------------------- norms and activations

@block("norms_h100")
def norms_h100(page: Page) -> str:
    src = page.load("norms_h100/norm_bench.json")
    by_norm: dict[str, list[dict]] = {}
    for r in src.rows():
        by_norm.setdefault(r["layer"], []).append(r)
    rows = []
    for name, points in by_norm.items():
        points.sort(key=lambda r: r["density"])
        rows.append([name, f"{points[0]['rows']} x {points[0]['features']}",
                     span([p["backward_us"]["dense"] for p in points], f1),
                     slash(f1(p["backward_us"]["sebp"]) for p in points),
                     span([p["backward_speedup"] for p in points], f2) + "x"])
    ds = " / ".join(dens(p["density"]) for p in next(iter(by_norm.values())))
    header = ["norm", "M x N", "dense backward, us", f"SEBP backward at d = {ds}, us", "dense / SEBP"]
    return captioned(page, [src], table(header, rows, "lrrrr"))


@block("acts")
def acts(page: Page) -> str:
    srcs = [page.load("acts_h100/act_bench.json"), page.load("acts_h200/act_bench.json")]
    rows = []
    for src in srcs:
        gpu = short_gpu(src.env()["gpu"])
        for r in src.rows():
            us = r["us"]
            rows.append([gpu, f"{r['case']}, {r['m']} x {r['n']}", dens(r["density"]),
                         f"{f1(us['fwd_hf'])} / {f1(us['fwd_sebp'])}",
                         f"{f1(us['bwd_hf_kernels'])} / {f1(us['bwd_sebp_kernels'])}",
                         f"{f1(us['bwd_hf'])} / {f1(us['bwd_sebp'])}",
                         f"{f1(us['linear_bwd_select'])} / {f1(us['linear_bwd_rows'])}"])
    header = ["GPU", "activation, M x N", "d", "forward: HF / SEBP", "backward kernels: HF / SEBP",
              "backward, eager autograd: HF / SEBP", "linear before it: selecting / rows handed on"]
    return captioned(page, srcs, table(header, rows, "llrrrrr") + "\n\nMicroseconds.")


# --------------------------------------------------------------------------------------- shared memory

@block("smem_h100")
def smem_h100(page: Page) -> str:
    src = page.load("smem_h100/smem_probe.json")
    per_dtype = src.data["bytes"]
    dtypes = list(per_dtype)
    kernels = list(per_dtype[dtypes[0]])
    rows = [[k, *(size(per_dtype[dt][k]) for dt in dtypes)] for k in kernels]
    header = ["kernel", *(dt.removeprefix("torch.") for dt in dtypes)]
    return captioned(page, [src], table(header, rows, "l" + "r" * len(dtypes)))


# ------------------------------------------------------------------------------------------ whole model

MODEL_FILES = ("model_h100/model_bert-base_norms_acts_graphs.json",
               "model_h100/model_llama-3.2-3b_norms_acts_graphs.json")


@block("model_trim_h100")
def model_trim_h100(page: Page) -> str:
    srcs = [page.load(rel) for rel in MODEL_FILES]
    rows = []
    for src in srcs:
        for m in src.rows("models"):
            g = m["graphed_median"]
            case = m["case"]
            rows.append([case["name"], f"{case['batch']} x {case['seq']}", f"{m['token_density']:.3f}",
                         f1(g["dense_padded"]["step_ms"]), f1(g["sebp_padded"]["step_ms"]),
                         f1(g["dense_trimmed"]["step_ms"]), times(m["graphed_step_speedup"]),
                         times(m["graphed_trimmed_step_speedup"])])
    header = ["model (config, random weights)", "batch", "token density", "dense, padded: step ms",
              "SEBP, padded", "dense, padding trimmed", "SEBP x dense", "trimmed x dense"]
    return captioned(page, srcs, table(header, rows, "llrrrrrr"))


# ---------------------------------------------------------------------------------------- the pages

def pages(root: Path) -> list[Path]:
    """The pages whose blocks are generated: README.md and docs/*.md."""
    found = [root / "README.md"] if (root / "README.md").exists() else []
    return found + sorted((root / "docs").glob("*.md"))


def render(text: str, page: Page, label: str) -> tuple[str, list[str]]:
    """``text`` with every block regenerated, and the names of the blocks whose body changed."""
    out, changed, pos = [], [], 0
    marks = list(MARKER.finditer(text))
    if len(marks) % 2:
        raise DocsError(f"{label}: a generated block has no matching END marker")
    for begin, end in zip(marks[::2], marks[1::2]):
        name = begin.group(2)
        if begin.group(1) != "BEGIN" or end.group(1) != "END" or end.group(2) != name:
            raise DocsError(f"{label}: markers out of order near 'generated:{name}' "
                            f"(line {text.count(chr(10), 0, begin.start()) + 1})")
        generator = GENERATORS.get(name)
        if generator is None:
            raise DocsError(f"{label}: unknown generated block {name!r} (line "
                            f"{text.count(chr(10), 0, begin.start()) + 1}); known: {', '.join(sorted(GENERATORS))}")
        try:
            body = "\n" + generator(page).strip("\n") + "\n"
        except DocsError as err:
            raise DocsError(f"{label}: block {name!r}: {err}") from None
        if text[begin.end():end.start()] != body:
            changed.append(name)
        out += [text[pos:begin.end()], body]
        pos = end.start()
    out.append(text[pos:])
    return "".join(out), changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is stale")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this script's)")
    args = parser.parse_args(argv)
    stale = []
    try:
        for path in pages(args.root):
            label = path.relative_to(args.root).as_posix()
            text = path.read_text()
            new, changed = render(text, Page(args.root, path), label)
            stale += [f"{label}:{name}" for name in changed]
            if changed and not args.check:
                path.write_text(new)
    except DocsError as err:
        print(f"make_docs: {err}", file=sys.stderr)
        return 1
    if args.check and stale:
        print(f"make_docs: stale generated block(s) {', '.join(stale)}: run python benchmarks/make_docs.py",
              file=sys.stderr)
        return 1
    if not args.check and stale:
        print(f"make_docs: rewrote {', '.join(stale)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
