"""What a run measures: held-out loss and accuracy or perplexity, step statistics, dense-vs-SEBP ratios."""
from __future__ import annotations

import math
import resource
import statistics

import torch


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


@torch.no_grad()
def evaluate(model, loader, accelerator, task: str) -> dict:
    """Held-out loss, and accuracy (classification) or perplexity (causal and masked LM: over the labelled
    tokens), over every example once."""
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    count = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    correct = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    for batch in loader:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        labels = batch["labels"]
        if task == "classification":
            per = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
            hits = (logits.argmax(-1) == labels).double()
            per, hits = accelerator.gather_for_metrics((per, hits))
            loss_sum += per.double().sum()
            count += per.numel()
            correct += hits.sum()
        else:
            lg, lb = (logits[:, :-1], labels[:, 1:]) if task == "causal-lm" else (logits, labels)
            tok = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), lb.reshape(-1),
                                                    ignore_index=-100, reduction="none").view(lb.shape)
            per, n = tok.double().sum(1), (lb != -100).double().sum(1)
            per, n = accelerator.gather_for_metrics((per, n))
            loss_sum += per.sum()
            count += n.sum()
    model.train(was_training)
    loss = (loss_sum / count.clamp(min=1)).item()
    out = {"eval_loss": loss}
    if task == "classification":
        out["eval_accuracy"] = (correct / count.clamp(min=1)).item()
    else:
        out["eval_perplexity"] = math.exp(min(loss, 700.0))
    return out


def _skip_warmup(n: int) -> int:
    return min(10, n // 10) if n > 1 else 0


def summarize_records(records: list[dict]) -> dict:
    """Mean/median backward and step time (first steps skipped as warm-up), peak memory, final loss."""
    train = [r for r in records if r.get("type") == "train"]
    evals = [r for r in records if r.get("type") == "eval"]
    timed = train[_skip_warmup(len(train)):]
    out = {"steps": train[-1]["step"] if train else 0}
    if timed:
        for key in ("backward_ms", "step_ms"):
            vals = [r[key] for r in timed]
            out[f"mean_{key}"] = statistics.fmean(vals)
            out[f"median_{key}"] = statistics.median(vals)
        out["peak_mem_mb"] = max(r["peak_mem_mb"] for r in train)
        # Under DDP the second step's peak may or may not still hold the first step's gradient buckets
        # (one copy of the parameters), for dense and SEBP alike: the peak from step 3 on, beside the whole
        # run's (CUDA only: the CPU's max RSS cannot be reset per step).
        later = [r["step_peak_mem_mb"] for r in train if r["step"] > 2 and "step_peak_mem_mb" in r]
        if later:
            out["peak_mem_mb_from_step3"] = max(later)
        last = train[-10:]
        out["final_train_loss"] = statistics.fmean(r["loss"] for r in last)
    if evals:
        out["final_eval"] = {k: v for k, v in evals[-1].items() if k.startswith("eval_")}
    return out


def compare_runs(dense: dict, sebp: dict) -> dict:
    out = {}
    for what in ("backward", "step"):
        for stat, suffix in (("mean", ""), ("median", "_median")):
            d, s = dense.get(f"{stat}_{what}_ms"), sebp.get(f"{stat}_{what}_ms")
            if d and s:
                out[f"speedup_{what}{suffix}"] = d / s
    for key, name in (("peak_mem_mb", "peak_mem_ratio"), ("peak_mem_mb_from_step3", "peak_mem_ratio_from_step3")):
        if dense.get(key) and sebp.get(key):
            out[name] = sebp[key] / dense[key]
    de, se = dense.get("final_eval", {}), sebp.get("final_eval", {})
    for k in de:
        if k in se:
            out[f"delta_{k}"] = se[k] - de[k]
    return out


def loss_gap(dense_records: list[dict], sebp_records: list[dict]) -> float | None:
    d = {r["step"]: r["loss"] for r in dense_records if r.get("type") == "train"}
    s = {r["step"]: r["loss"] for r in sebp_records if r.get("type") == "train"}
    common = sorted(set(d) & set(s))
    return max(abs(d[k] - s[k]) for k in common) if common else None
