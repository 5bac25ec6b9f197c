"""Blocks of docs/benchmarks.md, docs/trainer.md and README.md: the compiled whole-model bench
(results/layouts_compiled_h100/) against its eager entries and peers, the issue's compiled targets read from
it, and TRL's SFTTrainer with and without the integration (results/trainer_h100/, results/trainer_h200/)."""
from __future__ import annotations

from docgen import Page, block, captioned, entry_key, f1, f2, table, times

COMPILED = ("layouts_compiled_h100/model_llama-3.2-1b-sft_packed_layers.json",
            "layouts_compiled_h100/model_qwen2.5-0.5b-sft_packed_layers.json",
            "layouts_compiled_h100/model_llama-3.2-1b-sft_padded_layers.json",
            "layouts_compiled_h100/model_bert-base_longest_layers.json",
            "layouts_compiled_h100/model_llama-3.2-1b-sft_longest_libop.json",
            "layouts_compiled_h100/model_llama-3.2-1b-sft_longest_fused_libop.json",
            "layouts_compiled_h100/model_bert-base_longest_cgraphs.json",
            "layouts_compiled_h100/model_llama-3.2-1b-sft_longest_cgraphs.json",
            "layouts_compiled_h100/model_bert-base_cgraphs_own.json",
            "layouts_compiled_h100/model_llama-3.2-1b-sft_cgraphs_own.json",
            "layouts_compiled_h100/model_bert-base_fwdrows.json",
            "layouts_compiled_h100/model_llama-3.2-1b-sft_fwdrows.json",
            "layouts_compiled_h100/model_bert-base_gate.json",
            "triton_op_h100/model_llama-3.2-1b-sft_op.json",
            "layouts_compiled_h200/model_llama-3.2-1b-sft_longest.json",
            "layouts_compiled_h200/model_llama-3.2-1b-sft_packed_peers.json",
            "layouts_compiled_h200/model_llama-3.2-1b-sft_longest_peers.json",
            "layouts_compiled_h200/model_qwen2.5-0.5b-sft_longest_peers.json",
            "layouts_compiled_h200/model_llama-3.2-1b-sft_cce.json",
            "layouts_compiled_h200/model_qwen2.5-0.5b-sft_cce.json",
            "layouts_compiled_h200/model_llama-3.2-1b-sft_cce_s39.json",
            "layouts_compiled_h200/model_qwen2.5-0.5b-sft_cce_s39.json",
            "layouts_compiled_h200/model_llama-3.2-1b-sft_longest_orders.json",
            "layouts_compiled_h200/model_bert-base_longest_orders.json",
            "layouts_compiled_h200/model_bert-base_longest_orders_fused.json",
            "layouts_compiled_h200/model_llama-3.2-1b-sft_longest_orders_s40.json",
            "layouts_compiled_h200/model_qwen2.5-0.5b-sft_longest_orders_s40.json",
            "layouts_compiled_h200/model_bert-base_longest_orders_s41.json")
# The latest run of each case and layout, a later one winning where they overlap (the recompile target's verdict)
LATEST = (COMPILED[20], COMPILED[21], COMPILED[23], COMPILED[25], COMPILED[26], COMPILED[27])
# What the later runs of a layout changed, for the targets' lines (the first run of each has none)
RUN_NOTES = {COMPILED[4]: "with the backward operators of sebp_kernels.library",
             COMPILED[5]: "the same, SEBP on the norms and activations too",
             COMPILED[6]: "compiled SEBP taking the padding rows, and compiled + CUDA graphs",
             COMPILED[7]: "compiled SEBP taking the padding rows, and compiled + CUDA graphs",
             COMPILED[8]: "the same, the linears whose dY is far sparser than the padding selecting their own rows",
             COMPILED[9]: "the same, the linears whose dY is far sparser than the padding selecting their own rows",
             COMPILED[10]: "the same, the SEBP linears' forward over the real-token rows where it pays",
             COMPILED[11]: "the same, the SEBP linears' forward over the real-token rows where it pays",
             COMPILED[12]: "the same, the forward operator called only where its shape could pay, 2026-11-28",
             COMPILED[13]: "the same, the labelled-rows head alone, 2026-11-28",
             COMPILED[14]: "the same on an H200 of a 16-core machine, with Cut-Cross-Entropy, 2026-11-28",
             COMPILED[15]: "two H200s of one machine, with Liger-Kernel, 2026-11-28",
             COMPILED[16]: "two H200s of one machine, with Liger-Kernel, 2026-11-28",
             COMPILED[17]: "two H200s of one machine, with Liger-Kernel, 2026-11-28",
             COMPILED[18]: "an H200, `--padding auto` counting the Cut-Cross-Entropy head, 2026-11-28",
             COMPILED[19]: "an H200, `--padding auto` counting the Cut-Cross-Entropy head, 2026-11-28",
             COMPILED[20]: "the same, batches padded to a multiple of 8 and no size-guarded fusion, 2026-11-28",
             COMPILED[21]: "the same, batches padded to a multiple of 8 and no size-guarded fusion, 2026-11-28",
             COMPILED[22]: "the same code, the bench's default pool of 8 batches, each entry in its own process, "
                           "dense / SEBP / SEBP / dense, 2026-11-28",
             COMPILED[23]: "an H200, each entry in its own process, dense / SEBP / SEBP / dense, 2026-11-28",
             COMPILED[24]: "the same, SEBP on the norms and activations too, 2026-11-28",
             COMPILED[25]: "the same order, the layers told the pool's most rows a batch, 2026-11-28",
             COMPILED[26]: "an H200, each entry in its own process, dense / SEBP / SEBP / dense, the layers told "
                           "the pool's most rows a batch, 2026-11-28",
             COMPILED[27]: "the same order, SEBP's operator outputs counted aligned by Inductor and the embeddings' "
                           "backward skipping the padding rows, 2026-11-29"}

TRAINER = ("trainer_h100/trainer_final.json",)
TRAINER_PF = "trainer_h200/trainer_pf.json"
TRAINER_COMPILED = ("trainer_h100/trainer_compiled_layers.json", "trainer_h200/trainer_compiled.json",
                    "trainer_h200/trainer_compiled_pair.json")


def _run_note(rel: str) -> str:
    """`` (what that run changed)`` for a later run of a layout, else nothing."""
    return f" ({RUN_NOTES[rel]})" if rel in RUN_NOTES else ""


def _model(page: Page, rel: str):
    src = page.load(rel)
    (m,) = src.rows("models")
    return src, m


def _rows(m: dict) -> dict[tuple, dict]:
    return {entry_key(r): r for r in m["rows"]}


def _entry(r: dict) -> str:
    return f"{r['layout']} {r['method']} {r['head']} {r['timing']}"


@block("layouts_compiled")
def layouts_compiled(page: Page) -> str:
    """Per model: every entry eager and compiled (each layer of the stack compiled, dynamic shapes), its
    compile seconds and recompiles, against dense compiled of the same layout and head; then the fastest
    non-SEBP entry and what --padding auto would pick."""
    parts = []
    for rel in COMPILED:
        src, m = _model(page, rel)
        rows = _rows(m)
        body = []
        replayed = any(k[3] == "compiled_graphs" for k in rows)
        for (layout, method, head, timing), c in rows.items():
            if timing != "compiled":
                continue
            e = rows.get((layout, method, head, "eager"))
            d = rows.get((layout, "dense", head, "compiled"))
            g = rows.get((layout, method, head, "compiled_graphs"))
            dg = rows.get((layout, "dense", head, "compiled_graphs"))
            body.append([layout, method, head, f1(e["ms"]) if e else "-", f1(c["ms"]), f1(c["compile_s"]),
                         str(c["recompiles"]), times(e["ms"] / c["ms"]) if e else "-",
                         times(d["ms"] / c["ms"]) if d else "-", f2(c["peak_gib"])]
                        + ([f1(g["ms"]) if g else "-", times(dg["ms"] / g["ms"]) if g and dg else "-"]
                           if replayed else []))
        header = ["layout", "method", "head", "eager ms", "compiled ms", "compile s", "recompiles",
                  "compiled x eager", "x dense compiled", "peak GiB"] + (
                      ["compiled + graphs ms", "x dense compiled + graphs"] if replayed else [])
        s = m["summary"]["all"]
        bar, pick = s["fastest_baseline"], s["auto_pick"]
        c = m["case"]
        line = (f"Fastest non-SEBP entry: {_entry(bar)}, {f1(bar['ms'])} ms; `--padding auto` would pick "
                f"{_entry(pick)}, {f1(pick['ms'])} ms ({times(bar['ms'] / pick['ms'])} the fastest non-SEBP).")
        out = [f"{_entry(r)}: {r['reason']}" for r in m.get("skipped", []) if r["timing"] == "compiled"
               and r["method"] in ("liger", "cce")]
        if out:
            line += " Not run: " + "; ".join(out) + "."
        parts.append(f"**{c['name']} ({c['batch']} x {c['max_length']}), "
                     f"{', '.join(m['layouts_run'])}**\n\n"
                     + captioned(page, [src], table(header, body, "lll" + "r" * (len(header) - 3))) + "\n\n" + line)
    return "\n\n".join(parts)


def _ratio(m: dict, layout: str, head: str, a: str, b: str, timing: str = "compiled") -> float | None:
    """``b`` ms / ``a`` ms on ``layout`` with ``head``, both of ``timing`` (a's speedup over b)."""
    rows = _rows(m)
    ra, rb = rows.get((layout, a, head, timing)), rows.get((layout, b, head, timing))
    return rb["ms"] / ra["ms"] if ra and rb else None


@block("compiled_targets")
def compiled_targets(page: Page) -> str:
    """The compiled targets, each read from the rows above: met or not."""
    models = {rel: _model(page, rel)[1] for rel in COMPILED}
    lines = []
    for rel in (*COMPILED[:2], COMPILED[15], COMPILED[18], COMPILED[19], COMPILED[20], COMPILED[21]):
        m = models[rel]
        s = m["summary"]["all"]
        cce = _rows(m)[("packed", "cce", "labelled", "compiled")]
        x = cce["ms"] / s["auto_pick"]["ms"]
        lines.append(f"- {m['case']['name']}, packed{_run_note(rel)}: `--padding auto`'s pick ({_entry(s['auto_pick'])}) is "
                     f"{times(x)} compiled dense + CCE ({f1(cce['ms'])} ms): target >= 1.00x "
                     f"{'met' if x >= 1.0 else '**not met**'}.")
    for rel, want in ((COMPILED[2], 1.25), (COMPILED[4], 1.25), (COMPILED[5], 1.25), (COMPILED[7], 1.25),
                      (COMPILED[9], 1.25), (COMPILED[11], 1.25), (COMPILED[13], 1.25), (COMPILED[14], 1.25),
                      (COMPILED[16], 1.25), (COMPILED[18], 1.25), (COMPILED[20], 1.25), (COMPILED[22], 1.25),
                      (COMPILED[25], 1.25),
                      (COMPILED[3], 1.15), (COMPILED[6], 1.15), (COMPILED[8], 1.15), (COMPILED[10], 1.15),
                      (COMPILED[12], 1.15), (COMPILED[23], 1.15), (COMPILED[24], 1.15),
                      (COMPILED[27], 1.15)):
        m = models[rel]  # every padded layout each file ran, each ratio within one run
        for layout in (x for x in m["layouts_run"] if x != "packed"):
            got = {h: _ratio(m, layout, h, "sebp", "dense") for h in ("full", "labelled")}
            graphs = _ratio(m, layout, "full", "sebp", "dense", "compiled_graphs")
            best = max(v for v in (*got.values(), graphs) if v is not None)
            heads = ", ".join(f"{times(v)} ({name})" for v, name in ((got["full"], "model's head"),
                                                                     (got["labelled"], "labelled-rows head"),
                                                                     (graphs, "model's head, compiled + CUDA graphs"))
                              if v is not None)
            lines.append(f"- {m['case']['name']}, {layout}{_run_note(rel)}: SEBP compiled against dense compiled "
                         f"{heads}: target >= {times(want)} {'met' if best >= want else '**not met**'}.")
    first = max(r["compile_s"] for rel in (COMPILED[0], COMPILED[2], COMPILED[4], COMPILED[5], COMPILED[7],
                                           COMPILED[9], COMPILED[11], COMPILED[13], COMPILED[14], COMPILED[15],
                                           COMPILED[16], COMPILED[18], COMPILED[20], COMPILED[22], COMPILED[25])
                for r in models[rel]["rows"]
                if r["timing"] == "compiled")
    lines.append(f"- llama-3.2-1b-sft first compile: {f1(first)} s at most per entry, over all of its runs "
                 f"(each layer compiled; the first entry of a fresh cache takes the longest): target <= 90 s "
                 f"{'met' if first <= 90 else '**not met**'}.")
    worst = {models[rel]["case"]["name"] + " " + ",".join(models[rel]["layouts_run"])
             + _run_note(rel):
             max(r["recompiles"] for r in models[rel]["rows"] if r["timing"] == "compiled") for rel in COMPILED}
    latest = {}  # each compiled entry's recompiles in the latest run that has it (later files win)
    for rel in LATEST:
        m = models[rel]
        for r in m["rows"]:
            if r["timing"] == "compiled":
                latest[(m["case"]["name"], *entry_key(r))] = r["recompiles"]
    again = sorted(f"{k[0]} {' '.join(map(str, k[1:]))}" for k, v in latest.items() if v)
    lines.append("- no recompile after a layout's first batch: " + "; ".join(
        f"{k}: {v} at most" for k, v in worst.items()) + ". In the latest run of each entry ("
        + ", ".join(sorted({models[rel]["case"]["name"] for rel in LATEST})) + "; packed and `longest`): "
        + ("none recompiled (met)." if not again else f"{', '.join(again)} recompiled (**not met**)."))
    return "\n".join(lines)


def _loss(r: dict) -> str:
    head = r.get("sebp", {}).get("head")
    return "labelled" if head == "labelled" else "TRL's"


def _cudnn(r: dict) -> str:
    return "off" if r["variant"].endswith("-nocudnn") or r.get("sebp", {}).get("cudnn_attention") is False else "on"


def _trainer_note(src, batches: str, runs: str = "") -> str:
    """The sentence under a trainer_bench table: the case, the steps timed, the JSON's ratios and, where it has
    them, the same pairs compared step by step."""
    c = src.data["case"]
    note = ", ".join(f"{k}: {times(v)}" for k, v in src.data["ratios"].items())
    paired = src.data.get("paired") or {}
    steps = ("; step by step (the median of the per-step ratios, leaving out the steps in which either compiled): "
             + ", ".join(f"{k}: {times(v['ratio'])} ({v['steps']} steps, {v['left_out']} left out)"
                         for k, v in paired.items())) if paired else ""
    return (f"{c['name']} lengths, {c['batch']} sequences a step, {batches}, {src.data['steps']} timed steps after "
            f"{src.data['warmup']}{runs} (steps/s from the median); {note}{steps}.")


@block("trainer_compiled")
def trainer_compiled(page: Page) -> str:
    """SFTTrainer with torch_compile=True (and eager rows of the same machine) per variant: steps/s from the
    median step, the mean and the slowest step (recompiles fall inside the timed steps), the timed steps that
    compiled a graph, the peak memory and the loss."""
    parts = []
    for rel in TRAINER_COMPILED:
        src = page.load(rel)
        body = [[r["variant"], _cudnn(r), f2(r["steps_per_s"]), f1(r["step_ms_median"]), f1(r["step_ms_mean"]),
                 f1(max(r["step_ms"]) / 1e3), str(sum(g > 0 for g in r.get("step_graphs", []))),
                 f1(r["peak_gib"]), _loss(r)] for r in src.rows("results") if "steps_per_s" in r]
        parts.append(captioned(page, [src], table(
            ["variant", "cuDNN attention", "steps/s", "step ms (median)", "step ms (mean)", "slowest step s",
             "steps that compiled", "peak GiB", "loss"], body, "llrrrrrrl"))
            + "\n\n" + _trainer_note(src, "padded batches", ", each variant in its own call"))
    return "\n\n".join(parts)


def _trainer_table(page: Page, rel: str, batches: str, runs: str = "") -> str:
    """One SFTTrainer bench's table: per variant whether sdpa could take cuDNN's attention, steps/s, the step's
    median and mean (the mean counts the slow first steps of new shapes), the peak memory and the loss the step
    ran; then its note."""
    src = page.load(rel)
    body = [[r["variant"], _cudnn(r), f2(r["steps_per_s"]), f1(r["step_ms_median"]), f1(r["step_ms_mean"]),
             f1(r["peak_gib"]), _loss(r)] for r in src.rows("results") if "steps_per_s" in r]
    return captioned(page, [src], table(
        ["variant", "cuDNN attention", "steps/s", "step ms (median)", "step ms (mean)", "peak GiB", "loss"],
        body, "llrrrrl")) + "\n\n" + _trainer_note(src, batches, runs)


@block("trainer_h100")
def trainer_h100(page: Page) -> str:
    """SFTTrainer steps per second per variant, padded batches (:func:`_trainer_table`)."""
    return "\n\n".join(_trainer_table(page, rel, "padded batches") for rel in TRAINER)


@block("trainer_pf")
def trainer_pf(page: Page) -> str:
    """SFTTrainer on TRL's padding-free batches, eager (:func:`_trainer_table`)."""
    return _trainer_table(page, TRAINER_PF, "padding-free batches (one flattened row a step)",
                          ", in two calls on one machine")


@block("op_overhead")
def op_overhead(page: Page) -> str:
    """Host time of the SEBP linear's backward operator (results/op_overhead_h100/): one call each way, and a
    compiled stack of linears dense and with the operator defined each way."""
    src = page.load("op_overhead_h100/op_overhead.json")
    d = src.data
    call, stack = d["per_call_us"], d["stack_step_us"]
    names = {"dense_matmuls": "dense: the two matmuls (dX, dW)", "triton_backward": "SEBP: the Triton backward alone",
             "python_function": "SEBP: the operator's Python function",
             "library": "SEBP: `sebp::linear_backward` as defined now (`sebp_kernels.library`)",
             "custom_op": "SEBP: the same function as a `torch.library.custom_op`"}
    rows = [[names[k], f1(call[k])] for k in names]
    n = d["layers"]
    stack_rows = [[f"{n} linears compiled, dense", f1(stack["dense"]), "-"]]
    for k, what in (("sebp_library", "SEBP, the operator as defined now"),
                    ("sebp_custom_op", "SEBP, the operator as a `custom_op`")):
        stack_rows.append([f"{n} linears compiled, {what}", f1(stack[k]), f1((stack[k] - stack["dense"]) / n)])
    shape = f"{d['rows']} x {d['width']}"
    fwd = d.get("forward_per_call_us")  # runs from before the forward operator have none
    fwd_names = {"f_linear": "dense: `F.linear` on every row",
                 "over_rows": "SEBP: the forward over rows, called directly",
                 "library": "SEBP: `sebp::linear_forward`"}
    fwd_table = [table([f"one forward call ({shape} rows, half real, bf16)", "host us"],
                       [[fwd_names[k], f1(fwd[k])] for k in fwd_names], "lr")] if fwd else []
    return captioned(page, [src], "\n\n".join([
        table([f"one backward call ({shape} rows, half active, bf16)", "host us"], rows, "lr"), *fwd_table,
        table([f"forward + backward ({shape} rows per layer)", "host us per step", "more per layer than dense"],
              stack_rows, "lrr"),
        f"Host microseconds per call, the median of {d['rounds']} interleaved rounds of {d['calls']} calls "
        "(the stacks: a tenth as many steps); rows few enough that the GPU never sets the pace."]))


@block("op_triton")
def op_triton(page: Page) -> str:
    """The static-shape stack of linears, half its rows without gradient: dense, SEBP through the operator and
    SEBP with the triton_op backward (results/op_overhead_h100/op_triton.json)."""
    src = page.load("op_overhead_h100/op_triton.json")
    d = src.data
    stack, diff, n = d["stack_step_us"], d["max_rel_diff"], d["layers"]
    names = {"dense": "dense", "sebp_library": "SEBP, the operator `sebp::linear_backward` (`sebp_kernels.library`)",
             "sebp_triton_op": "SEBP, the `triton_op` (`sebp_kernels._triton.traced`)"}
    rows = [[what, f1(stack[k]), "-" if k == "dense" else f1((stack[k] - stack["dense"]) / n),
             "-" if k == "dense" else f"{diff[k]:.1g}"] for k, what in names.items()]
    return captioned(page, [src], "\n\n".join([
        table([f"{n} linears ({d['rows']} x {d['width']} rows, half without gradient, bf16) compiled, static shapes",
               "host us per step", "more per layer than dense", "largest gradient difference from dense"],
              rows, "lrrr"),
        f"Host microseconds per forward + backward, the median of {d['rounds']} interleaved rounds of {d['calls']} "
        "steps; the difference relative to the gradient's largest magnitude."]))



TRITON_OP_MODEL = ("triton_op_h100/model_llama-3.2-1b-sft_op.json", "triton_op_h100/model_llama-3.2-1b-sft_tt.json")
TRITON_OP_AB = "triton_op_h100/ab"  # one JSON a run of benchmarks/ab_code.sh, named <commit>[_<switch>]_<time>


@block("triton_op_model")
def triton_op_model(page: Page) -> str:
    """Llama-3.2-1B `longest`, each layer compiled, labelled head: dense, SEBP through the operator and SEBP
    with the triton_op backward, per batch (results/triton_op_h100/, one machine)."""
    (src_op, op), (src_tt, tt) = (_model(page, rel) for rel in TRITON_OP_MODEL)
    got = {("dense", "op"): _rows(op)[("longest", "dense", "labelled", "compiled")],
           ("sebp", "op"): _rows(op)[("longest", "sebp", "labelled", "compiled")],
           ("sebp", "tt"): _rows(tt)[("longest", "sebp", "labelled", "compiled")]}
    shapes = op["layouts"]["longest"]["shapes"]
    rows = [[f"{b} x {t}", str(b * t)] + [f1(got[k]["per_batch_ms"][i]) for k in got] for i, (b, t) in
            enumerate(shapes)]
    rows.append(["step (mean of the batches' medians)", "-"] + [f"**{f1(r['ms'])}**" for r in got.values()])
    rows.append(["compile s / recompiles", "-"] + [f"{f1(r['compile_s'])} / {r['recompiles']}" for r in got.values()])
    return captioned(page, [src_op, src_tt], "\n\n".join([
        table(["batch (sequences x longest)", "rows", "dense ms", "SEBP, the operator ms", "SEBP, the triton_op ms"],
              rows, "lrrrr"),
        "Compiled step ms (forward + backward, median per batch) in the bench's order of the batches; the two runs "
        "one after the other on one machine, the second with `SEBP_TRITON_OP=1`."]))


@block("triton_op_ab")
def triton_op_ab(page: Page) -> str:
    """The same SEBP entry with the tree of 0c2ba73 with and without the switch and with d78623b's code, in
    one call, in the order the runs started (results/triton_op_h100/ab/)."""
    runs = sorted((_model(page, f"{TRITON_OP_AB}/{path.name}") for path in
                   (page.root / "results" / TRITON_OP_AB).glob("*.json")), key=lambda sm: sm[0].env()["date"])
    rows = []
    for src, m in runs:
        r = _rows(m).get(("longest", "sebp", "labelled", "compiled"))
        switches = "".join(f", `{k}={v}`" for k, v in src.env().get("sebp_env", {}).items())
        rows.append([src.rel.split("/")[-1].split("_")[0] + switches]
                    + (["cut by the run's time limit while compiling", "-", "-"] if r is None else
                       [f1(r["ms"]), f1(r["compile_s"]), str(r["recompiles"])]))
    return captioned(page, [src for src, _ in runs], "\n\n".join([
        table(["code", "SEBP labelled, compiled: step ms", "compile s", "recompiles"], rows, "lrrr"),
        "One device call, the runs in the table's order, each with its commit's packages (`benchmarks/ab_code.sh` "
        "with `REVERSE=0 LIMIT=110`)."]))


# one JSON a run of benchmarks/ab_code.sh: folder, the entry whose speed is read against the other's, that other
LABEL_AB = (("label_checks_h200/ab_llama", ("longest", "sebp", "labelled", "compiled"),
             ("longest", "dense", "labelled", "compiled"), "SEBP x dense"),
            ("label_checks_h200/ab_qwen", ("packed", "dense", "labelled", "compiled"),
             ("packed", "cce", "labelled", "compiled"), "dense labelled x CCE"))


@block("label_checks_ab")
def label_checks_ab(page: Page) -> str:
    """The labelled-rows head's label checks read on the host (500e459) or held on the device (3189ab7): two
    bench entries per run, each case's runs in the order they ran (results/label_checks_h200/)."""
    srcs, rows = [], []
    for folder, entry, other, what in LABEL_AB:
        runs = sorted((_model(page, f"{folder}/{path.name}") for path in
                       (page.root / "results" / folder).glob("*.json")), key=lambda sm: sm[0].env()["date"])
        for src, m in runs:
            srcs.append(src)
            got = _rows(m)
            e, o = got[entry], got[other]
            rows.append([m["case"]["name"], src.rel.split("/")[-1].split("_")[0], f"{_entry(e)}: {f1(e['ms'])}",
                         f"{_entry(o)}: {f1(o['ms'])}", f"{what} {times(o['ms'] / e['ms'])}"])
    return captioned(page, srcs, "\n\n".join([
        table(["case", "code", "entry ms", "against ms", "speed"], rows, "llrrl"),
        "One device call on a two-H200 machine, one case on each GPU at once, each run with its commit's packages "
        "(`benchmarks/ab_code.sh` with `ORDER` and `REVERSE=0`); compiled step ms, the mean of the batches' medians."]))


@block("compiled_summary")
def compiled_summary(page: Page) -> str:
    """The README's table: per model and layout of the H200 runs that count the CCE head in the pick, each method
    compiled (dense, dense + CCE, SEBP, all over the labelled rows), the fastest eager entry and the layout's
    fastest entry; bold: the model's fastest, which `--padding auto` would train with."""
    body, sources = [], []
    for rel in (COMPILED[20], COMPILED[21]):
        src, m = _model(page, rel)
        sources.append(src)
        rows = _rows(m)
        pick = m["summary"]["all"]["auto_pick"]
        mark = lambda r: "-" if r is None else (  # noqa: E731
            f"**{f1(r['ms'])}**" if entry_key(r) == entry_key(pick) else f1(r["ms"]))
        names = {"dense": "dense", "cce": "dense + CCE", "sebp": "SEBP"}
        for layout in m["layouts_run"]:
            here = [r for r in m["rows"] if r["layout"] == layout]
            eager = min((r for r in here if r["timing"] == "eager"), key=lambda r: r["ms"])
            best = min(here, key=lambda r: r["ms"])
            body.append([f"{m['case']['name']} ({m['case']['batch']} x {m['case']['max_length']})", layout,
                         f1(100 * m["layouts"][layout]["padding_share"]),
                         *(mark(rows.get((layout, method, "labelled", "compiled"))) for method in names),
                         f"{f1(eager['ms'])} ({names[eager['method']]})",
                         f"{names[best['method']]}, {best['timing']}"])
    header = ["model (batch x max length)", "layout", "padding %", "dense compiled", "dense + CCE compiled",
              "SEBP compiled", "fastest eager", "fastest here"]
    note = ("Step ms: forward + backward of one batch after compiling (each decoder layer, dynamic shapes; "
            "compile seconds apart), each batch's median over repeats, averaged over 6 batches drawn from one "
            "pool of SFT-length sequences; every entry computes the loss over the labelled rows only. Bold: "
            "the model's fastest entry, which `--padding auto` would train with.")
    return captioned(page, sources, table(header, body, "llrrrrrl") + "\n\n" + note)
