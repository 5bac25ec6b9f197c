"""Blocks of docs/kernels.md: the per-layer benchmark, dW alone, the read-hide probe, norms, activations and
shared memory (H100, H200)."""
from __future__ import annotations

from docgen import (Page, Source, block, captioned, dens, f1, f2, f3, short_gpu, size, slash, span, table,
                    times)

# ----------------------------------------------------------------------------------- per-layer benchmark

LAYER_FILES = ("bert-base", "llama-3.2-3b")
TARGET_DENSITIES = (0.1, 0.2, 0.5)  # the densities whose shares the summaries count
GOAL = 0.9  # the share of the ideal's speedup that the summaries count points against


def layer_runs(page: Page, folder: str, files: tuple[str, ...] = LAYER_FILES
               ) -> tuple[list[Source], dict[str, dict[float, dict]]]:
    """The per-layer bench runs of ``folder`` (the GPU: ``h100``, ``h200``) and their entries: layer name -> density -> entry."""
    sources = [page.load(f"layers.json#{folder}_{f}") for f in files]
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


def _layers_speedup(page: Page, folder: str, files: tuple[str, ...] = LAYER_FILES) -> str:
    sources, layers = layer_runs(page, folder, files)
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
    return _layers_speedup(page, "h100")


@block("layers_share_h100")
def layers_share_h100(page: Page) -> str:
    return _layers_share(page, "h100")


@block("layers_share_h200")
def layers_share_h200(page: Page) -> str:
    return _layers_share(page, "h200")


@block("layers_kept_h100")
def layers_kept_h100(page: Page) -> str:
    return _layers_kept(page, "h100")


@block("layers_summary")
def layers_summary(page: Page) -> str:
    (s100, h100), (s200, h200) = layer_runs(page, "h100"), layer_runs(page, "h200")

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


# ----------------------------------------------------------------------------------------- dW alone

@block("dw_alone_h100")
def dw_alone_h100(page: Page) -> str:
    src = page.load("kernels.json#dw_alone")
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

READ_HIDE = ("kernels.json#read_hide_h100", "kernels.json#read_hide_h200")


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
    src = page.load("kernels.json#norms")
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
    srcs = [page.load("kernels.json#acts_h100"), page.load("kernels.json#acts_h200")]
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
    src = page.load("kernels.json#smem")
    per_dtype = src.data["bytes"]
    dtypes = list(per_dtype)
    kernels = list(per_dtype[dtypes[0]])
    rows = [[k, *(size(per_dtype[dt][k]) for dt in dtypes)] for k in kernels]
    header = ["kernel", *(dt.removeprefix("torch.") for dt in dtypes)]
    return captioned(page, [src], table(header, rows, "l" + "r" * len(dtypes)))


# ------------------------------------------------------------------------------------- selection pass

@block("select_h100")
def select_h100(page: Page) -> str:
    src = page.load("kernels.json#select")
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


@block("layers_qwen_h200")
def layers_qwen_h200(page: Page) -> str:
    """Qwen2.5-0.5B's projections alone on an H200 (results/layers_h200/layers_qwen2.5-0.5b.json), as the
    per-layer tables of kernels.md: why SEBP on its linears loses on `longest` batches."""
    return _layers_speedup(page, "h200", ("qwen2.5-0.5b",))
