"""Hugging Face Trainer steps with and without SEBP, eager and ``torch_compile`` (CUDA GPU).

BERT-base for sequence classification from its config (random weights), ``bf16=True`` (autocast), batch 32
padded to 128 tokens (``--seq``) with SST-2-like lengths (the bench's length sampler), AdamW. Four runs on the
same data: dense and SEBP (linears, norms and activations patched, exact mode), each eager and compiled with
``torch_compile_mode="reduce-overhead"``. The time per optimizer step is the median over the steps after the
first ``--skip`` (compilation and CUDA-graph recording), measured with a TrainerCallback that synchronises
the GPU at each step's end.

    python scripts/trainer_speed.py out.json [--steps 40 --skip 10 --seq 128]
"""
import argparse
import datetime
import json
import statistics
import tempfile
import time

import torch
import torch._dynamo as dynamo
import transformers
import triton
from transformers import Trainer, TrainerCallback, TrainingArguments

from sebp_kernels import SEBPConfig
from sebp_probe.bench import MODEL_CASES, _build_model, sample_lengths
from sebp_probe.patch import patch_activations, patch_model, patch_norms


class Batches(torch.utils.data.Dataset):
    def __init__(self, n, seq, vocab):
        lengths = sample_lengths("sst2", n, seq, seed=0)
        g = torch.Generator().manual_seed(0)
        self.rows = []
        for length in lengths:
            ids = torch.randint(5, vocab, (seq,), generator=g)
            mask = (torch.arange(seq) < length).long()
            self.rows.append({"input_ids": ids * mask, "attention_mask": mask,
                              "labels": torch.randint(0, 2, (), generator=g)})
        self.density = sum(lengths) / (n * seq)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times, self._t = [], None

    def on_step_begin(self, args, state, control, **kw):
        torch.cuda.synchronize()
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        torch.cuda.synchronize()
        self.times.append((time.perf_counter() - self._t) * 1e3)


def run(data, sebp, compiled, steps, skip, batch):
    model = _build_model(MODEL_CASES["bert-base"], torch.float32)
    if sebp:
        patch_model(model, SEBPConfig("exact"))
        patch_norms(model)
        patch_activations(model)
    kw = dict(torch_compile=True, torch_compile_mode="reduce-overhead") if compiled else {}
    timer = StepTimer()
    dynamo.reset()
    dynamo.utils.counters.clear()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch, max_steps=steps, bf16=True,
                                 learning_rate=2e-5, report_to=[], logging_steps=steps, save_strategy="no",
                                 seed=0, dataloader_drop_last=True, disable_tqdm=True, **kw)
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[timer])
        torch.cuda.reset_peak_memory_stats()
        trainer.train()
    losses = [h["train_loss"] for h in trainer.state.log_history if "train_loss" in h]
    return {"step_ms_median": round(statistics.median(timer.times[skip:]), 2),
            "first_steps_s": round(sum(timer.times[:skip]) / 1e3, 1),
            "graph_breaks": sum(dynamo.utils.counters["graph_break"].values()) if compiled else None,
            "train_loss": round(losses[-1], 5) if losses else None,
            "peak_gib": None if compiled else round(torch.cuda.max_memory_allocated() / 2**30, 3)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=10)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--runs", default="", help="comma-separated run names (default: all four)")
    args = ap.parse_args()
    data = Batches(args.steps * args.batch, args.seq, MODEL_CASES["bert-base"].config["vocab_size"])
    runs = {}
    for name, sebp, compiled in (("dense_eager", False, False), ("dense_compiled_ro", False, True),
                                 ("sebp_eager", True, False), ("sebp_compiled_ro", True, True)):
        if args.runs and name not in args.runs.split(","):
            continue
        try:
            runs[name] = run(data, sebp, compiled, args.steps, args.skip, args.batch)
        except Exception as err:  # noqa: BLE001 (what a user would see is the result)
            runs[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
        print(name, runs[name], flush=True)
    base = runs.get("dense_eager", {}).get("step_ms_median")
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "transformers": transformers.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": f"python scripts/trainer_speed.py {args.out} --steps {args.steps} --skip {args.skip} "
                      f"--seq {args.seq} --batch {args.batch}",
           "case": f"bert-base, Trainer bf16=True, batch {args.batch} x {args.seq}, SST-2-like lengths",
           "token_density": round(data.density, 4), "runs": runs,
           "step_speedup_vs_dense_eager": {k: round(base / v["step_ms_median"], 3) for k, v in runs.items()
                                           if base and "step_ms_median" in v}}
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=1))
    json.dump(out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
