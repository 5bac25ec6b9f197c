"""Blocks of README.md, docs/benchmarks.md and docs/trainer.md: the compiled whole-model bench
(results/model_compiled.json) and TRL's SFTTrainer with and without the integration (results/trainer.json)."""
from __future__ import annotations

from docgen import Page, block, captioned, entry_key, f1, f2, table, times

# each packed and `longest` layout compiled, with the Cut-Cross-Entropy head (the README's table)
CCE = ("model_compiled.json#llama-3.2-1b-sft_cce", "model_compiled.json#qwen2.5-0.5b-sft_cce")
# `longest` dense against SEBP, each entry in a process of its own (dense / SEBP / SEBP / dense)
LONGEST = ("model_compiled.json#llama-3.2-1b-sft_longest", "model_compiled.json#qwen2.5-0.5b-sft_longest",
           "model_compiled.json#bert-base_longest")
TRAINER = ("trainer.json#eager",)
TRAINER_PF = "trainer.json#padding_free"
TRAINER_COMPILED = ("trainer.json#compiled_h100", "trainer.json#compiled_h200", "trainer.json#compiled_h200_pair")


def _model(page: Page, rel: str):
    src = page.load(rel)
    (m,) = src.rows("models")
    return src, m


def _rows(m: dict) -> dict[tuple, dict]:
    return {entry_key(r): r for r in m["rows"]}


def _entry(r: dict) -> str:
    return f"{r['layout']} {r['method']} {r['head']} {r['timing']}"


@block("compiled_longest")
def compiled_longest(page: Page) -> str:
    """`longest` batches, each entry in its own process: dense and SEBP eager, compiled (each layer) and, where
    the run replayed them, compiled + CUDA graphs; SEBP's speedup over dense of the same timing."""
    body, sources = [], []
    for rel in LONGEST:
        src, m = _model(page, rel)
        sources.append(src)
        rows = _rows(m)
        head = next(iter({k[2] for k in rows}))
        for timing in ("eager", "compiled", "compiled_graphs"):
            d, s = rows.get(("longest", "dense", head, timing)), rows.get(("longest", "sebp", head, timing))
            if d and s:
                body.append([f"{m['case']['name']} ({m['case']['batch']} x {m['case']['max_length']})",
                             "model's" if head == "full" else "labelled rows", timing.replace("_", " + "),
                             f2(d["ms"]), f2(s["ms"]), times(d["ms"] / s["ms"])])
    again = max(r.get("recompiles") or 0 for src in sources for m in src.rows("models") for r in m["rows"])
    note = ("Step ms: forward + backward of one batch (`longest`: each batch padded to its longest sequence), each "
            "batch's median over repeats, averaged over the pool's batches; compiled: each layer, dynamic shapes, "
            "compile seconds apart; " + ("no entry recompiled after its first batch." if not again else
                                         f"at most {again} recompiles an entry."))
    return captioned(page, sources, table(["model (batch x max length)", "head", "timing", "dense ms", "SEBP ms",
                                           "SEBP speedup"], body, "lllrrr") + "\n\n" + note)


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


@block("compiled_summary")
def compiled_summary(page: Page) -> str:
    """The README's table: per model and layout of the H200 runs that count the CCE head in the pick, each method
    compiled (dense, dense + CCE, SEBP, all over the labelled rows), the fastest eager entry and the layout's
    fastest entry; bold: the model's fastest, which `--padding auto` would train with."""
    body, sources = [], []
    for rel in CCE:
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
