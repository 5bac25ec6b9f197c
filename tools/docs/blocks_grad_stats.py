"""Blocks of docs/method.md: the gradient statistics a ``finetune --probe-every`` run recorded (through
``sebp-probe grad-stats RUN_DIR --json``)."""
from __future__ import annotations

from docgen import Page, block, captioned, f1, f2, table

MINILM = "grad_stats.json#minilm_tweets_cpu"
# The layers of the issue that asked for these statistics, by name in all-MiniLM-L6-v2
LAYERS = (("layer 0 query", "bert.encoder.layer.0.attention.self.query"),
          ("layer 2 intermediate", "bert.encoder.layer.2.intermediate.dense"),
          ("layer 5 value", "bert.encoder.layer.5.attention.self.value"))


def _pct(v) -> str:
    return "-" if v is None else f1(100 * v)


def _pair(first: dict, last: dict, key: str) -> str:
    return f"{_pct(first.get(key))} → {_pct(last.get(key))}"


@block("grad_stats_minilm")
def grad_stats_minilm(page: Page) -> str:
    """Per layer type and for three layers: active rows, and the share of them holding 90% / 99% of the squared
    norm and the knee, at the first and the last probed step."""
    src = page.load(MINILM)
    rows = src.rows()
    steps = sorted({r["step"] for r in rows})
    first, last = steps[0], steps[-1]
    by = {(r["step"], r["layer_type"]): r for r in rows}
    layer_by = {(r["step"], r["layer"]): r for r in src.rows("layer_rows")}
    body = []
    for label, name in LAYERS:
        a, b = layer_by[(first, name)], layer_by[(last, name)]
        body.append([label, _pair(a, b, "active_share"), _pair(a, b, "rows_90"), _pair(a, b, "rows_99"),
                     _pair(a, b, "knee")])
    for t in dict.fromkeys(r["layer_type"] for r in rows):
        a, b = by[(first, t)], by[(last, t)]
        body.append([f"{t} (mean of its layers)", _pair(a, b, "active_share"), _pair(a, b, "rows_90"),
                     _pair(a, b, "rows_99"), _pair(a, b, "knee")])
    header = ["layer", "active rows %", "rows holding 90% of the energy, % of active",
              "rows holding 99%", "knee, % of active"]
    acc = (src.data.get("final_eval") or {}).get("eval_accuracy")
    note = (f"Step {first} → step {last} (its backward after {last - 1} updates) of {src.data['config']['max_steps']}"
            + (f"; held-out accuracy at the end {acc:.2f}" if acc is not None else "") + ".")
    return captioned(page, [src], table(header, body, "lrrrr") + "\n\n" + note)


PROBE_RUNS = "probe_"  # runs of grad_stats.json from `benchmarks/gpu_suite.py probe --add`: probe_<gpu>_<case>


@block("grad_stats_probe")
def grad_stats_probe(page: Page) -> str:
    """What a probed step costs: per bench run of ``bench --scope model --probe``, each entry's unprobed and
    probed step, their ratio, and for a compiled entry (whose probed step runs eagerly) the hooks' own ratio
    against the same step forced eager, with the noise and the recompiles."""
    runs = [name for name in page.load("grad_stats.json").data["runs"] if name.startswith(PROBE_RUNS)]
    if not runs:
        return ("The cost of a probed step on a GPU is not measured yet; `python benchmarks/gpu_suite.py probe "
                "--add` measures it (bert-base and llama-3.2-1b-sft, eager and compiled).")
    sources = [page.load(f"grad_stats.json#{name}") for name in runs]
    header = ["model", "entry", "timing", "unprobed ms", "probed ms", "probed / unprobed",
              "hooks alone (vs the step eager)", "noise ±%", "recompiles"]
    body = []
    for src in sources:
        for model in src.data["models"]:
            for r in model["probe"]["rows"]:
                compiled = r["timing"] == "compiled"
                body.append([model["case"]["name"], f"{r['layout']} {r['method']} {r['head']}",
                             r["timing"] + (" (probed step eager)" if compiled else ""), f2(r["unprobed_ms"]),
                             f2(r["probed_ms"]), f"{r['ratio']:.3f}x", f"{r['hooks_ratio']:.3f}x",
                             "-" if r["spread"] is None else f1(100 * r["spread"]),
                             str(r["recompiles"]) if compiled else "-"])
    note = ("Wall time of one forward and backward (optimizer left out), device synchronized, probed and "
            "unprobed steps taking turns on the same batches (`sebp-probe bench --scope model --probe`); a "
            "compiled run's probed step runs eagerly, so its ratio is against the compiled step and the hooks' "
            "own against the same step eager. With `--probe-every N` a run pays the excess on one step in N.")
    return captioned(page, sources, table(header, body, "lllrrrrrr") + "\n\n" + note)
