"""Blocks of README.md, docs/benchmarks.md and docs/finetune.md: the whole-model layouts, the labelled-rows
head against its peers, fine-tuning on the CPU, gradient reuse."""
from __future__ import annotations

from docgen import Page, Source, block, captioned, entry_key, f1, f2, f3, short_gpu, span, table, times

# The main tables: each model with the SEBP that pays on it (BERT-base: the linears alone, finetune's default;
# the decoders: with the norms and activations as well, --sebp-norms --sebp-acts).
LAYOUT_FILES = ("model_eager.json#bert-base_linears", "model_eager.json#llama-3.2-1b-sft_fused",
                "model_eager.json#qwen2.5-0.5b-sft_fused", "model_eager.json#mistral-1b-sft_fused")
HEAD = "head.json#labelled"
FINETUNE_CPU = "finetune.json#cpu"
FINETUNE_AUTO_LOAD = "finetune.json#auto_beside_load"


# ------------------------------------------------------------------------------ whole model, every layout

def _models(page: Page) -> list[tuple[Source, dict]]:
    return [(src, m) for src in (page.load(rel) for rel in LAYOUT_FILES) for m in src.rows("models")]


def _case(m: dict) -> str:
    c = m["case"]
    return f"{c['name']} ({c['batch']} x {c['max_length']})"


def _variant(r: dict) -> str:
    head = ", labelled head" if r["head"] == "labelled" else ""
    return f"{r['timing']}{head}"


def _best(rows: list[dict], layout: str, method: str) -> dict | None:
    mine = [r for r in rows if r["layout"] == layout and r["method"] == method]
    return min(mine, key=lambda r: r["ms"]) if mine else None


@block("layouts_summary")
def layouts_summary(page: Page) -> str:
    """One row per model and layout: the fastest dense and the fastest SEBP entry (any head, eager or graphs)."""
    body, sources = [], []
    for src, m in _models(page):
        sources.append(src)
        rows = m["rows"]
        fastest = min(rows, key=lambda r: r["ms"])
        for layout in m["layouts"]:  # as the benchmark wrote them: sebp_probe.layouts.LAYOUTS' order
            dense, sebp = _best(rows, layout, "dense"), _best(rows, layout, "sebp")
            if dense is None:
                continue
            mark = lambda r: f"**{f1(r['ms'])}**" if r is fastest else f1(r["ms"])  # noqa: E731
            body.append([_case(m), layout, f1(100 * m["layouts"][layout]["padding_share"]),
                         f"{mark(dense)} ({_variant(dense)})",
                         f"{mark(sebp)} ({_variant(sebp)})" if sebp else "-",
                         times(dense["ms"] / sebp["ms"]) if sebp else "-"])
    header = ["model (batch x max length)", "layout", "padding %", "dense: step ms", "SEBP: step ms",
              "SEBP vs dense"]
    note = ("Step: forward + backward of one batch (median, mean over 8 batches drawn from one pool of "
            "sequences), the fastest of each method's variants (model's own or labelled-rows head, eager or "
            "CUDA graphs); bold: the fastest entry of the model.")
    return captioned(page, sources, table(header, body, "llrrrr") + "\n\n" + note)


@block("layouts_trim")
def layouts_trim(page: Page) -> str:
    """SEBP on the padded batch against dense with the padding removed (CUDA graphs where measured)."""
    body, sources = [], []
    for src, m in _models(page):
        sources.append(src)
        timing = "graphs" if any(r["timing"] == "graphs" for r in m["rows"]) else "eager"
        rows = [r for r in m["rows"] if r["timing"] == timing and r["head"] == "full"]
        dense, sebp = (next(r for r in rows if r["layout"] == "max_length" and r["method"] == method)
                       for method in ("dense", "sebp"))
        best = min((r for r in rows if r["method"] == "dense"), key=lambda r: r["ms"])
        body.append([_case(m), timing, f1(100 * m["layouts"]["max_length"]["padding_share"]), f1(dense["ms"]),
                     f1(sebp["ms"]), f"{f1(best['ms'])} ({best['layout']})", times(dense["ms"] / sebp["ms"]),
                     times(dense["ms"] / best["ms"])])
    header = ["model", "timing", "padding %", "dense, padded: step ms", "SEBP, padded",
              "dense, padding removed", "SEBP x padded dense", "removal x padded dense"]
    return captioned(page, sources, table(header, body, "llrrrrrr"))


# ------------------------------------------------------------------------------------ the labelled head

HEAD_METHODS = {"hf": "full head (model's own loss)", "gather": "gather labelled rows, then plain CE",
                "ours": "labelled-rows head (fused CE)", "ours+last_layer": "labelled-rows head + last layer",
                "ours+last_layer+sebp": "labelled-rows head + last layer + SEBP (linears, norms, activations)",
                "cce": "Cut-Cross-Entropy", "liger": "Liger-Kernel fused linear CE"}


def head_limit_share(shape: dict, tokens: int, labelled: int, seq: int) -> float:
    """The share of the full-head step's matmul FLOPs (forward and backward, attention included) that the rows
    no loss reads cost in the head and in the last layer's position-wise work (query, attention output, MLP,
    and their queries' attention): what the limit removes."""
    d, n_layers, inter, vocab = (shape[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size",
                                                    "vocab_size"))
    mlm = shape["arch"] == "bert-mlm"
    kv = d * shape.get("num_key_value_heads", shape["num_attention_heads"]) // shape["num_attention_heads"]
    mlp = 2 * (2 if mlm else 3) * d * inter
    attention = (4 if mlm else 2) * d * seq  # per query: scores and values over its keys (causal: half)
    layer = 2 * d * (d + 2 * kv) + 2 * d * d + mlp + attention
    head = 2 * d * vocab + (2 * d * d if mlm else 0)  # masked LM: the head's transform too
    removed = (tokens - labelled) * (head + 2 * d * d + 2 * d * d + mlp + attention)
    return removed / (tokens * (n_layers * layer + head))


@block("head_h100")
def head_h100(page: Page) -> str:
    src = page.load(HEAD)
    rows = [r for r in src.rows("results") if r["scope"] == "model" and "ms" in r and "@" not in r["method"]]
    s = src.data["settings"]
    body = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        mine = {r["method"]: r for r in rows if r["shape"] == shape}
        full = mine["hf"]
        cfg = src.data["shapes"][shape]
        share = head_limit_share(cfg, full["tokens"], full["labelled_rows"], cfg.get("seq", s["seq"]))
        limit = full["ms"] * (1 - share)
        for method, r in mine.items():
            body.append([shape, HEAD_METHODS.get(method, method), f1(r["ms"]), times(full["ms"] / r["ms"]),
                         f2(r["peak_gib"]), f2(limit / r["ms"])])
        body.append([shape, "*limit*: full head without the label-less rows' head and last-layer work",
                     f1(limit), times(full["ms"] / limit), "", ""])
    header = ["shape", "loss computed by", "step ms", "vs full head", "peak GiB", "share of limit"]
    note = (f"Forward + backward of the whole model (bf16, random weights); causal shapes: {s['batch']} x "
            f"{s['seq']} tokens, the first {round(100 * s['prompt'])}% of each sequence a prompt (label -100); "
            "masked LM: the standard 15% masking. Median of the timed steps, methods taking turns. The limit: "
            "the full-head step less the matmul FLOPs (forward and backward) of the rows no loss reads in the "
            "head and in the last layer's position-wise work, taking the step's time as spread over its FLOPs; "
            "share of limit = limit ms / step ms (above 1: faster than removing that work alone, as the SEBP "
            "entry's fused norm and activation kernels are).")
    return captioned(page, [src], table(header, body, "llrrrr") + "\n\n" + note)


# ------------------------------------------------------------------------------------ fine-tuning, CPU

@block("finetune_cpu")
def finetune_cpu(page: Page) -> str:
    src = page.load(FINETUNE_CPU)
    runs = src.rows("runs")
    base = next(r for r in runs if r["padding"] == "longest" and r["asked"] == "dense")
    body = []
    repeats = src.data["settings"].get("repeats", 1)
    for r in runs:
        chose = "; ".join(dict.fromkeys(r.get("choices") or [f"{r['run_padding']}, {r['method']}"]))
        what = r["padding"] if r["padding"] != "auto" else f"auto (chose {chose})"
        spread = r.get("runs_step_ms") or [r["median_step_ms"]]
        body.append([what, r["asked"] if r["padding"] != "auto" else "auto", str(r["sebp_layers"]),
                     f1(r["median_step_ms"]) + (f" ({f1(min(spread))}-{f1(max(spread))})" if repeats > 1 else ""),
                     times(base["median_step_ms"] / r["median_step_ms"]), f"{r['final_train_loss']:.4f}"])
    header = ["layout", "method", "layers on SEBP", "step ms" + (f" (range of {repeats} runs)" if repeats > 1 else ""),
              "vs dense longest", "train loss"]
    s = src.data["settings"]
    note = (f"The bundled all-MiniLM-L6-v2 on the bundled tweets, batch {s['batch_size']}, max length "
            f"{s['max_length']}, {s['steps']} steps a run; step ms: the median over a run's steps"
            + (f", the mean over {repeats} runs of each configuration, run in the listed order and then reversed"
               if repeats > 1 else "")
            + "; SEBP runs calibrate first and keep dense any layer SEBP does not speed up (\"layers on SEBP\").")
    return captioned(page, [src], table(header, body, "llrrrr") + "\n\n" + note)


@block("finetune_cpu_auto")
def finetune_cpu_auto(page: Page) -> str:
    """What --padding auto timed before training in the CPU run."""
    src = page.load(FINETUNE_CPU)
    auto = next(r for r in src.rows("runs") if r["padding"] == "auto")["padding_choice"]
    body = [[r["padding"], r.get("head", "-"), f1(100 * r["padding_share"]),
             f1(r["dense_ms"]) if "dense_ms" in r else "-", f1(r["sebp_ms"]) if "sebp_ms" in r else "-",
             r.get("skipped") or ("no layer sparse enough for SEBP" if r.get("sebp_layers") == 0 else "")]
            for r in auto["table"]]
    header = ["layout", "head", "padding %", "dense ms", "SEBP ms", "note"]
    chosen = f"Chosen: {auto['padding']}, {auto['method']}" + (f", {auto['head']} head." if auto.get("head") else ".")
    return captioned(page, [src], table(header, body, "llrrrl") + "\n\n" + chosen)


@block("finetune_auto_beside_load")
def finetune_auto_beside_load(page: Page) -> str:
    """The default command against --method dense --padding longest, a CPU-bound process beside them: round by
    round (the two commands one after the other, under the same load), as the machine's other work changed."""
    src = page.load(FINETUNE_AUTO_LOAD)
    runs, s = src.rows("runs"), src.data["settings"]
    default = [r for r in runs if r["arm"] == "default"]
    dense = [r for r in runs if r["arm"] == "dense_longest"]
    body = [[str(i + 1), f"{d['chose']}, {'SEBP' if d['sebp_layers'] else 'dense'}", f1(d["step_ms"]),
             f1(b["step_ms"]), f2(d["step_ms"] / b["step_ms"]), f1(d["calibration_s"]), f1(d["wall_s"]),
             f1(b["wall_s"])] for i, (d, b) in enumerate(zip(default, dense))]
    header = ["round", "default trained on", "default step ms", "dense longest step ms", "default / dense",
              "default's calibration s", "default run s", "dense run s"]
    load = s.get("load_average")
    note = (f"`finetune minilm DATA.csv --max-steps {s['steps']} --batch-size {s['batch_size']} --max-length "
            f"{s['max_length']} --eval-samples {s['eval_samples']}` on {s['rows_written']} bundled tweets, each run "
            f"in its own process with {s['busy']} CPU-bound process beside it and the machine's other work"
            + (f" (load average {load:.0f} on its 2 cores)" if load else ", which changed from round to round")
            + "; the two commands one after the other in each round, the order reversed every other round; step "
            "ms: a run's median over its steps after the warm-up ones; calibration s: from the run's first progress "
            "line to its first step (the layout timing, the model's reload and SEBP's calibration).")
    return captioned(page, [src], table(header, body, "llrrrrrr") + "\n\n" + note)


# ------------------------------------------------------------------------------------ gradient reuse

RESPROP_CPU = "resprop.json#cpu"


def _reuse_runs(src, what: dict[str, str] | None = None) -> tuple[list[str], list[list[str]]]:
    """Header and rows of a resprop_cpu.py result: loss and accuracy per epoch, the last epoch against dense;
    with ``what``, a column saying what each run's variant changes."""
    levels = src.data["levels"]
    dense = levels["dense"]
    body = []
    for level, r in levels.items():
        reuse, _, name = level.partition(":")
        run = "dense" if level == "dense" else f"reuse {reuse}" + (f" ({name})" if name else "")
        cells = [" / ".join(f"{x:.3f}" for x in r["train_loss"]),
                 " / ".join(f"{100 * x:.1f}" for x in r["val_accuracy"]),
                 f"{100 * (r['val_accuracy'][-1] - dense['val_accuracy'][-1]):+.1f}"]
        extra = [] if what is None else [what["dense" if level == "dense" else (name or "sample")]]
        body.append([run, *extra, *cells])
    header = ["run", *([] if what is None else ["P and kept rows"]), "training loss per epoch",
              "validation accuracy % per epoch", "last epoch vs dense, points"]
    return header, body


def _reuse_settings(src) -> str:
    s = src.data["settings"]
    return (f"The bundled MiniLM on {s['train_samples']} bundled tweets ({s['eval_samples']} held out), batch "
            f"{s['batch']}, {s['padding']} padding, AdamW lr {s['lr']:g}, {s['epochs']} epochs; every run from the "
            "same weights, batches and dropout masks.")


@block("resprop_cpu")
def resprop_cpu(page: Page) -> str:
    src = page.load(RESPROP_CPU)
    header, body = _reuse_runs(src)
    note = _reuse_settings(src)
    drop = src.data["levels"]["dense"].get("reuse_drop") or {}
    if drop:
        kinds = list(drop)
        reuse = list(drop[kinds[0]]["dropped"])
        rows = [[k, f2(d["residual"]), *(f"{f2(d['dropped'][r])} / {f2(d['topk_dropped'][r])}" for r in reuse)]
                for k, d in drop.items()]
        note += ("\n\nWhat each reuse level drops of dL/dY (relative norm, mean over layers and the first dense "
                 "steps), against dropping as many of dY's own smallest rows; \"residual\" is |dY - P| / |dY|:\n\n"
                 + table(["layer type", "residual", *(f"reuse {r}: reuse / smallest rows" for r in reuse)], rows,
                         "l" + "r" * (1 + len(reuse))))
    return captioned(page, [src], table(header, body, "llll") + "\n\n" + note)





RESPROP_GPU = "resprop.json#gpu"


@block("resprop_h100")
def resprop_h100(page: Page) -> str:
    """GPU backward and step time of each reuse level against dense and exact SEBP."""
    src = page.load(RESPROP_GPU)
    body = [[name.replace("resprop_", "reuse ").replace("sebp_exact", "SEBP (exact)"), f1(r["backward_ms"]),
             times(1 / r["backward_vs_dense"]), f1(r["step_ms"]), times(1 / r["step_vs_dense"])]
            for name, r in src.data["variants"].items()]
    st = src.data["settings"]
    header = ["run", "backward ms", "backward x dense", "step ms", "step x dense"]
    note = (f"{st['model']}, bf16, AdamW; {len(st['lengths'])} batches of {st['batch']} sequences (log-normal "
            f"lengths, median {st['median_length']}, max {st['max_length']}) padded to their longest (real tokens "
            f"{round(100 * st['token_density'])}% of the slots), cycled over {st['repeats']} timed steps after "
            f"{st['warmup']} warm-up steps; medians, eager.")
    return captioned(page, [src], table(header, body, "lrrrr") + "\n\n" + note)





FSDP = "fsdp.json#one_vs_two"


@block("fsdp_h200")
def fsdp_h200(page: Page) -> str:
    """accelerate FSDP2 on two GPUs against one GPU, and SEBP against dense inside each --compare."""
    src = page.load(FSDP)
    d = src.data
    body = []
    for step, run in d["runs"].items():
        for method, m in run["methods"].items():
            if step == "one":
                gap = "reference"
            elif method == "dense" and step == "fsdp":
                gap = f"{f3(d['two_gpus_vs_one']['max_abs_loss_gap'])} vs one GPU"
            elif method == "dense":
                gap = "-"
            else:
                gap = f"{f3(run['comparison']['max_abs_loss_gap'])} vs dense"
            sebp = f"{m['sebp_layers']} of {m['sebp_layers'] + m['dense_layers']}" if method != "dense" else "-"
            body.append([run["label"], method, sebp, str(m["steps"]), f3(m["eval_loss"]), gap,
                         f1(m["median_backward_ms"]), f1(m["peak_mem_mb_rank0"] / 1024)])
    header = ["run", "method", "projections on SEBP", "steps", "held-out loss", "largest loss gap",
              "median backward ms", "peak memory GiB (rank 0)"]
    note = (f"{d['model']}; the bundled tweets as instruction pairs, bf16, `longest` padding, 8 sequences a GPU "
            "a step (one GPU: 8 x 2 accumulated, the same 16 sequences a step); every run from seed 0. "
            "FSDP2 through `accelerate launch --use_fsdp --fsdp_version 2`, full shard, each decoder layer a unit.")
    return captioned(page, [src], table(header, body, "lllrrlrr") + "\n\n" + note)


FSDP_SFT = "fsdp.json#sft_compiled"


@block("fsdp_sft_h100")
def fsdp_sft_h100(page: Page) -> str:
    """FSDP2 on two GPUs on SFT-length batches, each layer compiled: each pair's runs, dense and SEBP in both
    orders, and SEBP's speedup over both orders together."""
    src = page.load(FSDP_SFT)
    d = src.data
    body = []
    for p in d["pairs"].values():
        for method, r in sorted(p["runs"].items(), key=lambda kv: kv[1]["place"]):
            body.append([short_gpu(p["device"]), p["label"].rsplit(", ", 1)[-1], method, str(r["place"]),
                         f"{p['timed_steps']} of {p['steps']}", f1(r["step_ms"]), f1(r["backward_ms"]),
                         f1(r["peak_mem_gib_rank0"]), f3(r["eval_loss"])])
    header = ["GPUs", "order", "method", "run in its process", "steps timed", "median step ms",
              "median backward ms", "peak GiB (rank 0)", "held-out loss"]
    both = "; ".join(f"{k}: step {times(v['step_ratio'])} ({times(min(v['step_ratio_by_order']))}-"
                     f"{times(max(v['step_ratio_by_order']))} by order), backward {times(v['backward_ratio'])}, "
                     f"SEBP's peak memory {v['peak_mem_ratio_max']:.4f} of dense's" for k, v in d["both_orders"].items())
    note = (f"{d['model']}; {d['data']}; {d['attention']}. FSDP2 through `accelerate launch --use_fsdp "
            f"--fsdp_version 2`, full shard, each decoder layer a unit, `--compile default` (each layer). Medians over "
            f"the steps after the third that neither process compiled in. **SEBP over dense, both orders together: "
            f"{both}.**")
    r = d.get("resume")
    if r:
        note += (f" Resume (exact SEBP, eager, {r['steps']} steps): killed by SIGTERM, resumed from step "
                 f"{r['resumed_from_step']}; against the uninterrupted run the losses differ by at most "
                 f"{r['max_abs_loss_gap_after_resume']:.3f} after the resume and "
                 f"{r['max_abs_loss_gap_before_kill']:.3f} before the kill (`--deterministic` makes them equal: "
                 "[fine-tuning](finetune.md)).")
    if d.get("fsdp1"):
        note += f" FSDP1 (`--fsdp_version 1`): {d['fsdp1']['status']}."
    return captioned(page, [src], table(header, body, "llllrrrrr") + "\n\n" + note)


FSDP_DET = "fsdp.json#deterministic"


@block("fsdp_det_h200")
def fsdp_det_h200(page: Page) -> str:
    """--deterministic under FSDP2: the same command twice, a SIGTERM + --resume, and one compile by layers."""
    src = page.load(FSDP_DET)
    d = src.data
    rows = [("the same command twice", d["twice"]), ("killed and resumed", d["resume"])]
    body = [[what, f"{r['bit_equal_steps']} of {r['steps']}", str(r["first_differing_step"] or "-"),
             f"{r['max_abs_loss_gap']:.4g}", "yes" if r["evals_equal"] else "no"] for what, r in rows]
    header = ["against the uninterrupted run", "steps with bit-equal loss", "first step that differs",
              "largest loss gap", "held-out losses equal"]
    c = d.get("compile_layers_one_gpu")
    compiled = "" if c is None else (
        f"\n\nCompile by layers ({c['run']}, the same model and data): {c['compile']['graphs']} graphs, "
        f"{c['compile']['graph_breaks']} graph breaks; Dynamo compiled in steps " + ", ".join(f"{k} ({v} s)" for k, v in c["compiled_at_steps"].items())
        + f", {f1(c['compile_s'])} s of compiling in all; the other steps took "
        f"{f1(min(c['other_step_ms']))}-{f1(max(c['other_step_ms']))} ms (new batch shapes, not timed).")
    note = (f"{d['model']}; {d['data']}; {d['run']}; resumed from step {d['resume']['resumed_from_step']}."
            + compiled)
    return captioned(page, [src], table(header, body, "lrrrl") + "\n\n" + note)


COMPARE = "finetune.json#compare"


def _ms_range(part: dict, who: str) -> str:
    lo, hi = part[f"{who}_iqr"]
    return f"{f1(part[f'{who}_ms'])} ({f1(lo)}-{f1(hi)})"


@block("compare_h100")
def compare_h100(page: Page) -> str:
    """finetune --compare in both orders: what its headline said, and the ratio it measured."""
    src = page.load(COMPARE)
    d = src.data
    body = []
    for pair in d["pairs"].values():
        for order, r in pair["orders"].items():
            st, bw = r["step"], r["backward"]
            body.append([pair["label"], order, f"{r['sebp_layers']} of {r['sebp_layers'] + r['dense_layers']}",
                         r["verdict"], str(r["timed_steps"]), _ms_range(st, "dense"), _ms_range(st, "other"),
                         times(st["ratio"]), times(bw["ratio"]), f"{r['max_abs_loss_gap']:.1e}"])
    header = ["pair", "order", "projections on SEBP", "headline", "steps timed in both", "dense step ms (IQR)",
              "SEBP step ms (IQR)", "step ratio", "backward ratio", "largest loss gap"]
    note = (f"{d['model']}; {d['data']}. Ratio: dense / SEBP of the step medians over the steps timed in both runs; "
            "the headline prints it as a speedup only where the verdict is faster or slower.")
    return captioned(page, [src], table(header, body, "lllllrrrrr") + "\n\n" + note)


# ----------------------------------------------------------------------------------- example outputs

def _example(page: Page, name: str, sections: tuple[tuple[str, str | None], ...]) -> str:
    """The command and the parts of its output from each ``(first line's start, line after the part's start)``
    (``None``: to the end), "..." between them."""
    src = page.load(f"examples.json#{name}")
    lines = [line.rstrip() for line in src.data["stdout"].splitlines()]
    parts = []
    for first, after in sections:
        start = next(i for i, line in enumerate(lines) if line.strip().startswith(first))
        end = next((i for i, line in enumerate(lines) if i > start and after and line.strip().startswith(after)),
                   len(lines))
        parts.append("\n".join(lines[start:end]).strip("\n"))
    body = "\n...\n".join(parts)
    return captioned(page, [src], "```\n$ " + src.data["command"] + "\n" + body + "\n```")


@block("example_analyze")
def example_analyze(page: Page) -> str:
    return _example(page, "analyze", (("Rows of dL/dY by cause", "Recommended SEBP settings"),
                                      ("Padding layouts", None)))


@block("example_finetune")
def example_finetune(page: Page) -> str:
    return _example(page, "finetune", (("--padding auto", "dense step"), ("dense ━", None)))


# the same commands re-run after the SEBP kernels took row counts unspecialised (the llama run cut by its limit)
