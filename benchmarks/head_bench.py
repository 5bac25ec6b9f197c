"""GPU time and peak memory of the language-model head's forward + backward, over the labelled rows only or all.

    python benchmarks/head_bench.py --out head.json            # an H100: Llama-3.2-1B, Qwen2.5-0.5B, BERT-base MLM
    python benchmarks/head_bench.py --out tiny.json --tiny     # small shapes, runs on a CPU (checks the script)

Models are built from configs with random weights (bf16 parameters; ``--autocast``: fp32 parameters under
autocast bf16), batches of 8 x 2048 random tokens whose first 75% (the prompt) carry label -100. Two scopes:
``head``: the head alone on fixed last hidden states (B, T, d) -> loss, gradients of hidden and weight;
``model``: the whole model's forward and backward (parameter gradients), the methods differing in the head
(and ``ours+last_layer`` also in the last layer). ``bert-base-mlm``: masked-LM training of a BERT-base shape, 32
sequences of 512 tokens with 15% of the positions chosen (the standard masking), model scope only, methods
``hf``, ``gather`` (the head's transform and decoder on the labelled rows, plain cross-entropy), ``ours`` and
``ours+last_layer``. Methods:

  hf               the full head: logits of every position, then the model's loss (logits cast to fp32)
  gather           hidden[labelled] @ W^T, then cross-entropy
  ours             sebp_kernels.linear_cross_entropy (model scope: sebp_probe.model.heads.head_loss)
  ours+last_layer  head_loss(last_layer_rows_only=True) (model scope only)
  ours+last_layer+sebp  the same on a copy of the model (same weights) whose linears, norms and MLP
                   activations run the SEBP backward (exact; model scope, ``--sebp``): their fused Triton
                   kernels, and in the last layers the rows no loss reaches skipped
  ours@N, ours+last_layer@N   the same with N rows a chunk (``--extra-chunks N ...``)
  cce              cut_cross_entropy.linear_cross_entropy on all rows (if importable)
  liger            Liger-Kernel's fused linear cross-entropy on all rows (if importable)

Medians of CUDA-event times after warm-up, the methods taking turns within every repeat; the peak is
torch.cuda.max_memory_allocated above what was allocated before the step, in GiB. ``loss`` lets the methods be
checked against each other. A method that fails (out of memory, missing package) is recorded with its reason.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: the repository's packages

from sebp_kernels import linear_cross_entropy  # noqa: E402
from sebp_probe.model.heads import head_loss  # noqa: E402

SHAPES = {
    "llama-3.2-1b": dict(arch="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=8192, vocab_size=128256),
    "qwen2.5-0.5b": dict(arch="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936),
}
MLM_SHAPES = {
    "bert-base-mlm": dict(arch="bert-mlm", hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                          intermediate_size=3072, vocab_size=30522, batch=32, seq=512),
}
TINY = {
    "tiny-llama": dict(arch="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=128, vocab_size=1000),
    "tiny-qwen2": dict(arch="qwen2", hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=96, vocab_size=1500),
    "tiny-bert-mlm": dict(arch="bert-mlm", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, vocab_size=500, batch=4, seq=64),
}


def build_model(shape: dict, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, BertConfig, LlamaConfig, Qwen2Config

    kw = {k: v for k, v in shape.items() if k not in ("arch", "batch", "seq")}
    if shape["arch"] == "bert-mlm":
        cfg = BertConfig(**kw, max_position_embeddings=512, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
        with torch.device(device):
            return AutoModelForMaskedLM.from_config(cfg, dtype=dtype).train()
    cls = LlamaConfig if shape["arch"] == "llama" else Qwen2Config
    cfg = cls(**kw, tie_word_embeddings=True, max_position_embeddings=4096, attn_implementation="sdpa",
              use_cache=False)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.train()


def make_batch(vocab: int, batch: int, seq: int, prompt: float, device: torch.device, seed: int = 0,
               mlm: bool = False) -> dict:
    """Random tokens; causal LM: the first ``prompt`` share of each sequence labelled -100; masked LM: 15% of
    the positions chosen (80% [MASK]-like token 103, 10% random, 10% kept), the rest -100."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(104 if mlm else 0, vocab, (batch, seq), generator=g)  # MLM: no special token ids
    labels = ids.clone()
    if mlm:
        from sebp_probe.data.mlm import mask_tokens

        ids, labels = mask_tokens(ids, mask_token_id=103, vocab_size=vocab, special_ids=(0, 101, 102, 103),
                                  generator=g)
    else:
        labels[:, : int(prompt * seq)] = -100
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


def optional_methods() -> dict:
    """name -> fn(hidden (N, d), weight, shifted labels (N,)) -> loss, or name -> reason it is missing."""
    found: dict = {}
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        found["cce"] = lambda h, w, y: cce(h, w, y, ignore_index=-100)
    except Exception as e:  # noqa: BLE001 - any import failure (no package, no triton, no GPU) is a reason
        found["cce"] = f"unavailable: {type(e).__name__}: {e}"
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as liger

        found["liger"] = lambda h, w, y: liger(h, w, y, ignore_index=-100)
    except Exception:  # noqa: BLE001
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            loss_fn = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
            found["liger"] = lambda h, w, y: loss_fn(w, h, y)
        except Exception as e:  # noqa: BLE001
            found["liger"] = f"unavailable: {type(e).__name__}: {e}"
    return found


def shifted(labels: torch.Tensor) -> torch.Tensor:
    return F.pad(labels[:, 1:], (0, 1), value=-100)


def head_methods(chunk_rows: int | None, extra: dict) -> dict:
    """Head scope: fn(hidden (B, T, d), weight, labels (B, T)) -> loss."""
    def hf(h, w, labels):
        logits = F.linear(h, w).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), shifted(labels).view(-1))

    def gather(h, w, labels):
        y = shifted(labels).view(-1)
        rows = (y != -100).nonzero().squeeze(1)
        logits = F.linear(h.reshape(-1, h.shape[-1]).index_select(0, rows), w).float()
        return F.cross_entropy(logits, y.index_select(0, rows))

    methods = {"hf": hf, "gather": gather,
               "ours": lambda h, w, labels: linear_cross_entropy(h, w, shifted(labels), chunk_rows=chunk_rows)}
    for name, fn in extra.items():
        methods[name] = fn if isinstance(fn, str) else (
            lambda h, w, labels, fn=fn: fn(h.reshape(-1, h.shape[-1]), w, shifted(labels).view(-1)))
    return methods


def model_methods(chunk_rows: int | None, extra: dict) -> dict:
    """Model scope: fn(model, batch) -> loss."""
    def backbone_then(fn):
        def run(model, batch):
            h = model.model(input_ids=batch["input_ids"], use_cache=False)[0]
            return fn(h, model.lm_head.weight, batch["labels"])
        return run

    head = head_methods(chunk_rows, extra)
    methods = {"hf": lambda model, batch: model(**batch, use_cache=False).loss,
               "gather": backbone_then(head["gather"]),
               "ours": lambda model, batch: head_loss(model, batch, chunk_rows=chunk_rows).loss,
               "ours+last_layer": lambda model, batch: head_loss(model, batch, chunk_rows=chunk_rows,
                                                                 last_layer_rows_only=True).loss}
    for name in extra:
        methods[name] = head[name] if isinstance(head[name], str) else backbone_then(head[name])
    return methods


class Timer:
    """Milliseconds of a call: CUDA events on a GPU, the wall clock on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1000

    def peak_gib(self, fn) -> float | None:
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)


def run_methods(steps: dict, timer: Timer, warmup: int, repeats: int) -> dict:
    """{name: {"ms", "peak_gib", "loss"} or {"error"}} of each ``name: step`` (a step returns the loss)."""
    results, live = {}, {}
    for name, step in steps.items():
        if isinstance(step, str):
            results[name] = {"error": step}
            continue
        try:
            loss = None
            for _ in range(warmup):
                loss = step()
            results[name] = {"loss": round(float(loss), 6), "peak_gib": timer.peak_gib(step), "times": []}
            live[name] = step
        except Exception as e:  # noqa: BLE001 - out of memory and API mismatches are results here
            results[name] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
            if timer.cuda:
                torch.cuda.empty_cache()
    for _ in range(repeats):  # taking turns: clock drift over the run falls on every method alike
        for name, step in live.items():
            results[name]["times"].append(timer(step))
    for name in live:
        results[name]["ms"] = round(statistics.median(results[name].pop("times")), 3)
    return results


def mlm_methods(chunk_rows: int | None) -> dict:
    """Masked-LM model scope: fn(model, batch) -> loss."""
    def gather(model, batch):
        h = model.bert(input_ids=batch["input_ids"])[0]
        y = batch["labels"].view(-1)
        rows = (y != -100).nonzero().squeeze(1)
        hr = model.cls.predictions.transform(h.reshape(-1, h.shape[-1]).index_select(0, rows))
        return F.cross_entropy(model.cls.predictions.decoder(hr).float(), y.index_select(0, rows))

    return {"hf": lambda model, batch: model(**batch).loss, "gather": gather,
            "ours": lambda model, batch: head_loss(model, batch, "mlm", chunk_rows=chunk_rows).loss,
            "ours+last_layer": lambda model, batch: head_loss(model, batch, "mlm", chunk_rows=chunk_rows,
                                                              last_layer_rows_only=True).loss}


def sebp_method(model, task: str, chunk_rows: int | None):
    """Model scope: ``ours+last_layer`` on a copy of ``model`` with the SEBP linears (exact), norms and MLP
    activations; the copy's gradients are dropped at the start of each step, as the model's are."""
    import copy

    from sebp_kernels import SEBPConfig
    from sebp_probe.model.patch import patch_sebp

    twin = copy.deepcopy(model)
    patch_sebp(twin, SEBPConfig("exact"), norms=True, acts=True)

    def run(_, batch):
        for p in twin.parameters():
            p.grad = None
        return head_loss(twin, batch, task, chunk_rows=chunk_rows, last_layer_rows_only=True).loss
    return run


def bench_shape(name: str, shape: dict, args, device: torch.device, timer: Timer, extra: dict) -> list[dict]:
    param_dtype = torch.float32 if args.autocast else torch.bfloat16
    model = build_model(shape, param_dtype, device)
    mlm = shape["arch"] == "bert-mlm"
    n_seq, seq = shape.get("batch", args.batch), shape.get("seq", args.seq)
    batch = make_batch(shape["vocab_size"], n_seq, seq, args.prompt, device, mlm=mlm)
    labelled = int(((batch["labels"] if mlm else shifted(batch["labels"])) != -100).sum())
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.autocast)
    rows = []

    g = torch.Generator().manual_seed(1)
    hidden = (torch.randn(n_seq, seq, shape["hidden_size"], generator=g) / 2).to(device, param_dtype)
    hidden.requires_grad_()
    weight = model.get_output_embeddings().weight

    def head_step(fn):
        def step():
            with autocast:
                loss = fn(hidden, weight, batch["labels"])
            torch.autograd.grad(loss, [hidden, weight])
            return loss.detach()
        return step

    def model_step(fn):
        def step():
            for p in model.parameters():
                p.grad = None
            with autocast:
                loss = fn(model, batch)
            loss.backward()
            return loss.detach()
        return step

    scopes = [("model", mlm_methods(args.chunk_rows), model_step)] if mlm else [
        ("head", head_methods(args.chunk_rows, extra), head_step),
        ("model", model_methods(args.chunk_rows, extra), model_step)]
    if args.sebp:
        for scope, methods, _ in scopes:
            if scope == "model":
                methods["ours+last_layer+sebp"] = sebp_method(model, "mlm" if mlm else "causal-lm", args.chunk_rows)
    for n in args.extra_chunks:  # the same methods at other chunk sizes
        for scope, methods, _ in scopes:
            more = head_methods(n, {}) if scope == "head" else mlm_methods(n) if mlm else model_methods(n, {})
            methods.update({f"{m}@{n}": fn for m, fn in more.items() if m.startswith("ours")})
    for scope, methods, wrap in scopes:
        steps = {m: fn if isinstance(fn, str) else wrap(fn) for m, fn in methods.items()}
        for method, r in run_methods(steps, timer, args.warmup, args.repeats).items():
            row = {"shape": name, "scope": scope, "method": method, **r}
            rows.append(row)
            print(json.dumps(row), flush=True)
    for row in rows:
        row.update(tokens=n_seq * seq, labelled_rows=labelled, vocab=shape["vocab_size"],
                   hidden=shape["hidden_size"])
    return rows


def environment(device: torch.device) -> dict:
    import transformers

    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda, "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name, *sys.argv])}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--tiny", action="store_true", help="small shapes and batches (a CPU check of the script)")
    p.add_argument("--shapes", nargs="*", help="which shapes (default: all of the set)")
    p.add_argument("--batch", type=int, default=None, help="sequences per batch (default 8; --tiny 2)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; --tiny 64)")
    p.add_argument("--prompt", type=float, default=0.75, help="share of each sequence labelled -100")
    p.add_argument("--chunk-rows", type=int, default=None, help="linear_cross_entropy's chunk (default: its own)")
    p.add_argument("--extra-chunks", type=int, nargs="*", default=[],
                   help="also time the ours methods with these chunk sizes (rows)")
    p.add_argument("--sebp", action="store_true", help="also ours+last_layer+sebp (model scope)")
    p.add_argument("--autocast", action="store_true", help="fp32 parameters under autocast bf16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=None, help="timed steps per method (default 20; --tiny 3)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    args.batch = args.batch or (2 if args.tiny else 8)
    args.seq = args.seq or (64 if args.tiny else 2048)
    args.repeats = args.repeats or (3 if args.tiny else 20)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    table = TINY if args.tiny else {**SHAPES, **MLM_SHAPES}
    names = args.shapes or list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        p.error(f"unknown shape {unknown[0]!r}; choose from {', '.join(table)}")
    extra = optional_methods() if device.type == "cuda" else {
        "cce": "skipped: needs a CUDA GPU", "liger": "skipped: needs a CUDA GPU"}
    torch.manual_seed(0)
    timer = Timer(device)
    rows = []
    for name in names:
        rows += bench_shape(name, table[name], args, device, timer, extra)
    out = {"environment": environment(device),
           "settings": {k: v for k, v in vars(args).items() if k != "out"},
           "shapes": {n: table[n] for n in names}, "results": rows}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
