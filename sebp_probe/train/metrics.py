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
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       **({"use_cache": False} if task == "causal-lm" else {})).logits.float()
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


# A comparison needs this many steps timed in both runs; fewer say nothing a user should act on.
MIN_TIMED_STEPS = 5


def _first_untimed(n: int) -> int:
    """How many of a run's first steps are warm-up (caches, allocator, clocks), whatever else happened in them."""
    return min(10, max(1, n // 10)) if n > 1 else 0


def timed_steps(records: list[dict], first_shapes: bool | None = None) -> dict[int, dict]:
    """Step -> train record of the steps that count in a run's times: not among its first steps, and not a step
    the loop marked ``untimed`` (a compile, a CUDA-graph capture, a batch shape the GPU had not run yet), except
    that with ``first_shapes`` a step whose only mark is its new shape counts (None: where the run's shapes
    never settle, :func:`shapes_never_settle`)."""
    if first_shapes is None:
        first_shapes = shapes_never_settle(records)
    counted = (None, "new shape") if first_shapes else (None,)
    return {r["step"]: r for r in _past_warmup(records) if r.get("untimed") in counted}


def _past_warmup(records: list[dict]) -> list[dict]:
    """A run's train records after its first steps (:func:`_first_untimed`)."""
    train = [r for r in records if r.get("type") == "train"]
    return train[_first_untimed(len(train)):]


def shapes_never_settle(records: list[dict]) -> bool:
    """Whether, past the warm-up steps, more steps met a batch shape for the first time than ran one met before,
    and the two together are enough to compare (:data:`MIN_TIMED_STEPS`): lengths so varied (``longest`` padding
    of SFT data) that a new shape's first step is what the run's steps are, not a warm-up. Such steps are then
    timed: what they cost beyond a repeated shape's step (a kernel's first launch at that size, the allocator's
    new blocks) recurs in every step of such a run. Compiles and CUDA-graph captures stay out."""
    rest = _past_warmup(records)
    settled = sum(not r.get("untimed") for r in rest)
    new = sum(r.get("untimed") == "new shape" for r in rest)
    return new > settled and new + settled >= MIN_TIMED_STEPS


def quartiles(vals: list[float]) -> tuple[float, float, float]:
    """(25th percentile, median, 75th percentile) of ``vals``."""
    if len(vals) == 1:
        return vals[0], vals[0], vals[0]
    q1, q2, q3 = statistics.quantiles(vals, n=4, method="inclusive")
    return q1, q2, q3


def medians_apart(a: list[float], b: list[float]):
    """Quartiles of ``a`` and of ``b`` (two sets of steps, not paired), ``a``'s median over ``b``'s (None where
    ``b``'s is 0), and whether that is noise: either interquartile range holds the other's median."""
    aq, bq = quartiles(a), quartiles(b)
    return aq, bq, aq[1] / bq[1] if bq[1] else None, aq[0] <= bq[1] <= aq[2] or bq[0] <= aq[1] <= bq[2]


def summarize_records(records: list[dict]) -> dict:
    """Median backward and step time over the timed steps (:func:`timed_steps`) with their interquartile range,
    what the untimed steps took apart (warm-up, and of it compiling), peak memory, final loss."""
    train = [r for r in records if r.get("type") == "train"]
    evals = [r for r in records if r.get("type") == "eval"]
    timed_by_step = timed_steps(records)
    timed = list(timed_by_step.values())
    out = {"steps": train[-1]["step"] if train else 0}
    if train:
        untimed = [r for r in train if r["step"] not in timed_by_step]
        out["timed_steps"] = len(timed)
        out["first_shape_steps_timed"] = sum(r.get("untimed") == "new shape" for r in timed)
        out["untimed_steps"] = len(untimed)
        out["untimed_s"] = sum(r["step_ms"] for r in untimed) / 1e3
        compiled = [r for r in train if r.get("untimed") == "compile"]
        if compiled:
            out["compile_steps"] = len(compiled)
            out["compile_s"] = sum(r["step_ms"] for r in compiled) / 1e3
    if timed:
        for key in ("backward_ms", "step_ms"):
            q1, med, q3 = quartiles([r[key] for r in timed])
            out[f"median_{key}"] = med
            out[f"iqr_{key}"] = [q1, q3]
    if train:
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


def same_computation(summary: dict) -> str | None:
    """Why a run computed exactly what dense does (None: it did not): an SEBP run whose calibration left every
    layer dense and patched no norm or activation."""
    calib = summary.get("calibration")
    if summary.get("method") != "sebp" or not calib:
        return None
    if calib.get("layers") or calib.get("norms") or calib.get("activations"):
        return None
    why = calib.get("fallback_reason") or "no layer's share of active rows was under the fallback density"
    return f"SEBP ran on 0 layers ({why})"


def compare_timing(dense_records: list[dict], other_records: list[dict], paired: bool = True) -> dict:
    """Step and backward time of two runs: each run's median and interquartile range and the ratio dense / other
    (> 1: the other is faster). ``paired`` (both runs drew the same batches in every step): over the steps timed
    in both (:func:`timed_steps`; a step left out of one run is left out of the other), the median of the steps'
    own ratios with their interquartile range (``ratio_iqr``), and ``within_noise`` where that range holds 1;
    else over each run's own timed steps, the ratio of the medians, and ``within_noise`` where either run's range
    holds the other's median. Where either run's shapes never settle (:func:`shapes_never_settle`), both count
    their first-shape steps (``first_shapes_timed``)."""
    first_shapes = shapes_never_settle(dense_records) or shapes_never_settle(other_records)
    d, o = timed_steps(dense_records, first_shapes), timed_steps(other_records, first_shapes)
    if paired:
        d_steps = o_steps = sorted(set(d) & set(o))
    else:
        d_steps, o_steps = sorted(d), sorted(o)
    out: dict = {"timed_steps": min(len(d_steps), len(o_steps)), "paired": paired,
                 "first_shapes_timed": first_shapes,
                 "new_shape_steps": len({r["step"] for r in (*dense_records, *other_records)
                                         if r.get("type") == "train" and r.get("untimed") == "new shape"})}
    if not out["timed_steps"]:
        return out
    for what in ("backward", "step"):
        key = f"{what}_ms"
        dq, oq, ratio, noise = medians_apart([d[s][key] for s in d_steps], [o[s][key] for s in o_steps])
        part = {"dense_ms": dq[1], "dense_iqr": [dq[0], dq[2]], "other_ms": oq[1], "other_iqr": [oq[0], oq[2]]}
        if paired and all(o[s][key] for s in d_steps):
            # the same batch in both runs: each step's own ratio, whose spread is the timing's, not the batches'
            # (a step on a long batch and one on a short differ far more than the two methods do)
            rq = quartiles([d[s][key] / o[s][key] for s in d_steps])
            part.update(ratio=rq[1], ratio_iqr=[rq[0], rq[2]], within_noise=rq[0] <= 1.0 <= rq[2])
        else:
            part.update(ratio=ratio, within_noise=noise)
        out[what] = part
    return out


def compare_runs(dense: dict, other: dict, dense_records: list[dict], other_records: list[dict],
                 paired: bool = True, same_setup: bool = True) -> dict:
    """Dense against the other run: ``verdict`` says what the times may be read as (``same computation``: the
    other run computed what dense did, so its ratio is the timing's noise and no speedup; ``too few steps``:
    under :data:`MIN_TIMED_STEPS` steps timed in both; ``within noise``; ``faster``; ``slower``), with the
    step and backward ratios of :func:`compare_timing` (``paired``: see there; ``same_setup``: the runs differ
    in their method alone, the layout, head and compile setting the same: without it no run computed what the
    other did; ``speedup_step`` and
    ``speedup_backward`` only where the verdict is faster or slower), peak-memory ratios and held-out deltas."""
    out: dict = {}
    timing = compare_timing(dense_records, other_records, paired)
    out["timing"] = timing
    same = same_computation(other) if same_setup and paired else None
    if same:
        out["verdict"], out["same_computation"] = "same computation", same
    elif timing["timed_steps"] < MIN_TIMED_STEPS:
        out["verdict"] = "too few steps"
    elif timing["step"]["within_noise"]:
        out["verdict"] = "within noise"
    else:
        out["verdict"] = "faster" if timing["step"]["ratio"] > 1 else "slower"
        out["speedup_step"] = timing["step"]["ratio"]
        out["speedup_backward"] = timing["backward"]["ratio"]
    for key, name in (("peak_mem_mb", "peak_mem_ratio"), ("peak_mem_mb_from_step3", "peak_mem_ratio_from_step3")):
        if dense.get(key) and other.get(key):
            out[name] = other[key] / dense[key]
    de, se = dense.get("final_eval", {}), other.get("final_eval", {})
    for k in de:
        if k in se:
            out[f"delta_{k}"] = se[k] - de[k]
    return out


def loss_gap(dense_records: list[dict], sebp_records: list[dict]) -> float | None:
    d = {r["step"]: r["loss"] for r in dense_records if r.get("type") == "train"}
    s = {r["step"]: r["loss"] for r in sebp_records if r.get("type") == "train"}
    common = sorted(set(d) & set(s))
    return max(abs(d[k] - s[k]) for k in common) if common else None
