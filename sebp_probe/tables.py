"""Tables and progress bars for people (rich): what the CLI prints. Programs read the JSON instead."""
from __future__ import annotations

from rich.console import Console

from .config import TIMINGS

console = Console()
# Tables with long cells (reasons, 13 benchmark columns) change layout below this width: piped output is 80.
WIDE_CONSOLE = 150


def print_note(console_: Console, text: str) -> None:
    """A note (:mod:`sebp_probe.notes`) as every command prints it, whatever said it: ``note: TEXT``."""
    console_.print(f"note: {text}", highlight=False, soft_wrap=True)


def finetune_progress(console_):
    """A rich progress bar fed by finetune's events: one bar per run, live loss and backward speedup."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    progress = Progress(TextColumn("[bold]{task.description:>5}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[speed]}"),
                        TimeElapsedColumn(), TimeRemainingColumn(), console=console_, transient=False)
    tasks: dict[str, int] = {}
    plain = not console_.is_terminal  # no live display: plain lines say what is happening

    def say(text: str) -> None:
        progress.console.print(text, highlight=False, soft_wrap=True)
        progress.console.file.flush()  # a redirected log shows it now, not at the end

    def on_event(kind: str, p: dict) -> None:
        run = p.get("run", "")
        if kind == "calibrating":
            if plain:
                say(p["text"])
        elif kind == "calibrated":
            n, dense = len(p["layers"]), len(p["fallback_dense"])
            times = ""
            if p.get("dense_step_ms") and p.get("sebp_step_ms"):
                times = (f"; calibration on its batches, interleaved, forward + backward: dense "
                         f"{p['dense_step_ms']:.1f} ms, SEBP {p['sebp_step_ms']:.1f} ms (backward "
                         f"{p['dense_backward_ms']:.1f} and {p['sebp_backward_ms']:.1f} ms)")
            why = p.get("fallback_reason") or "active rows above the fallback density"
            progress.console.print(f"{run}: SEBP on {n} layers, {dense} left dense ({why}){times}", highlight=False)
        elif kind == "start":
            tasks[run] = progress.add_task(run, total=p["total"], completed=p["step"], loss="-", speed="")
            if plain:
                say(f"{run}: training from step {p['step']} to {p['total']}")
        elif kind == "step" and run in tasks:
            speed = (f"bwd x{p['vs_dense_backward']:.2f} vs dense, same steps" if "vs_dense_backward" in p
                     else f"bwd {p['backward_ms']:.1f} ms")
            progress.update(tasks[run], completed=p["step"], loss=f"{p['loss']:.4f}", speed=speed)
            total = progress.tasks[tasks[run]].total or 0
            if plain and (p["step"] == total or p["step"] % max(1, int(total) // 10) == 0):
                say(f"{run} step {p['step']}/{int(total)}: loss {p['loss']:.4f}, {speed}")
        elif kind == "eval":
            vals = ", ".join(f"{k[5:]} {v:.4f}" for k, v in p.items() if k.startswith("eval_"))
            progress.console.print(f"{run} step {p['step']}: held-out {vals}", highlight=False)
        elif kind == "note":
            print_note(progress.console, p["text"])
        elif kind == "skipped":
            progress.console.print(f"{run}: already completed, kept", highlight=False)
        elif kind == "padding":
            progress.console.print(padding_table(p), highlight=False)
        elif kind == "analysis":
            if "analysis" not in tasks:
                tasks["analysis"] = progress.add_task("eps", total=p["total"], loss="-", speed="analysis")
            progress.update(tasks["analysis"], completed=p["done"])

    return progress, on_event


def padding_table(choice: dict):
    """The layouts ``--padding auto`` timed (forward+backward ms per batch, dense and SEBP; compiled too under
    ``--compile``, with their compile seconds and each row's least whole-run estimate) and its choice."""
    from rich import box
    from rich.table import Table

    rows = choice["table"]
    heads = any("head" in r for r in rows)  # the labelled-rows head timed against the full one
    compiled = any(k.endswith("_compiled_ms") or k == "compiled_skipped" for r in rows for k in r)
    eager = any(k in r for r in rows for k in ("dense_ms", "sebp_ms"))
    title = "--padding auto: ms per batch (fwd+bwd" + (", CUDA-graph replays)" if choice.get("replays") else ")")
    if compiled:
        title += f"; run s: the run's {choice.get('micro_batches')} micro-batches x ms + compile s"
    captions = []
    if choice.get("processes", 1) > 1:  # what the run's wrapped, sharded steps take can rank otherwise
        captions.append(f"timed in one of the run's {choice['processes']} processes, on the model before it is "
                        "wrapped")
    if choice.get("untimed"):
        captions.append(f"{choice['untimed']}: the prior's pick (least padding), untimed")
    if choice.get("budget_s") is not None:
        spent = f"{choice['spent_s']:.1f} s of " if choice.get("spent_s") is not None else ""
        captions.append(f"timing: {spent}a {choice['budget_s']:.1f} s budget (of the run's estimated "
                        f"{choice['run_estimate_s']:.1f} s); ms: median over interleaved rounds (the passes' "
                        "spread: 1.48 x their median absolute deviation)")
    table = Table(title=title, caption="\n".join(captions) or None, caption_justify="left", box=box.SIMPLE_HEAD)
    slots = any("slots" in r for r in rows)
    cols = ["layout", *(("head",) if heads else ()), "padding %", *(("tokens\n/batch",) if slots else ()),
            *(("dense", "SEBP") if eager else ()),
            *(("dense\ncompiled", "SEBP\ncompiled", "compile s\ndense/SEBP", "run s\n(least)") if compiled else ()),
            "note"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("layout", "head", "note") else "right")
    fmt = lambda r, k, f="{:.1f}": f.format(r[k]) if k in r else "-"  # noqa: E731

    def timed(r: dict, k: str) -> str:  # the median and, where rounds were timed, -/+ its spread
        spread = r.get(k.replace("_ms", "_spread"))
        return fmt(r, k) + (f" ({spread[0]:.1f}-{spread[1]:.1f})" if spread and k in r else "")

    for r in rows:
        chosen = r["padding"] == choice["padding"] and r.get("head") == choice.get("head") and "skipped" not in r
        what = ("SEBP" if choice["method"] == "sebp" else "dense") + (" compiled" if choice.get("compiled") else "")
        notes = [f"chosen: {what}"] if chosen else []
        if r.get("sebp_layers") == 0:
            notes.append("no layer sparse enough for SEBP")
        if r.get("compiled_skipped"):
            notes.append(f"not compiled: {r['compiled_skipped']}")
        if r.get("not_timed") and not choice.get("untimed"):
            notes.append("not timed (budget): " + ", ".join("SEBP" if m == "sebp" else m for m in r["not_timed"]))
        note = r.get("skipped") or "; ".join(notes)
        cells = [timed(r, "dense_ms"), timed(r, "sebp_ms")] if eager else []
        if compiled:
            runs = [v for k, v in r.items() if k.endswith("_run_s")]
            cells += [fmt(r, "dense_compiled_ms"), fmt(r, "sebp_compiled_ms"),
                      f"{fmt(r, 'dense_compiled_compile_s')}/{fmt(r, 'sebp_compiled_compile_s')}",
                      f"{min(runs):.1f}" if runs else "-"]
        table.add_row(r["padding"], *((r.get("head", "-"),) if heads else ()), f"{100 * r['padding_share']:.1f}",
                      *((fmt(r, "slots", "{:.0f}"),) if slots else ()), *cells, note)
    return table


def print_finetune_summary(summary: dict) -> None:
    from rich import box
    from rich.table import Table

    runs = summary.get("runs") or {summary.get("method", "run"): summary}
    table = Table(title=f"fine-tuning: {summary['output_dir']}", box=box.SIMPLE_HEAD)
    for col in ("run", "layout", "steps", "loss\n(last 10)", "held-out", "bwd ms", "step ms", "peak\nMiB"):
        table.add_column(col, justify="left" if col in ("run", "layout", "held-out") else "right",
                         no_wrap=col not in ("run", "held-out"), overflow="fold")
    fmt = lambda v, f="{:.1f}": "-" if v is None else f.format(v)  # noqa: E731
    short = {"eval_accuracy": "acc", "eval_perplexity": "ppl", "eval_loss": "loss"}
    for name, s in runs.items():
        ev = s.get("final_eval", {})
        held = " ".join(f"{short.get(k, k)} {v:.4f}" for k, v in ev.items() if k != "eval_loss")
        label = name if s["status"] == "completed" else f"{name} ({s['status']})"
        table.add_row(label, s.get("padding", "-"), str(s.get("steps", 0)), fmt(s.get("final_train_loss"), "{:.4f}"),
                      held, fmt(s.get("median_backward_ms")), fmt(s.get("median_step_ms")),
                      fmt(s.get("peak_mem_mb"), "{:.0f}"))
    console.print(table)
    for name, s in runs.items():  # an SEBP run that patched nothing trained as dense: said here, not only above
        if s.get("kept_dense"):
            console.print(f"{name}: {s['kept_dense']}: it trained exactly as dense", highlight=False)
        if s.get("sampled"):
            console.print(f"{name}: {sampled_line(s['sampled'])}", highlight=False)
        if (s.get("grad_stats") or {}).get("cost"):
            console.print(f"{name}: {probe_cost_line(s['grad_stats'])}", highlight=False)
    cmp = summary.get("comparison")
    if cmp:
        console.print(f"{_other_label(runs)} vs dense: {comparison_line(cmp, runs)}", highlight=False)
    console.print(timing_note(runs), highlight=False)


def probe_cost_line(grad_stats: dict) -> str:
    """One line on what a run's probed steps (--probe-every) cost against its other steps."""
    c = grad_stats["cost"]
    head = "within noise of" if c["within_noise"] else f"x{c['ratio']:.2f}"

    def kind(what: str) -> str:
        low, high = c[f"{what}_iqr"]
        return f"{what} {c[f'{what}_ms']:.1f} ms (IQR {low:.1f}-{high:.1f}, {c[f'{what}_steps']} steps)"

    record = (f"; the record after each probed step {grad_stats['record_ms']:.1f} ms more (host, in neither)"
              if "record_ms" in grad_stats else "")
    return (f"probed steps (--probe-every {grad_stats['every']}) {head} the others' step time: medians "
            f"{kind('probed')}, {kind('other')}{record}; not the same batches (`sebp-probe bench --probe` times "
            "both on the same ones)")


def sampled_line(smp: dict) -> str:
    """One line on a sampled run: approximate, and the measured share of the linears' backward rows skipped."""
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    dx = "dX sampled too" if smp.get("sample_dx") else "dX exact over the non-zero rows"
    b = smp["budget"]
    g = smp.get("guard")
    guard = "" if not g else (f"; guard: {g['checks']} checks, cosine to the exact dW min {g['min_cosine']:.3f}, "
                              f"median relative error {g['median_rel_error']:.3f}, {len(g['raised'])} layers "
                              "given more rows")
    return (f"approximate (sampled mode, experimental; budget {b if b == 'auto' else format(b, 'g')}): the "
            f"{smp['layers']} sampled linears skipped {pct(smp['skipped_of_nonzero'])} of their non-zero rows of "
            f"dL/dY in dW and db ({pct(smp['skipped_of_rows'])} of all rows) after the warm-up, measured; {dx}"
            f"{guard}")


def _other_label(runs: dict) -> str:
    other = next((m for m in runs if m != "dense"), "sebp")
    return {"sebp": "SEBP", "resprop": "ReSprop"}.get(other, other)


def _ms_iqr(part: dict, who: str) -> str:
    lo, hi = part[f"{who}_iqr"]
    return f"{part[f'{who}_ms']:.1f} ms (IQR {lo:.1f}-{hi:.1f})"


def comparison_line(cmp: dict, runs: dict) -> str:
    """The ``--compare`` headline: what the two runs' times may be read as (see
    :func:`sebp_probe.train.metrics.compare_runs`), never a speedup where none was measured."""
    t = cmp.get("timing", {})
    verdict = cmp.get("verdict")
    n = t.get("timed_steps", 0)
    over = f"over {n} steps timed in both" if t.get("paired") else f"over each run's {n}+ timed steps"
    if t.get("first_shapes_timed"):
        over += ", a batch shape's first step included: with lengths this varied nearly every batch is one"
    parts = []
    if verdict == "same computation":
        noise = f" (measured step ratio x{t['step']['ratio']:.2f}: the timing's noise)" if "step" in t else ""
        parts.append(f"both runs computed the same thing: {cmp['same_computation']}; no speedup{noise}")
    elif verdict == "too few steps":
        parts.append(f"only {n} steps timed in both runs (warm-up, compiles and first shapes left out): too few to "
                     "compare times; train more --max-steps")
    else:
        st, bw = t["step"], t["backward"]
        head = "within noise" if verdict == "within noise" else f"step x{st['ratio']:.2f}"
        per_step = (f"; the steps' own ratios IQR {st['ratio_iqr'][0]:.2f}-{st['ratio_iqr'][1]:.2f}"
                    if "ratio_iqr" in st and verdict != "within noise" else "")
        parts.append(f"{head} (step medians {over}: dense {_ms_iqr(st, 'dense')}, {_other_label(runs)} "
                     f"{_ms_iqr(st, 'other')}{per_step})")
        if verdict != "within noise":
            parts.append(f"backward x{bw['ratio']:.2f}")
    if "peak_mem_ratio" in cmp:
        parts.append(f"peak memory x{cmp['peak_mem_ratio']:.3f}")
    if "peak_mem_ratio_from_step3" in cmp:
        parts.append(f"x{cmp['peak_mem_ratio_from_step3']:.3f} from step 3 on")
    if cmp.get("max_abs_loss_gap") is not None:
        parts.append(f"max |loss gap| {cmp['max_abs_loss_gap']:.2e}")
    return ", ".join(parts)


def timing_note(runs: dict) -> str:
    """How the times above were taken: which steps were left out, and what they took (compiles apart)."""
    bits = []
    for name, s in runs.items():
        compiled = (f", of it compiling {s['compile_s']:.1f} s in {s['compile_steps']} steps"
                    if s.get("compile_steps") else "")
        bits.append(f"{name} {s.get('untimed_steps', 0)} steps, {s.get('untimed_s', 0.0):.1f} s{compiled}")
    return ("bwd/step ms: medians of the timed steps; left out as warm-up (the first steps, compiles, graph "
            "captures, a GPU's first batch of each shape): " + "; ".join(bits))


def bench_tables(result: dict) -> None:
    from rich import box
    from rich.table import Table

    if result.get("layers") and result.get("mode") == "sampled":
        _sampled_layers(result)
    elif result.get("layers"):
        what = f"{result['dtype']}, {result['mode']}"
        times = ("k", "dense", "ideal", "ideal +io", "triton", "torch ref")
        speedups = ("x ideal", "x triton", "x adaptive", "x torch ref", "peak MiB d/t")
        shares = ("of ideal", "of ideal, rows known", "of ideal +io", "of ideal, dX kept",
                  "of ideal, rows known, dX kept")
        # one table where the console is wide enough, else the times, the speedups and the shares apart (rich
        # would cut every column of a 15-column table to a few characters at 80 columns, the width of piped
        # output)
        narrow = console.width < WIDE_CONSOLE
        parts = [(f"SEBP backward per layer ({what}; median ms, speedup vs dense cuBLAS)", times + speedups + shares)]
        if narrow:
            parts = [(f"SEBP backward per layer ({what}; median ms)", times),
                     (f"SEBP backward per layer ({what}): speedups vs dense cuBLAS, x the torch reference, peak "
                      "extra MiB dense/triton", speedups),
                     (f"SEBP backward per layer ({what}): share of the ideal's speedup (of the ideal plus the "
                      "unavoidable memory traffic: ideal +io)", shares)]
        for title, cols in parts:
            table = Table(title=title, box=box.SIMPLE_HEAD if narrow else box.HEAVY_HEAD, pad_edge=False,
                          collapse_padding=True)
            for col in ("layer", "density", *cols):
                table.add_column(col.replace(" ", "\n") if narrow and col != "layer" else col,
                                 justify="left" if col == "layer" else "right", no_wrap=narrow and col != "layer",
                                 overflow="fold")
            for r in result["layers"]:
                ms, sp = r["ms"], r["speedup_vs_dense"]
                cells = {"k": str(r["k"]), "dense": f"{ms['dense']:.3f}", "ideal": f"{ms['ideal']:.3f}",
                         "ideal +io": f"{ms['ideal_io']:.3f}" if "ideal_io" in ms else "-",
                         "triton": f"{ms['triton']:.3f}", "torch ref": f"{ms['torch_ref']:.3f}",
                         "x ideal": f"{sp['ideal']:.2f}", "x triton": f"{sp['triton']:.2f}",
                         "x adaptive": f"{sp['triton_adaptive']:.2f}" if "triton_adaptive" in sp else "-",
                         "of ideal": f"{r['triton_fraction_of_ideal_speedup']:.2f}",
                         "of ideal, rows known": (f"{r['triton_rows_fraction_of_ideal_speedup']:.2f}"
                                                  if "triton_rows_fraction_of_ideal_speedup" in r else "-"),
                         "of ideal +io": (f"{r['triton_fraction_of_ideal_io_speedup']:.2f}"
                                         if "triton_fraction_of_ideal_io_speedup" in r else "-"),
                         "of ideal, dX kept": (f"{r['triton_reuse_fraction_of_ideal_speedup']:.2f}"
                                               if "triton_reuse_fraction_of_ideal_speedup" in r else "-"),
                         "of ideal, rows known, dX kept": (
                             f"{r['triton_rows_reuse_fraction_of_ideal_speedup']:.2f}"
                             if "triton_rows_reuse_fraction_of_ideal_speedup" in r else "-"),
                         "x torch ref": f"{r['triton_vs_torch_ref']:.2f}",
                         "peak MiB d/t": f"{r['peak_extra_mib']['dense']:.0f}/{r['peak_extra_mib']['triton']:.0f}"}
                table.add_row(r["shape"]["name"], f"{r['density']:g}", *(cells[c] for c in cols))
            console.print(table)
    for m in result.get("models", []):
        _model_tables(m)


def _sampled_layers(result: dict) -> None:
    """``bench --scope layers --mode sampled``: each layer's backward, dense and sampled (dX exact, dX sampled),
    as CUDA-graph replays and eagerly, with the speedups."""
    from rich.table import Table

    table = Table(title=f"Sampled backward per layer ({result['dtype']}; median ms; x: speedup vs dense; "
                        "graph: CUDA-graph replay, eager: launched from the host)")
    cols = ("dense", "sampled", "sampled_dx", "dense_eager", "sampled_eager", "sampled_dx_eager")
    for col in ("layer", "density", *(c.replace("_", " ") for c in cols), "x graph", "x dX graph", "x eager",
                "x dX eager"):
        table.add_column(col, justify="left" if col == "layer" else "right")
    for r in result["layers"]:
        ms = r["ms"]
        table.add_row(r["shape"]["name"], f"{r['density']:g}", *(f"{ms[c]:.3f}" for c in cols),
                      *(f"{ms[d] / ms[c]:.2f}" for d, c in (("dense", "sampled"), ("dense", "sampled_dx"),
                                                             ("dense_eager", "sampled_eager"),
                                                             ("dense_eager", "sampled_dx_eager"))))
    console.print(table)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}" if v < 100 else f"{v:.1f}"


def _entry(r: dict) -> str:
    return f"{r['layout']} {r['method']} {r['head']}"


def _model_tables(m: dict) -> None:
    """One whole-model result: step times per entry, the limits, the summary and what was not run (fits 80
    columns: piped output)."""
    from rich import box
    from rich.table import Table

    c = m["case"]
    extra = "".join((", no padding mask" if not m.get("pad_mask", True) else "",
                     ", SEBP norms" if m.get("norms") else "", ", SEBP activations" if m.get("acts") else "",
                     ", dX zero rows kept" if m.get("keep_dx") else "",
                     ", rows selected (no padding rows from the mask)" if m.get("pad_rows") is False else ""))
    pool = m["pool"]
    compiled = any(r["timing"] == "compiled" for r in m["rows"])
    replayed = any(r["timing"] == "compiled_graphs" for r in m["rows"])
    extra += "; compiled: torch.compile, comp s: its first step's seconds" if compiled else ""
    extra += "; +graphs: compiled layers, the step replayed as CUDA graphs" if replayed else ""
    table = Table(title=f"{c['name']}: step ms (forward+backward; median per batch, mean over {pool['batches']} "
                        f"batches of {c['batch']} from one pool; max length {c['max_length']}; packed: "
                        f"{m['packed_backend']}{extra}); x: speedup vs dense on the layout"
                        + ("" if replayed else " / vs the fastest non-SEBP entry"), box=box.SIMPLE_HEAD,
                  pad_edge=False, collapse_padding=True)
    # with compiled rows: their ms and compile seconds in place of the padding share, and with compiled + graphs
    # rows their ms in place of the speedup over the fastest non-SEBP entry (the lines below name it): 80 columns
    cols = ("layout", "method", "head", "eager", "graphs") + (("com-\npiled", "comp\ns") if compiled else ()) + (
        ("+graphs",) if replayed else ()) + ("peak\nGiB",) + (() if compiled else ("pad\n%",)) + (
        "x\nlayout",) + (() if replayed else ("x\nbest",))
    for col in cols:
        table.add_column(col, justify="left" if col in ("layout", "method", "head") else "right", no_wrap=True)
    timed: dict[tuple, dict] = {}
    for r in m["rows"]:
        timed.setdefault((r["layout"], r["method"], r["head"]), {})[r["timing"]] = r
    fmt = lambda v, f="{:.2f}": "-" if v is None else f.format(v)  # noqa: E731
    for (layout, method, head), t in timed.items():
        e, g, comp = t.get("eager"), t.get("graphs"), t.get("compiled")
        first = e or g or comp
        comp = (_ms(comp and comp["ms"]), fmt(comp and comp["compile_s"], "{:.0f}")) if compiled else ()
        comp += (_ms(t["compiled_graphs"]["ms"] if "compiled_graphs" in t else None),) if replayed else ()
        pad = () if compiled else (fmt(100 * first["padding_share"], "{:.0f}"),)
        table.add_row(layout, method, head, _ms(e and e["ms"]), _ms(g and g["ms"]), *comp,
                      fmt(first["peak_gib"] if e else None), *pad,
                      fmt(first.get("vs_dense_same_layout")),
                      *(() if replayed else (fmt(first.get("vs_fastest_baseline")),)))
    console.print(table)
    gaps = [r for r in m["rows"] if r.get("loss_gap") is not None]
    if gaps:
        worst = max(gaps, key=lambda r: r["loss_gap"])
        case = m["case"]
        dropout = (case.get("config") or {}).get("hidden_dropout_prob", 0.1 if case.get("arch") == "bert" else 0.0)
        noise = (f"; hidden dropout {dropout:g} draws other masks in every entry, so the gaps are its noise"
                 if dropout else "")
        console.print(f"loss check: every entry's loss within {worst['loss_gap']:.2g} (relative, largest: "
                      f"{_entry(worst)}) of dense's with the full head on the same batches{noise}",
                      highlight=False, soft_wrap=True)
    for timing in TIMINGS:
        limits = [li for li in m["limits"] if li["timing"] == timing]
        if not limits:
            continue
        table = Table(title=f"{c['name']}, {timing}: the limit of each layout (its step without the backward GEMMs "
                            "of the inactive rows, whose share of the backward's FLOPs is 'inactive') and SEBP's "
                            "share of the limit's speedup", box=box.SIMPLE_HEAD, pad_edge=False,
                      collapse_padding=True)
        for col in ("layout", "head", "dense", "SEBP", "limit", "x\nSEBP", "x\nlimit", "of\nlimit", "inactive\n%"):
            table.add_column(col, justify="left" if col in ("layout", "head") else "right", no_wrap=True)
        for li in limits:
            table.add_row(li["layout"], li["head"], _ms(li["dense_ms"]), _ms(li["sebp_ms"]), _ms(li["limit_ms"]),
                          f"{li['sebp_speedup']:.2f}", f"{li['limit_speedup']:.2f}", f"{li['sebp_of_limit']:.2f}",
                          f"{100 * li['inactive_share']:.1f}")
        console.print(table)
    recompiled = ", ".join(f"{_entry(r)}{' (+graphs)' if r['timing'] == 'compiled_graphs' else ''} "
                           f"({r['recompiles']})" for r in m["rows"] if r.get("recompiles"))
    if recompiled:  # the compiled entries whose later batches did not reuse the first one's graphs
        console.print(f"recompiled after the first step: {recompiled}", highlight=False, soft_wrap=True)
    for timing, s in m["summary"].items():
        pick = lambda e: e and f"{_entry(e)}{' ' + e['timing'] if timing == 'all' else ''} {e['ms']:.2f} ms"  # noqa
        base, best = s["fastest_baseline"], s["fastest"]
        gain = f" (x{base['ms'] / best['ms']:.2f} vs the fastest non-SEBP)" if base and best else ""
        console.print(f"{c['name']}, {timing}: fastest dense {pick(s['fastest_dense'])}; fastest non-SEBP "
                      f"{pick(base)}; fastest {pick(best)}{gain}; --padding auto would pick {pick(s['auto_pick'])}",
                      highlight=False, soft_wrap=True)
    reasons: dict[str, list[str]] = {}
    for sk in m["skipped"]:
        reasons.setdefault(sk["reason"], []).append(f"{sk['layout']} {sk['method']} {sk['head']} {sk['timing']}")
    for why, which in reasons.items():
        console.print(f"not run ({len(which)}: {', '.join(which[:4])}{', ...' if len(which) > 4 else ''}): {why}",
                      highlight=False, soft_wrap=True)
    if m.get("backward_kernels"):
        _breakdown_table(m)


# kernel kinds of the breakdown table, the rest summed as "other" (fits 80 columns)
_BREAKDOWN_COLUMNS = {"gemm": ("gemm",), "attention": ("attention",), "sebp": ("sebp", "sebp act"),
                      "norm": ("norm",)}


def _breakdown_table(m: dict) -> None:
    from rich import box
    from rich.table import Table

    runs = m["backward_kernels"]
    if "skipped" in runs:
        console.print(f"kernel breakdown: {runs['skipped']}", highlight=False)
        return
    table = Table(title=f"{m['case']['name']}: GPU kernel time of one backward by kind (ms)", box=box.SIMPLE_HEAD,
                  pad_edge=False, collapse_padding=True)
    table.add_column("entry")
    for k in (*_BREAKDOWN_COLUMNS, "other", "total"):
        table.add_column(k, justify="right", no_wrap=True)
    for entry, r in runs.items():
        kinds = r["by_kind_ms"]
        cols = [sum(kinds.get(k, 0.0) for k in ks) for ks in _BREAKDOWN_COLUMNS.values()]
        table.add_row(entry, *(f"{v:.2f}" for v in cols), f"{r['total_ms'] - sum(cols):.2f}", f"{r['total_ms']:.2f}")
    console.print(table)


def batch_progress(console_, what: str):
    """A transient rich progress bar and the (done, total) callback that drives it."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    progress = Progress(TextColumn(f"[bold]{what}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TimeRemainingColumn(), console=console_, transient=True)
    task = progress.add_task(what, total=None)
    return progress, lambda done, total: progress.update(task, completed=done, total=total)
