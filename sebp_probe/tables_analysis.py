"""The tables of ``sebp-probe analyze`` (rich): sparsity per layer type, recommended settings, rows by cause,
gradient reuse, padding layouts."""
from __future__ import annotations

from .tables import WIDE_CONSOLE, console


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _eps_text(lo: float, hi: float) -> str:
    return f"{lo:.2g}" if lo == hi else f"{lo:.2g}..{hi:.2g}"


def print_analysis(report: dict, per_layer: bool) -> None:
    from rich import box
    from rich.table import Table

    from .analysis.analyze import layer_type_rows

    m, d, p = report["model"], report["dataset"], report["padding"]
    console.print(f"[bold]{m['name']}[/bold] ({m['architecture']}, {m['task']}) on [bold]{d['name']}[/bold] "
                  f"split {d.get('split')}: {report['analysis']['batches']} batches of {p['batch_size']}, padding "
                  f"{p['padding']} (max {p['max_length']}, {p['padding_side']})", highlight=False)
    tok = report.get("tokens")
    if tok:
        t = Table(title="Tokens per sample", box=box.SIMPLE_HEAD)
        for col in ("avg", "max", "min", "padded to", "padding %", "padding % if\npadded per batch",
                    "tokens saved by\nper-batch padding %"):
            t.add_column(col, justify="right")
        ps = tok["per_sample"]
        t.add_row(f"{ps['avg']:.1f}", f"{ps['max']:.0f}", f"{ps['min']:.0f}", f"{tok['padded_length']['max']:.0f}",
                  _pct(tok["pad_fraction"]), _pct(tok["dynamic_pad_fraction"]), _pct(tok["dynamic_saving"]))
        console.print(t)
    rows = layer_type_rows(report)
    t = Table(title="Sparsity of dL/dY per layer type, % (avg/max/min over batches)", box=box.SIMPLE_HEAD)
    for col in ("layer type", "layers", "zero elements", "zero rows"):
        t.add_column(col, justify="left" if col == "layer type" else "right", no_wrap=True)
    for r in rows:
        ze, zr = r["zero_elements"], r["zero_rows"]
        t.add_row(r["type"], str(r["layers"]), f"{_pct(ze['avg'])} / {_pct(ze['max'])} / {_pct(ze['min'])}",
                  f"{_pct(zr['avg'])} / {_pct(zr['max'])} / {_pct(zr['min'])}")
    console.print(t)
    _print_causes(rows, report["totals"])
    t = Table(title="Recommended SEBP settings per layer type", box=box.SIMPLE_HEAD)
    for col in ("layer type", "knee", "eps", "rows\n> eps %", "N", "FLOPs saved %\nthr. / topk"):
        t.add_column(col, justify="left" if col == "layer type" else "right", no_wrap=True)
    for r in rows:
        t.add_row(r["type"], f"{r['knees']}/{r['layers']}", _eps_text(*r["eps"]), _pct(r["active_rows"]),
                  str(r["top_n"]), f"{_pct(r['saving_threshold'])} / {_pct(r['saving_topk'])}")
    console.print(t)
    if per_layer:
        # The reasons are long: beside the numbers on a wide console, else listed under the table in full
        # (a narrow table would cut them, and piped output is 80 columns wide).
        wide = console.width >= WIDE_CONSOLE
        t = Table(title="Per layer", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
        for col in ("layer", "mode", "eps", "N", "zero\nrows %", "label-\nless %", "rows\n> eps %",
                    *(("why",) if wide else ())):
            t.add_column(col, justify="left" if col in ("layer", "mode", "why") else "right",
                         no_wrap=col not in ("layer", "why"), overflow="fold")
        for name, e in report["layers"].items():
            s = e["stats"]
            t.add_row(name, e["mode"], f"{e['eps']:.3g}", str(e["top_n"]), _pct(s["zero_row_fraction"]["avg"]),
                      _pct(s["rows_by_cause"]["label_less"]), _pct(s["active_row_fraction"]["avg"]),
                      *((s["reason"],) if wide else ()))
        console.print(t)
        if not wide:
            console.print("why, per layer:", highlight=False)
            for name, e in report["layers"].items():
                console.print(f"  {name}: {e['stats']['reason']}", highlight=False, soft_wrap=True)
    g, tot = report["global"], report["totals"]
    console.print(f"global setting: eps {g['eps']:.3g}, N {g['top_n']} ({g['reason']})", highlight=False)
    console.print(f"backward GEMM FLOPs (dX, dW) saved, all layers: threshold {_pct(tot['saving_threshold'])}%, "
                  f"topk {_pct(tot['saving_topk'])}% with the per-layer settings; {_pct(g['saving_threshold'])}% "
                  f"/ {_pct(g['saving_topk'])}% with the global one", highlight=False)
    if report.get("layouts"):
        _print_layouts(report["layouts"])
    if report.get("reuse"):
        _print_reuse(report["reuse"])


_CAUSES = {"padding": "padding", "label_less": "label-less", "other_zero": "other zero", "near_zero": "near zero",
           "active": "active"}
_CAUSE_COLUMNS = ("padding", "label-\nless", "other\nzero", "near zero\n(<= eps)", "active")


def _print_causes(rows: list[dict], totals: dict) -> None:
    from rich import box
    from rich.table import Table

    t = Table(title="Rows of dL/dY by cause per layer type, % (avg over batches)", box=box.SIMPLE_HEAD)
    for col in ("layer type", *_CAUSE_COLUMNS):
        t.add_column(col, justify="left" if col == "layer type" else "right", no_wrap=True)
    for r in rows:
        t.add_row(r["type"], *(_pct(r["rows_by_cause"][c]) for c in _CAUSES))
    console.print(t)
    share = totals["share_by_cause"]
    console.print("backward GEMM FLOPs by cause, all layers: " + ", ".join(
        f"{text} {_pct(share[c])}%" for c, text in _CAUSES.items()), highlight=False)


_REUSE_SHOWN = ("0.5", "0.9", "0.99")


def _print_reuse(reuse: dict) -> None:
    """What gradient reuse would drop, per layer type (``analyze --reuse``)."""
    from rich import box
    from rich.table import Table

    from .analysis.analyze import reuse_type_rows

    rows = reuse_type_rows(reuse)
    shown = [lv for lv in _REUSE_SHOWN if rows and lv in rows[0]["dropped"]]
    t = Table(title="Gradient reuse (--method resprop): error left in dL/dY, % of |dL/dY|",
              box=box.SIMPLE_HEAD)
    for col in ("layer type", "|dY - P|\n/ |dY|", *(f"reuse {lv}:\nReSprop / top-k" for lv in shown)):
        t.add_column(col, justify="left" if col == "layer type" else "right", no_wrap=True)
    for r in rows:
        t.add_row(r["type"], f"{r['residual']:.2f}",
                  *(f"{_pct(r['dropped'][lv])} / {_pct(r['topk_dropped'][lv])}" for lv in shown))
    console.print(t)
    console.print("P: the previous batch's dL/dY. ReSprop drops the smallest rows of dY - P; top-k drops as many "
                  "of dY's own smallest rows instead. Reuse pays only where its error is below top-k's "
                  "(|dY - P| well below |dY|).", highlight=False)


def _print_layouts(advice: dict) -> None:
    from rich import box
    from rich.table import Table

    t = Table(title=f"Padding layouts ({advice['samples']} samples, batches of {advice['batch_size']}, max "
                    f"{advice['max_length']})", box=box.SIMPLE_HEAD)
    for col in ("layout", "padding %", "dense backward\n% of max_length", "SEBP still\nskips %"):
        t.add_column(col, justify="left" if col == "layout" else "right", no_wrap=True)
    for name, a in advice["layouts"].items():
        if a["applies"]:
            t.add_row(name, _pct(a["padding_share"]), _pct(a["dense_backward_vs_max_length"]), _pct(a["sebp_skips"]))
        else:
            t.add_row(name, "n/a", "n/a", "n/a")
    console.print(t)
    console.print(f"recommended layout: {advice['recommendation']}", highlight=False)
