"""GPU benchmark of whole models. No CLI code here.

Whole model: forward + backward of a real architecture built from its config with random weights, on a
padded batch (dense vs SEBP on every projection) and on the same batch with the padding trimmed. With
``breakdown``, one backward of each run is also profiled and its GPU kernel time split by kind (GEMMs,
attention, SEBP kernels, elementwise, ...), which shows how much of the backward SEBP on linear layers can
reach at all. Decoders with right padding can leave the padding mask out (``pad_mask=False``): their real
tokens never attend to the pads after them, so loss and gradients are the same, and attention takes the
causal kernel instead of the masked one. With ``norms``, the SEBP run also puts the SEBP backward on the
LayerNorms/RMSNorms (their dL/dY has the same zero rows).
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from .bench import _require_cuda


@dataclass(frozen=True)
class ModelCase:
    """A whole-model benchmark: an architecture, a fixed padded length and how long the real samples are."""

    name: str
    arch: str  # "bert" (sequence classification) or "llama" (causal LM)
    batch: int
    seq: int
    lengths: str  # "sst2" or "short" (64-512 real tokens)
    config: dict = field(default_factory=dict)


MODEL_CASES: dict[str, ModelCase] = {
    "bert-base": ModelCase("bert-base", "bert", 32, 512, "sst2", dict(
        vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
        intermediate_size=3072, max_position_embeddings=512, num_labels=2)),
    "llama-3.2-3b": ModelCase("llama-3.2-3b", "llama", 1, 4096, "short", dict(
        vocab_size=128256, hidden_size=3072, num_hidden_layers=28, num_attention_heads=24,
        num_key_value_heads=8, intermediate_size=8192, max_position_embeddings=8192, rope_theta=500000.0,
        tie_word_embeddings=True, pad_token_id=0)),
    "qwen2.5-1.5b": ModelCase("qwen2.5-1.5b", "qwen2", 1, 4096, "short", dict(
        vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, intermediate_size=8960, max_position_embeddings=8192, tie_word_embeddings=True,
        pad_token_id=0)),
}


# Decoders: every projection and the LM head (its rows at label -100 carry no gradient).
DECODER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def sample_lengths(kind: str, n: int, seq: int, seed: int) -> list[int]:
    """Real-token counts per sample. ``sst2``: SST-2-like sentences (log-normal, median ~26 word pieces
    plus [CLS]/[SEP], 5..66), ``short``: uniform in 64..512. Both clipped to ``seq``."""
    g = torch.Generator().manual_seed(seed)
    if kind == "sst2":
        raw = torch.exp(math.log(26.0) + 0.55 * torch.randn(n, generator=g)).round() + 2
        vals = raw.clamp(5, 66)
    elif kind == "short":
        vals = torch.randint(64, 513, (n,), generator=g)
    else:
        raise ValueError(f"unknown length distribution {kind!r}")
    return [int(min(v, seq)) for v in vals.tolist()]


def _build_model(case: ModelCase, dtype: torch.dtype):
    import transformers  # lazy: only the whole-model benchmark needs it

    torch.manual_seed(0)
    with torch.device("cuda"):
        if case.arch == "bert":
            model = transformers.BertForSequenceClassification(transformers.BertConfig(**case.config))
        else:
            cfg = transformers.AutoConfig.for_model(case.arch, **case.config)
            model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model.to(dtype).train()


def _batch(case: ModelCase, lengths: list[int], seq: int, vocab: int, seed: int, pad_mask: bool = True) -> dict:
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    ids = torch.randint(5, vocab, (b, seq), generator=g)
    pos = torch.arange(seq).unsqueeze(0)
    mask = (pos < torch.tensor(lengths).unsqueeze(1)).long()
    ids = ids * mask  # pad id 0 on the right
    batch = {"input_ids": ids.cuda(), "attention_mask": mask.cuda()}
    if case.arch == "bert":
        batch["labels"] = torch.randint(0, 2, (b,), generator=g).cuda()
    else:
        batch["labels"] = ids.masked_fill(mask == 0, -100).cuda()
    if not pad_mask:  # right padding, causal attention: the pads come after every real token's context
        del batch["attention_mask"]
    return batch


def check_pad_mask(case: ModelCase, pad_mask: bool) -> None:
    """Leaving the padding mask out is exact only for causal decoders (right padding); say so otherwise."""
    if not pad_mask and case.arch == "bert":
        raise ValueError(f"{case.name} attends in both directions: its real tokens would attend to the pads "
                         "without the padding mask; leaving it out is for causal decoders only")


# Kernel kinds of the backward breakdown, by substrings of the kernel's name (first match wins).
_KERNEL_KINDS = (
    ("sebp act", ("_act_fwd_kernel", "_act_bwd_kernel")),
    ("sebp", ("_grads_kernel", "_row_flags_kernel", "_compact_kernel", "_dx_kernel", "_dw_kernel", "_db_kernel")),
    ("attention", ("fmha", "flash", "sdpa", "attention", "attn")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "matmul", "splitk")),
    ("reduction", ("reduce_kernel",)),
    ("norm", ("norm", "gammabeta")),
    ("embedding", ("embedding", "indexing_backward", "radix_sort", "segment")),
)


def kernel_kind(name: str) -> str:
    """The kind of a CUDA kernel of the backward, from its name (``elementwise/other`` when none fits)."""
    low = name.lower()
    for kind, needles in _KERNEL_KINDS:
        if any(n in low for n in needles):
            return kind
    return "elementwise/other"


def backward_breakdown(model, batch: dict, top: int = 0) -> dict:
    """GPU kernel milliseconds of one ``loss.backward()`` (torch.profiler), in total and by kernel kind; with
    ``top``, also the ``top`` kernels that took longest (name, calls, ms)."""
    from torch.profiler import ProfilerActivity, profile

    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        loss.backward()
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    rows = sorted(((e.key, e.count, e.device_time_total / 1e3) for e in prof.key_averages()
                   if e.device_time_total > 0), key=lambda r: -r[2])
    kinds: dict[str, float] = {}
    for name, _, ms in rows:
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + ms
    out = {"total_ms": round(sum(kinds.values()), 3),
           "by_kind_ms": {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}}
    if top:
        out["top"] = [{"kernel": n[:100], "calls": c, "ms": round(ms, 3)} for n, c, ms in rows[:top]]
    return out


def _time_step(model, batch: dict, repeats: int) -> dict:
    """Median forward, backward and step milliseconds, and the step's peak memory (GiB)."""
    fwd, bwd = [], []
    for i in range(repeats + 2):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i == 2:
            torch.cuda.reset_peak_memory_stats()
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        e0.record()
        loss = model(**batch).loss
        e1.record()
        loss.backward()
        e2.record()
        e2.synchronize()
        if i >= 2:
            fwd.append(e0.elapsed_time(e1))
            bwd.append(e1.elapsed_time(e2))
    model.zero_grad(set_to_none=True)
    f, b = statistics.median(fwd), statistics.median(bwd)
    return {"forward_ms": round(f, 3), "backward_ms": round(b, 3), "step_ms": round(f + b, 3),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3)}


def _time_step_graphed(model, batch: dict, repeats: int) -> dict:
    """Median forward and backward milliseconds as CUDA-graph replays (no host launch overhead)."""
    from .graphs import replay_ms

    try:
        f, b = replay_ms(model, batch, repeats, skip=2)
        return {"forward_ms": round(f, 3), "backward_ms": round(b, 3), "step_ms": round(f + b, 3)}
    finally:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def bench_model(case: ModelCase, dtype: torch.dtype = torch.bfloat16, repeats: int = 5, batches: int = 3,
                mode: str = "exact", graphs: bool = False, progress: Callable[[str], None] | None = None,
                pad_mask: bool = True, breakdown: bool = False, norms: bool = False,
                acts: bool = False, keep_dx: bool = False) -> dict:
    """Whole-model forward+backward: dense vs SEBP on the padded batch, and dense on the trimmed batch.

    ``batches`` different padded batches (fresh lengths each); times are the median over them. With
    ``graphs``, each step is also captured as CUDA graphs and replayed, which removes host launch overhead
    (the eager numbers of a small model are bound by the host's Python, not by the GPU). ``pad_mask=False``:
    decoders only, the padding mask left out (see the module docstring). ``breakdown``: the first batch's
    backward kernel time by kind, for each run. ``norms``: the SEBP run also swaps the LayerNorms/RMSNorms
    for :class:`~sebp_kernels.SEBPNorm` (exact; the zero rows of their dL/dY skipped too). ``acts``: it also
    runs the MLP activations as SEBP activations (:func:`~sebp_probe.patch.patch_activations`). ``keep_dx``:
    the SEBP run takes its linears' dX from :mod:`sebp_kernels.zero_rows` (zero rows kept between backwards;
    CUDA graphs take the buffers of the eager warm-up steps), whose buffers count in its peak memory; the pool
    is emptied after each SEBP run.
    """
    from sebp_kernels import zero_rows
    from sebp_kernels import SEBPConfig

    from .patch import find_targets, patch_activations, patch_model, patch_norms, unpatch_model

    check_pad_mask(case, pad_mask)
    _require_cuda()
    model = _build_model(case, dtype)
    vocab = model.config.vocab_size
    targets = DECODER_TARGETS if case.arch != "bert" else None  # None: the attention + MLP projections
    runs: dict[str, list[dict]] = {"dense_padded": [], "sebp_padded": [], "dense_trimmed": []}
    graphed: dict[str, list[dict]] = {k: [] for k in runs}
    kernels: dict[str, dict] = {}

    def measure(key: str, batch: dict) -> None:
        runs[key].append(_time_step(model, batch, repeats))
        if graphs:
            graphed[key].append(_time_step_graphed(model, batch, repeats))
        if breakdown and key not in kernels:
            kernels[key] = backward_breakdown(model, batch)

    all_lengths = []
    for bi in range(batches):
        lengths = sample_lengths(case.lengths, case.batch, case.seq, seed=bi)
        all_lengths.append(lengths)
        padded = _batch(case, lengths, case.seq, vocab, seed=bi, pad_mask=pad_mask)
        trimmed = {k: (v[:, : max(lengths)] if v.dim() == 2 else v) for k, v in padded.items()}
        if progress:
            progress(f"{case.name} batch {bi + 1}/{batches}: dense, padded")
        measure("dense_padded", padded)
        patch_model(model, SEBPConfig(mode), target_modules=targets)
        n_norms = len(patch_norms(model)) if norms else 0
        n_acts = len(patch_activations(model)) if acts else 0
        if progress:
            progress(f"{case.name} batch {bi + 1}/{batches}: SEBP, padded")
        zero_rows.enable(keep_dx)
        try:
            measure("sebp_padded", padded)
        finally:  # the graphs of the run are gone: their buffers too, before the next run's peak memory
            zero_rows.enable(False)
            zero_rows.forget_captured()
        unpatch_model(model)
        if progress:
            progress(f"{case.name} batch {bi + 1}/{batches}: dense, padding trimmed")
        measure("dense_trimmed", trimmed)
    n_linear = len(find_targets(model, targets))
    def med(table):
        return {name: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]} for name, rs in table.items()}

    summary = med(runs)
    tokens = sum(sum(ls) for ls in all_lengths)
    dense, sebp = summary["dense_padded"], summary["sebp_padded"]
    del model
    torch.cuda.empty_cache()
    result = {
        "case": asdict(case), "dtype": str(dtype).replace("torch.", ""), "mode": mode, "pad_mask": pad_mask,
        "sebp_layers": n_linear, "sebp_norms": n_norms, "sebp_acts": n_acts, "sebp_keep_dx": keep_dx,
        "lengths": all_lengths, "token_density": round(tokens / (batches * case.batch * case.seq), 4),
        "median": summary, "per_batch": runs,
        "backward_speedup": round(dense["backward_ms"] / sebp["backward_ms"], 3),
        "step_speedup": round(dense["step_ms"] / sebp["step_ms"], 3),
        "peak_memory_ratio": round(sebp["peak_gib"] / dense["peak_gib"], 4),
        "trimmed_step_speedup": round(dense["step_ms"] / summary["dense_trimmed"]["step_ms"], 3),
    }
    if breakdown:
        result["backward_kernels"] = kernels
    if graphs:
        gs = med(graphed)
        gd, gsebp, gtrim = gs["dense_padded"], gs["sebp_padded"], gs["dense_trimmed"]
        result.update({
            "graphed_median": gs, "graphed_per_batch": graphed,
            "graphed_backward_speedup": round(gd["backward_ms"] / gsebp["backward_ms"], 3),
            "graphed_step_speedup": round(gd["step_ms"] / gsebp["step_ms"], 3),
            "graphed_trimmed_step_speedup": round(gd["step_ms"] / gtrim["step_ms"], 3),
        })
    return result
