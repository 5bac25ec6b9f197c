"""Blocks of docs/method.md: the gradient statistics a ``finetune --probe-every`` run recorded (through
``sebp-probe grad-stats RUN_DIR --json``)."""
from __future__ import annotations

from docgen import Page, block, captioned, f1, f2, table

MINILM = "grad_stats.json#minilm_tweets_cpu"
SMOLLM2 = "grad_stats.json#smollm2_tweets_sft_cpu"
# Three layers of each model by name: for MiniLM those of the issue that asked for these statistics
MINILM_LAYERS = (("layer 0 query", "bert.encoder.layer.0.attention.self.query"),
                 ("layer 2 intermediate", "bert.encoder.layer.2.intermediate.dense"),
                 ("layer 5 value", "bert.encoder.layer.5.attention.self.value"))
SMOLLM2_LAYERS = (("layer 0 q_proj", "model.layers.0.self_attn.q_proj"),
                  ("layer 15 q_proj", "model.layers.15.self_attn.q_proj"),
                  ("layer 15 down_proj", "model.layers.15.mlp.down_proj"))


def _pct(v) -> str:
    return "-" if v is None else f1(100 * v)


def _pair(first: dict, last: dict, key: str) -> str:
    return f"{_pct(first.get(key))} → {_pct(last.get(key))}"


def _end(src) -> str:
    """How the run ended: its held-out accuracy or perplexity, or that it was stopped early."""
    ev = src.data.get("final_eval") or {}
    if src.data.get("status") not in (None, "completed"):
        return f"; the run was {src.data['status']} there"
    if ev.get("eval_accuracy") is not None:
        return f"; held-out accuracy at the end {ev['eval_accuracy']:.2f}"
    if ev.get("eval_perplexity") is not None:
        return f"; held-out perplexity at the end {ev['eval_perplexity']:.2f}"
    return ""


def concentration_table(page: Page, run: str, layers) -> str:
    """Per layer type and for three ``layers`` (label, name): active rows, and the share of them holding 90% /
    99% of the squared norm and the knee, at the first and the last probed step of ``run``."""
    src = page.load(run)
    rows = src.rows()
    steps = sorted({r["step"] for r in rows})
    first, last = steps[0], steps[-1]
    by = {(r["step"], r["layer_type"]): r for r in rows}
    layer_by = {(r["step"], r["layer"]): r for r in src.rows("layer_rows")}
    body = []
    for label, name in layers:
        a, b = layer_by[(first, name)], layer_by[(last, name)]
        body.append([label, _pair(a, b, "active_share"), _pair(a, b, "rows_90"), _pair(a, b, "rows_99"),
                     _pair(a, b, "knee")])
    for t in dict.fromkeys(r["layer_type"] for r in rows):
        a, b = by[(first, t)], by[(last, t)]
        body.append([f"{t} (mean of its layers)", _pair(a, b, "active_share"), _pair(a, b, "rows_90"),
                     _pair(a, b, "rows_99"), _pair(a, b, "knee")])
    header = ["layer", "active rows %", "rows holding 90% of the energy, % of active",
              "rows holding 99%", "knee, % of active"]
    note = (f"Step {first} → step {last} (its backward after {last - 1} updates) of "
            f"{src.data['config']['max_steps']}{_end(src)}.")
    return captioned(page, [src], table(header, body, "lrrrr") + "\n\n" + note)


@block("grad_stats_minilm")
def grad_stats_minilm(page: Page) -> str:
    return concentration_table(page, MINILM, MINILM_LAYERS)


@block("grad_stats_smollm2")
def grad_stats_smollm2(page: Page) -> str:
    return concentration_table(page, SMOLLM2, SMOLLM2_LAYERS)


PROBE_RUNS = "probe_"  # runs of grad_stats.json from `benchmarks/gpu_suite.py probe --add`: probe_<gpu>_<case>


@block("grad_stats_probe")
def grad_stats_probe(page: Page) -> str:
    """What a probed step costs: per bench run of ``bench --scope model --probe``, each entry's unprobed and
    probed step and their ratio, with the noise, the record made after a probed step (rows of runs that timed
    it), and for a compiled entry the graphs its probed step compiled once and the recompiles after them."""
    runs = [name for name in page.load("grad_stats.json").data["runs"] if name.startswith(PROBE_RUNS)]
    if not runs:
        return ("The cost of a probed step on a GPU is not measured yet; `python benchmarks/gpu_suite.py probe "
                "--add` measures it (bert-base and llama-3.2-1b-sft, eager and compiled).")
    sources = [page.load(f"grad_stats.json#{name}") for name in runs]
    header = ["model", "entry", "timing", "unprobed ms", "probed ms", "probed / unprobed", "noise ±%",
              "record ms", "probed graphs", "recompiles"]
    body = []
    for src in sources:
        for model in src.data["models"]:
            for r in model["probe"]["rows"]:
                compiled = r["timing"] == "compiled"
                body.append([model["case"]["name"], f"{r['layout']} {r['method']} {r['head']}", r["timing"],
                             f2(r["unprobed_ms"]), f2(r["probed_ms"]), f"{r['ratio']:.3f}x",
                             "-" if r["spread"] is None else f1(100 * r["spread"]),
                             f2(r["record_ms"]) if "record_ms" in r else "-",
                             str(r["probe_graphs"]) if compiled else "-", str(r["recompiles"]) if compiled else "-"])
    note = ("Wall time of one forward and backward (optimizer left out), device synchronized, probed and "
            "unprobed steps taking turns on the same batches (`sebp-probe bench --scope model --probe`). A "
            "compiled entry's probed step runs compiled: its probed graphs (one per compiled layer graph) are "
            "compiled once, before the timed steps, as a run compiles them in its first step. Record ms: the "
            "host time after a probed step to read its counts and make its record (eps, causes and concentration "
            "of every layer), out of the step's time. With `--probe-every N` a run pays the excess and the record "
            "on one step in N.")
    return captioned(page, sources, table(header, body, "lllrrrrrrr") + "\n\n" + note)
