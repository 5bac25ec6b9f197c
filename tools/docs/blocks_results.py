"""Blocks of README.md, docs/benchmarks.md and docs/finetune.md: the whole-model layouts, the labelled-rows
head against its peers, fine-tuning on the CPU, gradient reuse."""
from __future__ import annotations

from docgen import Page, Source, block, captioned, entry_key, f1, f2, f3, span, table, times

# The main tables: each model with the SEBP that pays on it (BERT-base: the linears alone, finetune's default;
# the decoders: with the norms and activations as well, --sebp-norms --sebp-acts).
LAYOUT_FILES = ("layouts_h100/model_bert-base.json", "layouts_fused_h100/model_llama-3.2-1b-sft.json",
                "layouts_fused_h100/model_qwen2.5-0.5b-sft.json", "layouts_fused_h100/model_mistral-1b-sft.json")
LINEARS_ONLY = {"bert-base": "layouts_h100/model_bert-base.json",
                "llama-3.2-1b-sft": "layouts_h100/model_llama-3.2-1b-sft.json"}  # SEBP on the linears alone
FUSED = {"bert-base": "layouts_fused_h100/model_bert-base.json",
         "llama-3.2-1b-sft": "layouts_fused_h100/model_llama-3.2-1b-sft.json"}  # and on the norms and activations
# BERT-base `longest` with each SEBP variant (one run: the same code), the last with its rows selected
BERT_VARIANTS = (("linears", "layouts_h100/model_bert-base.json"),
                 ("linears + norms", "pad_rows_h100/model_bert-base_norms.json"),
                 ("linears + norms + activations", "layouts_fused_h100/model_bert-base.json"),
                 ("linears + norms + activations, rows selected", "pad_rows_h100/model_bert-base_select.json"))
HEAD = "head_h100/head.json"
FINETUNE_CPU = "finetune_cpu/finetune_cpu.json"


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


@block("layouts_full")
def layouts_full(page: Page) -> str:
    """Every entry of every model: layout, method, head, eager, graphs and (where measured) compiled ms with the
    compile seconds, peak memory."""
    parts = []
    for src, m in _models(page):
        by_timing: dict[str, dict] = {}
        for r in m["rows"]:
            by_timing.setdefault(r["timing"], {})[(r["layout"], r["method"], r["head"])] = r
        compiled = "compiled" in by_timing
        body = []
        for key in dict.fromkeys((r["layout"], r["method"], r["head"]) for r in m["rows"]):
            e, g, c = (by_timing.get(t, {}).get(key) for t in ("eager", "graphs", "compiled"))
            first = e or g or c
            comp = [f1(c["ms"]) if c else "-", f1(c["compile_s"]) if c else "-"] if compiled else []
            body.append([*key, f1(e["ms"]) if e else "-", f1(g["ms"]) if g else "-", *comp,
                         f2(e["peak_gib"]) if e else "-",
                         times(first["vs_dense_same_layout"]) if first.get("vs_dense_same_layout") else "-"])
        header = ["layout", "method", "head", "eager ms", "graphs ms", *(["compiled ms", "compile s"] if compiled
                                                                          else []), "peak GiB",
                  "vs dense, same layout"]
        align = "lll" + "r" * (len(header) - 3)
        parts.append(f"**{_case(m)}**\n\n" + captioned(page, [src], table(header, body, align)))
    return "\n\n".join(parts)


@block("layouts_limits")
def layouts_limits(page: Page) -> str:
    """SEBP against the limit of each layout (the step without the backward GEMMs of the inactive rows)."""
    parts = []
    for src, m in _models(page):
        body = [[r["layout"], r["head"], r["timing"], f1(100 * r["inactive_share"]), f1(r["dense_ms"]),
                 f1(r["sebp_ms"]), f1(r["limit_ms"]), times(r["sebp_speedup"]), times(r["limit_speedup"]),
                 f2(r["sebp_of_limit"])] for r in m["limits"]]
        header = ["layout", "head", "timing", "inactive %", "dense ms", "SEBP ms", "limit ms", "SEBP x",
                  "limit x", "share of limit"]
        parts.append(f"**{_case(m)}**\n\n" + captioned(page, [src], table(header, body, "lllrrrrrrr")))
    return "\n\n".join(parts)


@block("layouts_verdict")
def layouts_verdict(page: Page) -> str:
    """Per model: the fastest dense entry, the fastest entry, and the best SEBP gain on a layout that is not
    reordered or packed (the mixed-length batches SEBP is for)."""
    lines = []
    for _, m in _models(page):
        rows = m["rows"]
        dense = min((r for r in rows if r["method"] == "dense"), key=lambda r: r["ms"])
        fastest = min(rows, key=lambda r: r["ms"])
        mixed = [r for r in rows if r["method"] == "sebp" and r["layout"] == "longest"]
        gain = max(mixed, key=lambda r: r["vs_dense_same_layout"])
        who = "SEBP" if fastest["method"] == "sebp" else fastest["method"]
        lines.append(f"- **{m['case']['name']}**: the fastest dense entry is {dense['layout']} "
                     f"({_variant(dense)}), {f1(dense['ms'])} ms; the fastest of all is {who} on "
                     f"{fastest['layout']} ({_variant(fastest)}), {f1(fastest['ms'])} ms. On `longest` "
                     f"(batches neither reordered nor packed) SEBP is {times(gain['vs_dense_same_layout'])} "
                     f"dense's step ({_variant(gain)}).")
    return "\n".join(lines)


@block("layouts_fused_gain")
def layouts_fused_gain(page: Page) -> str:
    """SEBP on the linears alone against SEBP with the norms and activations as well, each next to the dense
    entry of its own run: same layout, head and timing."""
    body, sources = [], []
    for name, plain_rel in LINEARS_ONLY.items():
        plain_src, fused_src = page.load(plain_rel), page.load(FUSED[name])
        sources += [plain_src, fused_src]
        plain = {entry_key(r): r for mm in plain_src.rows("models") for r in mm["rows"]}
        for m in fused_src.rows("models"):
            for r in m["rows"]:
                key = (r["layout"], "sebp", r["head"], r["timing"])
                if r["method"] != "dense" or key not in plain:
                    continue
                fused = next(x for x in m["rows"] if entry_key(x) == key)
                old_dense = plain[(r["layout"], "dense", r["head"], r["timing"])]
                body.append([name, r["layout"], _variant(r), times(plain[key]["vs_dense_same_layout"]),
                             times(fused["vs_dense_same_layout"]), f"{f1(old_dense['ms'])} / {f1(r['ms'])}"])
    header = ["model", "layout", "timing", "SEBP linears: x dense", "SEBP linears + norms + activations: x dense",
              "dense ms (each run)"]
    return captioned(page, sources, table(header, body, "lllrrr"))


@block("bert_variants")
def bert_variants(page: Page) -> str:
    """BERT-base on `longest` as CUDA graphs (model's own head): dense against each SEBP variant, with its
    share of the limit."""
    body, sources = [], []
    for what, rel in BERT_VARIANTS:
        src = page.load(rel)
        sources.append(src)
        for m in src.rows("models"):
            pick = lambda method: next(r for r in m["rows"]  # noqa: E731
                                       if entry_key(r) == ("longest", method, "full", "graphs"))
            dense, sebp = pick("dense"), pick("sebp")
            limit = next(r for r in m["limits"] if (r["layout"], r["head"], r["timing"]) == ("longest", "full",
                                                                                              "graphs"))
            rows = "selected by each layer" if m.get("pad_rows") is False else "padding rows from the mask"
            body.append([what, rows, f2(dense["ms"]), f2(sebp["ms"]), times(sebp["vs_dense_same_layout"]),
                         f2(limit["limit_ms"]), f2(limit["sebp_of_limit"])])
    header = ["SEBP on", "inactive rows", "dense ms", "SEBP ms", "SEBP x dense", "limit ms", "share of limit"]
    return captioned(page, sources, table(header, body, "llrrrrr"))


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


@block("head_chunks")
def head_chunks(page: Page) -> str:
    """The labelled-rows head at other chunk sizes than its default, on the decoders (same run as the head
    table)."""
    src = page.load(HEAD)
    rows = [r for r in src.rows("results") if "ms" in r and r["method"].split("@")[0] in ("ours", "ours+last_layer")]
    body = []
    for shape in dict.fromkeys(r["shape"] for r in rows if r["scope"] == "head"):
        mine = {(r["scope"], r["method"]): r for r in rows if r["shape"] == shape}
        for tag in ("", *sorted({"@" + m.split("@")[1] for _, m in mine if "@" in m}, key=lambda t: int(t[1:]))):
            head, step = mine[("head", "ours" + tag)], mine[("model", "ours+last_layer" + tag)]
            body.append([shape, tag[1:] or "default", f2(head["ms"]), f2(head["peak_gib"]), f1(step["ms"]),
                         f2(step["peak_gib"])])
    header = ["shape", "rows a chunk", "head alone: ms", "head alone: peak GiB", "step (+ last layer): ms",
              "step: peak GiB"]
    return captioned(page, [src], table(header, body, "llrrrr"))


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


# ------------------------------------------------------------------------------------ gradient reuse

RESPROP_CPU = "resprop_cpu/resprop_cpu.json"


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


RESPROP_VARIANTS = "resprop_cpu/variants.json"
VARIANT_WHAT = {
    "dense": "-",
    "sample": "P: one sample of the last step (the product's rule); the largest rows of dY - P",
    "mean": "P: the last step's dY averaged over its samples; the largest rows of dY - P",
    "fitted": "P: one sample, scaled by its least-squares fit to this step's dY (0 to 1); the largest rows",
    "none": "no P (no reuse): the largest rows of dY itself",
    "sampled": "no P: rows drawn with probability in proportion to their norm, scaled by 1 / probability "
               "(unbiased)",
}


@block("resprop_variants")
def resprop_variants(page: Page) -> str:
    """The reuse-0.9 ablations of benchmarks/resprop_variants.py against dense, in one run."""
    src = page.load(RESPROP_VARIANTS)
    header, body = _reuse_runs(src, VARIANT_WHAT)
    return captioned(page, [src], table(header, body, "lllll") + "\n\n" + _reuse_settings(src))


RESPROP_GPU = "resprop_h100/resprop.json"


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


RESPROP_PROFILE = "resprop_h100/resprop_profile.json"


@block("resprop_profile")
def resprop_profile(page: Page) -> str:
    """Where the profiled backward's GPU time goes per run, and the most any change to the projections' backward
    could give: dense's time with its projection GEMMs (its cuBLAS GEMMs less the LM head's, the GEMMs that stay
    on cuBLAS under exact SEBP) taken out."""
    src = page.load(RESPROP_PROFILE)
    runs = src.data["variants"]
    kinds = ["gemm", "sebp", "elementwise/other", "reduction", "attention"]
    names = {"dense": "dense", "sebp_exact": "SEBP (exact)"}
    body = [[names.get(n, n.replace("resprop_", "reuse ")), f1(r["backward_ms"]), f1(r["breakdown"]["total_ms"]),
             *(f1(r["breakdown"]["by_kind_ms"].get(k, 0.0)) for k in kinds)] for n, r in runs.items()]
    header = ["backward", "wall ms", "GPU kernels ms", "cuBLAS GEMMs", "SEBP kernels", "elementwise / other",
              "reductions", "attention"]
    dense = runs["dense"]["breakdown"]
    head = runs["sebp_exact"]["breakdown"]["by_kind_ms"]["gemm"]
    proj = dense["by_kind_ms"]["gemm"] - head
    rest = dense["total_ms"] - proj
    sebp = runs["sebp_exact"]["breakdown"]["by_kind_ms"]["sebp"]
    budget = dense["total_ms"] / 1.5 - rest
    note = (f"Kernel times summed over the profiled steps' backward, per step. The projections' GEMMs take "
            f"{f1(proj)} ms of dense's {f1(dense['total_ms'])} ms ({f1(dense['by_kind_ms']['gemm'])} ms of cuBLAS "
            f"GEMMs less the LM head's {f1(head)} ms, which stay on cuBLAS under SEBP); with them at no cost the "
            f"backward would still take {f1(rest)} ms of kernels: at most {times(dense['total_ms'] / rest)} dense. "
            f"For 1.5x, the reuse path of all projections would have to fit in {f1(budget)} ms; exact SEBP's "
            f"projection kernels take {f1(sebp)} ms, and a tenth of them (reuse 0.9's kept rows, if time scaled with "
            f"rows) is already {f1(sebp / 10)} ms, before D = dY - P is formed and ranked, which reads all of dY.")
    return captioned(page, [src], table(header, body, "lrrrrrrr") + "\n\n" + note)


FSDP = "fsdp_h200/fsdp.json"


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


FSDP_SFT = "fsdp_sft_h100/fsdp_sft.json"


def _second_over_first(pairs: dict, method: str) -> float:
    """``method``'s compiled (whole model) median step in the first place of its process over its step in the
    second."""
    runs = [pairs[n]["runs"][method] for n in ("pair_dense-first", "pair_sebp-first")]
    ms = {r["place"]: r["step_ms"] for r in runs}
    return ms[1] / ms[2]


@block("fsdp_sft_h100")
def fsdp_sft_h100(page: Page) -> str:
    """FSDP2 on two GPUs on SFT-length batches: compiled and eager pairs, by place in the process."""
    src = page.load(FSDP_SFT)
    d = src.data
    body = []
    for p in d["pairs"].values():
        for method, r in sorted(p["runs"].items(), key=lambda kv: kv[1]["place"]):
            sebp = f"{r['sebp_layers']} of {r['sebp_layers'] + r['dense_layers']}" if method == "sebp" else "-"
            body.append([p["label"], method, str(r["place"]), sebp, f"{p['timed_steps']} of {p['steps']}",
                         f1(r["step_ms"]),
                         f1(r["backward_ms"]), f1(r["peak_mem_gib_rank0"]), f3(r["eval_loss"]),
                         f3(p["max_abs_loss_gap"])])
    header = ["pair", "method", "run in its process", "projections on SEBP", "steps timed of run", "median step ms",
              "median backward ms", "peak GiB (rank 0)", "held-out loss", "largest loss gap in the pair"]
    paired = "; ".join(f"{p['label']}: step {times(p['step_ratio_per_step'])}, backward "
                       f"{times(p['backward_ratio_per_step'])}" for p in d["pairs"].values())
    places = "; ".join(f"{k}: dense / SEBP on the same step {times(v['step_ratio'])}, backward "
                       f"{times(v['backward_ratio'])}, "
                       f"SEBP's peak memory {v['peak_mem_ratio']:.3f} of dense's" for k, v in d["by_place"].items())
    both = "; ".join(f"{k}: step {times(v['step_ratio'])} ({times(min(v['step_ratio_by_order']))}-"
                     f"{times(max(v['step_ratio_by_order']))} by order; over steps alone the median's 95% bootstrap "
                     f"interval is {times(v['step_ratio_ci95_over_steps'][0])}-"
                     f"{times(v['step_ratio_ci95_over_steps'][1])}), backward {times(v['backward_ratio'])} "
                     f"({v['steps']} "
                     f"steps), SEBP's peak memory at most {v['peak_mem_ratio_max']:.4f} of dense's"
                     for k, v in d["both_orders"].items())
    dates = ", ".join(sorted({p["date"][:10] for p in d["pairs"].values()}))
    b = d["before"]
    second = ", ".join(f"{m} {times(_second_over_first(b['pairs'], m))}" for m in ("dense", "sebp"))
    second_now = ", ".join(f"{m} {times(_second_over_first(d['pairs'], m))}" for m in ("dense", "sebp"))
    r = d["resume"]
    note = (f"{d['model']}; {d['data']}; {d['attention']}. FSDP2 through `accelerate launch --use_fsdp "
            f"--fsdp_version 2`, full shard, each decoder layer a unit; pairs run {dates}; `compiled`: "
            f"`--compile-scope model`, `compiled by layers`: `--compile-scope layers`. Medians over the steps after "
            f"the third that no run of the pair compiled in (by layers: on either process; the whole-model pairs "
            f"ran before the processes agreed on that). Dense / SEBP on the same step, the median over those "
            f"steps: {paired}. **Both orders together: {both}.** Same place in the process: {places}. A "
            f"compiled (whole model) run's median step, second "
            f"place over first: {second_now}; measured {b['date'][:10]}, when {b['attention']}: {second}.\n\n"
            f"Resume (exact SEBP, eager, 16 steps, {d['environment']['date_resume_fsdp1'][:10]}): killed by "
            f"SIGTERM, resumed from step {r['resumed_from_step']}; "
            f"against the run uninterrupted the losses differ by at most {r['max_abs_loss_gap_after_resume']:.3f} "
            f"after the resume and by {r['max_abs_loss_gap_before_kill']:.3f} before the kill, where both ran the "
            f"same code from the same start (steps {', '.join(map(str, r['identical_steps'][:4]))} identical). "
            f"FSDP1 (`--fsdp_version 1`): {d['fsdp1']['status']}, {d['fsdp1']['steps']} steps with SEBP on "
            f"{d['fsdp1']['sebp_layers']} projections. A resume by one process: `{d['resume_other_process_count']}`.")
    return captioned(page, [src], table(header, body, "llllrrrrrr") + "\n\n" + note)


FSDP_DET = "fsdp_det_h200/determinism.json"


@block("fsdp_det_h200")
def fsdp_det_h200(page: Page) -> str:
    """--deterministic under FSDP2: the same command twice, a SIGTERM + --resume, and one compile by layers."""
    src = page.load(FSDP_DET)
    d = src.data
    rows = [("the same command twice", d["twice"])]
    if "resume_before" in d:
        rows.append(("killed and resumed, before checkpoints kept the padding-row verdict",
                     d["resume_before"]))
    rows.append(("killed and resumed", d["resume"]))
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
    note = (f"{d['model']}; {d['data']}; {d['run']}; both resumes from step {d['resume']['resumed_from_step']}."
            + compiled)
    return captioned(page, [src], table(header, body, "lrrrl") + "\n\n" + note)


COMPARE = "compare_h100/compare.json"


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
    src = page.load(f"examples/{name}.json")
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
    return _example(page, "finetune", (("--padding auto", None),))


# the same commands re-run after the SEBP kernels took row counts unspecialised (the llama run cut by its limit)
RECHECK = (("recheck_h100/model_bert-base_linears.json", "layouts_h100/model_bert-base.json"),
           ("recheck_h100/model_llama-3.2-1b-sft_cut.json", "layouts_fused_h100/model_llama-3.2-1b-sft.json"))


@block("layouts_recheck")
def layouts_recheck(page: Page) -> str:
    """Per model and timing (eager, CUDA graphs): the re-run's step time over the committed one's, entry by entry
    (same layout, method and head), for the layouts the re-run measured."""
    body, sources = [], []
    for new_rel, old_rel in RECHECK:
        new, old = page.load(new_rel), page.load(old_rel)
        sources.append(new)
        (m,), (o,) = new.rows("models"), old.rows("models")
        before = {entry_key(r): r["ms"] for r in o["rows"]}
        layouts = sorted({r["layout"] for r in m["rows"]}, key=m["layouts_run"].index)
        for timing in ("eager", "graphs"):
            ratios = [r["ms"] / before[entry_key(r)] for r in m["rows"]
                      if r["timing"] == timing and entry_key(r) in before]
            if ratios:
                body.append([_case(m), ", ".join(layouts) + ("" if m["complete"] else " (cut by its time limit)"),
                             timing, str(len(ratios)), span(ratios)])
    return captioned(page, sources, table(["model", "layouts re-run", "timing", "entries", "re-run / committed"],
                                          body, "lllrr"))
