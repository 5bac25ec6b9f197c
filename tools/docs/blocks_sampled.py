"""Blocks of docs/method.md: sampled mode's quality against dense, per model and data set, over seeds
(``benchmarks/sampled_quality.py``, runs of results/sampled.json)."""
from __future__ import annotations

import shlex

from docgen import DocsError, Page, block, captioned, table

# (run of results/sampled.json, what it trained); in the table's order
RUNS = (("sampled.json#minilm_tweets_cpu", "MiniLM, tweets, 60 steps"),
        ("sampled.json#minilm_tweets_auto_cpu", "MiniLM, tweets, 60 steps"),
        ("sampled.json#minilm_tweets_300_cpu", "MiniLM, tweets, 300 steps"),
        ("sampled.json#minilm_tweets_300_sdx_cpu", "MiniLM, tweets, 300 steps"),
        ("sampled.json#minilm_tweets_300_sdx_t01_cpu", "MiniLM, tweets, 300 steps"),
        ("sampled.json#minilm_tweets_300_b03_cpu", "MiniLM, tweets, 300 steps"),
        ("sampled.json#minilm_tweets_mlm_cpu", "MiniLM, tweets, masked LM, 60 steps"),
        ("sampled.json#minilm_drugreviews_auto_cpu", "MiniLM, drug reviews, 60 steps"),
        ("sampled.json#minilm_drugreviews_tau_cpu", "MiniLM, drug reviews, 60 steps"),
        ("sampled.json#minilm_drugreviews_tau02_cpu", "MiniLM, drug reviews, 60 steps"),
        ("sampled.json#smollm2_tweets_sft_auto_cpu", "SmolLM2-135M, tweets-sft, 16 steps"),
        ("sampled.json#smollm2_tweets_sft_tau_cpu", "SmolLM2-135M, tweets-sft, 16 steps"),
        ("sampled.json#smollm2_tweets_sft_sdx_cpu", "SmolLM2-135M, tweets-sft, 16 steps"),
        ("sampled.json#smollm2_tweets_sft_b03_cpu", "SmolLM2-135M, tweets-sft, 16 steps"))


def _sd(v) -> str:
    return "" if v is None else f" ± {v:.3f}"


def _metric(arm: dict) -> str:
    if arm.get("eval_accuracy_mean") is not None:
        return f"acc {arm['eval_accuracy_mean']:.3f}{_sd(arm['eval_accuracy_sd'])}"
    return f"loss {arm['eval_loss_mean']:.4f}{_sd(arm.get('eval_loss_sd'))}"


def _gap(arm: dict, dense: dict) -> str:
    if arm is dense:
        return "-"
    if arm.get("eval_accuracy_mean") is not None:
        return f"{100 * (arm['eval_accuracy_mean'] - dense['eval_accuracy_mean']):+.1f} points"
    return f"{100 * (arm['eval_loss_mean'] / dense['eval_loss_mean'] - 1):+.2f}% loss"


def _guard(src, arm: str) -> str:
    rows = [r.get("guard") for r in src.rows() if r["arm"] == arm and r.get("guard")]
    if not rows:
        return "-"
    return (f"min cos {min(g['min_cosine'] for g in rows):.3f}; "
            f"{sum(g['over_budget'] for g in rows)} of {sum(g['layer_checks'] for g in rows)} over")


@block("sampled_quality")
def sampled_quality(page: Page) -> str:
    """Held-out metric (mean ± sd over seeds), its gap to dense, the non-zero rows of dL/dY skipped in dW after
    the warm-up, and the guard's worst cosine and its layer checks over the variance budget."""
    srcs, body, shown = [], [], set()
    for rel, what in RUNS:
        try:
            src = page.load(rel)
        except DocsError:  # a run not measured: no row
            continue
        srcs.append(src)
        arms = src.data["arms"]
        dense = next(a for a in arms if a["arm"] == "dense")
        for a in arms:
            seeds, same = len(a["seeds"]), (what, a["arm"], tuple(a["seeds"]), _metric(a))
            if a is dense and same in shown:  # the dense arm of an earlier run, measured again: once
                continue
            shown.add(same)
            body.append([what, a["arm"].replace("sampled ", "budget "), str(seeds), _metric(a), _gap(a, dense),
                         "0%" if a is dense else f"{100 * a['skipped_of_nonzero_mean']:.1f}%",
                         _guard(src, a["arm"])])
    header = ["model, data", "arm", "seeds", "held-out (mean ± sd)", "vs dense", "non-zero rows skipped in dW",
              "guard"]
    return captioned(page, srcs, table(header, body, "llrrrrl"))


# whole-model runs of model_compiled.json (else model_eager.json): (run, model)
SPEED = (("bert-base_sampled", "bert-base"), ("llama-3.2-1b-sft_sampled", "llama-3.2-1b-sft"),
         ("llama-3.2-1b-sft_sampled_dx", "llama-3.2-1b-sft"))
LAYERS = ("h100_llama-3.2-1b_sampled_0.5", "h100_llama-3.2-1b_sampled_0.3", "h100_bert-base_sampled_0.5",
          "h100_bert-base_sampled_0.3")  # runs of layers.json: bench --scope layers --mode sampled


@block("sampled_speed")
def sampled_speed(page: Page) -> str:
    """Per whole-model bench run (``bench --scope model`` with a ``sampled`` method): each layout and timing's
    fastest other entry (dense, dense + CCE or Liger, of those run), exact SEBP (where run) and sampled step and
    backward, the sampled step against that fastest, whether dX was sampled, and the rows the sampled linears
    skipped in dW over the timed steps."""
    srcs, body = [], []
    for run, name in SPEED:
        src = None
        for family in ("model_compiled.json", "model_eager.json"):
            try:
                src = page.load(f"{family}#{run}")
                break
            except DocsError:
                continue
        if src is None:
            continue
        srcs.append(src)
        for model in src.data["models"]:
            layers = next((v for k, v in model["sebp_layers"].items() if k.startswith("sampled")), {})
            for layout in model["layouts_run"]:
                for timing in ("eager", "compiled"):
                    got = {r["method"]: r for r in model["rows"] if r["layout"] == layout and r["timing"] == timing}
                    if "sampled" not in got or not {"dense", "cce", "liger"} & set(got):
                        continue
                    best = min((got[m] for m in ("dense", "cce", "liger") if m in got), key=lambda r: r["ms"])
                    e, s_ = got.get("sebp"), got["sampled"]
                    body.append([name, layout, timing, s_["head"],
                                 f"{best['method']} {best['ms']:.2f} ({best['backward_ms']:.2f})",
                                 f"{e['ms']:.2f} ({e['backward_ms']:.2f})" if e else "-",
                                 "sampled" if layers.get("sample_dx") else "exact",
                                 f"{s_['ms']:.2f} ({s_['backward_ms']:.2f})", f"{best['ms'] / s_['ms']:.2f}x",
                                 f"{100 * layers.get('skipped_of_nonzero', 0):.0f}%"])
    if not body:
        raise DocsError("no sampled bench run in results/model_compiled.json or model_eager.json")
    header = ["model", "layout", "timing", "head", "fastest other, ms (backward)", "exact SEBP ms (backward)",
              "dX", "sampled ms (backward)", "sampled vs fastest other", "non-zero rows skipped in dW"]
    return captioned(page, srcs, table(header, body, "lllllrlrrr"))


def _budget(data: dict) -> float:
    if "budget" in data:
        return float(data["budget"])
    words = shlex.split(data["command"])  # runs recorded before the file kept it
    return float(words[words.index("--budget") + 1])


@block("sampled_layers")
def sampled_layers(page: Page) -> str:
    """Per layer (``bench --scope layers --mode sampled``): dense and sampled backward (dX exact, dX sampled),
    as CUDA-graph replays (the GPU's work) and eagerly (the host's launches included), with the speedups."""
    srcs, body = [], []
    for run in LAYERS:
        try:
            src = page.load(f"layers.json#{run}")
        except DocsError:
            continue
        srcs.append(src)
        budget = _budget(src.data)
        for r in src.data["layers"]:
            ms = r["ms"]
            x = lambda d, c: f"{ms[d] / ms[c]:.2f}x"  # noqa: E731
            body.append([r["shape"]["name"], f"{r['shape']['rows']}", f"{r['density']:g}", f"{budget:g}",
                         f"{ms['dense']:.3f}", f"{ms['sampled']:.3f} ({x('dense', 'sampled')})",
                         f"{ms['sampled_dx']:.3f} ({x('dense', 'sampled_dx')})", x("dense_eager", "sampled_eager"),
                         x("dense_eager", "sampled_dx_eager")])
    if not body:
        raise DocsError("no sampled per-layer run in results/layers.json")
    header = ["layer", "rows", "non-padding share", "budget", "dense ms (graph)", "sampled, dX exact",
              "sampled, dX sampled", "eager: dX exact", "eager: dX sampled"]
    return captioned(page, srcs, table(header, body, "lrrrrrrrr"))
