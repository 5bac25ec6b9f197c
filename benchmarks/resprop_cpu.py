"""CPU experiment: fine-tune the bundled MiniLM on the bundled tweets with ReSprop at several reuse levels.

Every level (and the dense baseline) starts from the same weights, classifier head included, sees the same
batches in the same order and draws the same dropout masks; only the backward of the attention and MLP
projections differs. Batches are padded to their longest sample (dynamic padding), so P is aligned across
batches of different lengths. The dense run also measures, over its first ``--drop-steps`` steps, what each
reuse level would drop of every layer's dL/dY (``sebp_probe.ReuseDropCollector``), next to what dropping the
same share of dY's own smallest rows would.

Usage: python benchmarks/resprop_cpu.py [--train-samples 160] [--eval-samples 160] [--epochs 3]
       [--levels dense,0,0.5,0.7,0.9,0.95,0.99] [--output runs/resprop_cpu.json]
A level may name an ablation of the reuse rule, e.g. ``0.9:none`` (no P: the largest rows of dY); the
variants are in ``benchmarks/resprop_variants.py``.
Writes the JSON and a figure beside it (same name, .png): training loss and validation accuracy per epoch.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages, not an installed copy

import torch  # noqa: E402

from sebp_probe import ReuseDropCollector, __version__, patch_resprop  # noqa: E402
from sebp_probe.analysis.analyze import layer_type  # noqa: E402
from sebp_probe.data.assets import load_model  # noqa: E402
from sebp_probe.config import DataConfig  # noqa: E402
from sebp_probe.data.batching import PadCollator  # noqa: E402
from sebp_probe.data.textdata import load_text_data, padding_side, tokenize  # noqa: E402

from resprop_variants import parse, variant  # noqa: E402

LEVELS = "dense,0,0.5,0.7,0.9,0.95,0.99"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict:
    import transformers

    return {"cpu": cpu_name(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "sebp_probe": __version__,
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def parse_levels(text: str) -> list[str]:
    """'dense,0.9,0.9:none' -> the same strings, each checked (resprop_variants.parse)."""
    levels = [v.strip() for v in text.split(",") if v.strip()]
    for v in levels:
        parse(v)
    return levels


def label(level: str) -> str:
    reuse, name = parse(level)
    return "dense" if reuse == "dense" else f"reuse {reuse}" + ("" if name == "sample" else f" ({name})")


def epoch_batches(items: list[dict], collate, batch: int, seed: int, epoch: int) -> list[dict]:
    """This epoch's batches, in an order fixed by (seed, epoch): the same for every level."""
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
    return [collate([items[i] for i in order[s:s + batch]]) for s in range(0, len(order), batch)]


@torch.no_grad()
def accuracy(model, batches: list[dict]) -> float:
    model.eval()
    right = total = 0
    for b in batches:
        pred = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.argmax(-1)
        right += int((pred == b["labels"]).sum())
        total += len(pred)
    return right / total


def drop_summary(collector: ReuseDropCollector) -> dict:
    """Per layer type: the mean over layers and steps of what each reuse level drops (relative norm)."""
    by_type: dict[str, list[dict]] = {}
    for name, s in collector.summary().items():
        if s["steps"]:
            by_type.setdefault(layer_type(name), []).append(s)
    out = {}
    for kind, rows in by_type.items():
        mean = lambda key, r: statistics.fmean(x[key][r] for x in rows)  # noqa: E731
        out[kind] = {"dropped": {r: mean("dropped", r) for r in rows[0]["dropped"]},
                     "topk_dropped": {r: mean("topk_dropped", r) for r in rows[0]["topk_dropped"]},
                     "residual": statistics.fmean(x["residual"] for x in rows), "layers": len(rows),
                     "steps": rows[0]["steps"]}
    return out


def run_level(level: str, model0, items, collate, eval_batches, a) -> dict:
    model = copy.deepcopy(model0)
    reuse, name = parse(level)
    if reuse != "dense":
        patch_resprop(model, float(reuse))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    torch.manual_seed(a.seed)  # the same dropout masks in every level
    res = {"variant": None if reuse == "dense" else name, "train_loss": [], "val_accuracy": [], "step_loss": [],
           "epoch_s": []}
    step_s = []
    collector = ReuseDropCollector(model) if level == "dense" and a.drop_steps > 1 else None
    watch = contextlib.ExitStack()
    ablation = variant(name, a.seed) if reuse != "dense" else contextlib.nullcontext()
    if collector is not None:
        watch.enter_context(collector)
    start = time.perf_counter()
    step = 0
    with ablation, watch:
        for epoch in range(a.epochs):
            t0 = time.perf_counter()
            model.train()
            losses = []
            for b in epoch_batches(items, collate, a.batch, a.seed, epoch):
                t_step = time.perf_counter()
                loss = model(**b).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
                step_s.append(time.perf_counter() - t_step)
                step += 1
                if step == a.drop_steps:
                    watch.close()
            res["step_loss"] += losses
            res["train_loss"].append(statistics.fmean(losses))
            res["val_accuracy"].append(accuracy(model, eval_batches))
            res["epoch_s"].append(round(time.perf_counter() - t0, 2))
            print(f"  {level:>9} epoch {epoch + 1}: train loss {res['train_loss'][-1]:.4f}, "
                  f"val accuracy {res['val_accuracy'][-1]:.4f} ({res['epoch_s'][-1]:.0f} s)", flush=True)
    res["wall_s"] = round(time.perf_counter() - start, 2)
    res["median_step_s"] = round(statistics.median(step_s), 3)
    if collector is not None:
        res["reuse_drop"] = drop_summary(collector)
    return res


def plot(result: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    ax_loss, ax_acc = fig.subplots(1, 2)
    for level, r in result["levels"].items():
        epochs = range(1, len(r["train_loss"]) + 1)
        # dense on top, dashed: reuse 0 gives the same curve underneath
        style = {"color": "black", "linestyle": "--", "zorder": 3} if level == "dense" else {}
        ax_loss.plot(epochs, r["train_loss"], marker="o", label=label(level), **style)
        ax_acc.plot(epochs, r["val_accuracy"], marker="o", label=label(level), **style)
    s = result["settings"]
    ax_loss.set(xlabel="epoch", ylabel="mean training loss", title="training loss")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title=f"validation accuracy ({s['eval_samples']} tweets)")
    ax_acc.legend(fontsize=8)
    for ax in (ax_loss, ax_acc):
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(f"MiniLM on tweets, {s['train_samples']} training samples, batch {s['batch']}, lr {s['lr']:g}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train-samples", type=int, default=160)
    ap.add_argument("--eval-samples", type=int, default=160)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--levels", default=LEVELS, help="comma-separated: 'dense' and reuse levels in [0, 1], each "
                    "optionally with ':VARIANT' (benchmarks/resprop_variants.py; default the product's rule)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drop-steps", type=int, default=6, help="dense steps over which the reuse-drop statistic "
                    "is measured (0: none)")
    ap.add_argument("--output", default="runs/resprop_cpu.json")
    a = ap.parse_args(argv)
    levels = parse_levels(a.levels)
    cfg = DataConfig(dataset="tweets", max_length=a.max_length, padding="longest", batch_size=a.batch)
    train = load_text_data(cfg, "classification")
    val = load_text_data(cfg, "classification", split="test", label_names=train.label_names)
    train.examples, val.examples = train.examples[:a.train_samples], val.examples[:a.eval_samples]
    torch.manual_seed(a.seed)  # the new classifier head
    lm = load_model("minilm", "classification", label_names=train.label_names)
    collate = PadCollator(lm.tokenizer.pad_token_id, "classification", "longest", a.max_length,
                          padding_side(lm, cfg))
    items, val_items = tokenize(lm, train, a.max_length), tokenize(lm, val, a.max_length)
    eval_batches = [collate(val_items[s:s + a.batch]) for s in range(0, len(val_items), a.batch)]
    result = {"experiment": "resprop_cpu", "command": " ".join(["python benchmarks/resprop_cpu.py"] + sys.argv[1:]),
              "environment": environment(),
              "settings": {"model": "minilm", "dataset": "tweets", "train_samples": len(items),
                           "eval_samples": len(val_items), "epochs": a.epochs, "batch": a.batch,
                           "max_length": a.max_length, "padding": "longest", "optimizer": "AdamW", "lr": a.lr,
                           "seed": a.seed, "targets": "default (attention and MLP projections)"},
              "levels": {}}
    print(f"{len(items)} training and {len(val_items)} validation tweets, {a.epochs} epochs, levels {levels}",
          flush=True)
    for level in levels:
        result["levels"][level] = run_level(level, lm.model, items, collate, eval_batches, a)
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(f"\n{'level':>10} {'final loss':>10} {'val acc':>8} {'wall s':>7} {'step s':>7}")
    for level, r in result["levels"].items():
        print(f"{level:>10} {r['train_loss'][-1]:10.4f} {r['val_accuracy'][-1]:8.4f} {r['wall_s']:7.0f} "
              f"{r['median_step_s']:7.2f}")
    drop = result["levels"].get("dense", {}).get("reuse_drop")
    if drop:
        print("\nrelative norm of dL/dY dropped (reuse / same rows of dY alone), mean over layers and steps:")
        for kind, d in drop.items():
            cells = "  ".join(f"{r}: {d['dropped'][r]:.2f}/{d['topk_dropped'][r]:.2f}" for r in d["dropped"])
            print(f"  {kind:<28} residual {d['residual']:.2f}  {cells}")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
