"""Blocks of docs/method.md: sampled mode's quality against dense, per model and data set, over seeds
(``benchmarks/sampled_quality.py``, runs of results/sampled.json)."""
from __future__ import annotations

from docgen import DocsError, Page, block, captioned, table

# (run of results/sampled.json, what it trained); in the table's order
RUNS = (("sampled.json#minilm_tweets_cpu", "MiniLM, tweets, 60 steps"),
        ("sampled.json#minilm_tweets_auto_cpu", "MiniLM, tweets, 60 steps"),
        ("sampled.json#minilm_tweets_300_cpu", "MiniLM, tweets, 300 steps"),
        ("sampled.json#minilm_tweets_mlm_cpu", "MiniLM, tweets, masked LM, 60 steps"),
        ("sampled.json#minilm_drugreviews_auto_cpu", "MiniLM, drug reviews, 60 steps"),
        ("sampled.json#minilm_drugreviews_tau_cpu", "MiniLM, drug reviews, 60 steps"),
        ("sampled.json#minilm_drugreviews_tau02_cpu", "MiniLM, drug reviews, 60 steps"),
        ("sampled.json#smollm2_tweets_sft_auto_cpu", "SmolLM2-135M, tweets-sft, 16 steps"),
        ("sampled.json#smollm2_tweets_sft_tau_cpu", "SmolLM2-135M, tweets-sft, 16 steps"))


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


SPEED = ("bert-base", "llama-3.2-1b-sft")  # each model's run: in model_compiled.json, else in model_eager.json


@block("sampled_speed")
def sampled_speed(page: Page) -> str:
    """Per whole-model bench run (``bench --scope model`` with a ``sampled`` method): each layout and timing's
    fastest other entry (dense, or dense + CCE where run), exact SEBP and sampled step and backward, the sampled
    step against that fastest, and the rows the sampled linears skipped in dW over the timed steps."""
    srcs, body = [], []
    for name in SPEED:
        src = None
        for family in ("model_compiled.json", "model_eager.json"):
            try:
                src = page.load(f"{family}#{name}_sampled")
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
                    if not {"dense", "sebp", "sampled"} <= set(got):
                        continue
                    best = min((got[m] for m in ("dense", "cce") if m in got), key=lambda r: r["ms"])
                    e, s_ = got["sebp"], got["sampled"]
                    body.append([name, layout, timing, s_["head"],
                                 f"{best['method']} {best['ms']:.2f} ({best['backward_ms']:.2f})",
                                 f"{e['ms']:.2f} ({e['backward_ms']:.2f})",
                                 f"{s_['ms']:.2f} ({s_['backward_ms']:.2f})", f"{best['ms'] / s_['ms']:.2f}x",
                                 f"{100 * layers.get('skipped_of_nonzero', 0):.0f}%"])
    if not body:
        raise DocsError("no sampled bench run in results/model_compiled.json or model_eager.json")
    header = ["model", "layout", "timing", "head", "fastest other, ms (backward)", "exact SEBP ms (backward)",
              "sampled ms (backward)", "sampled vs fastest other", "non-zero rows skipped in dW"]
    return captioned(page, srcs, table(header, body, "llllrrrrr"))
