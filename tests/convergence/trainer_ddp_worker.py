"""Worker of test_hf_trainer_ddp.py, run under torchrun (2 CPU processes, gloo; accelerate's DDP): for each kind
named after the output folder (``trainer``: transformers' Trainer with a tiny BERT classifier; ``sft``: TRL's
SFTTrainer with a tiny Llama on prompt/completion data), the same training twice from the same start, plain and
after ``apply_sebp(trainer)``; writes ``<argv[1]>/rank<r>.json`` (a file per process: two processes' lines on
one stdout can interleave) with both runs' logged losses and gradient norms, the head, the layers that run
SEBP and this process's own calibrated densities.

The main process calibrates with ``dense_fallback=0.9``, the other with ``dense_fallback=0.0`` (on its own it
would keep every layer dense): a stand-in for the per-process timings that make processes choose differently,
so that the test sees the other process take the main one's layers.

Kind ``grad_stats``: the Trainer once with ``add_grad_stats``; the process's own counts of each probed step, its
records and what it logged (the test checks that they are the sum of both processes' counts)."""
import json
import os
import sys
from pathlib import Path

import torch

from sebp_kernels import SEBPLinear
from sebp_probe.integrations.hf import apply_sebp
from tests.helpers import exit_after_teardown
from tests.convergence.test_hf_trainer import _args, _completions, _Rows
from tests.tiny_models import tiny_model, word_tokenizer


def make_trainer(kind: str, out: Path):
    if kind == "trainer":
        from transformers import Trainer

        return Trainer(model=tiny_model("bert"), args=_args(out), train_dataset=_Rows("bert"))
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    return SFTTrainer(model=tiny_model("llama"), args=_args(out, SFTConfig, max_length=None),
                      train_dataset=Dataset.from_list(_completions()), processing_class=word_tokenizer())


def train(kind: str, sebp: bool, rank: int, out: Path) -> dict:
    trainer = make_trainer(kind, out)
    result = {}
    if sebp:
        handle = apply_sebp(trainer, dense_fallback=0.9 if rank == 0 else 0.0, fallback_if_slower=False)
        model = trainer.model
        result.update(head=handle.head, reason=handle.reason, layers=sorted(handle.layers),
                      density=handle.calibration.density,
                      swapped=all(isinstance(model.get_submodule(n), SEBPLinear) for n in handle.layers))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    result.update(loss=[h["loss"] for h in logs], grad_norm=[h["grad_norm"] for h in logs],
                  processes=trainer.accelerator.num_processes)
    return result


def grad_stats(out: Path) -> dict:
    """The Trainer with ``add_grad_stats(every=2)``: this process's own counts of each probed step (before the
    all-reduce, read by a spy on it), the records it made, and what its trainer logged of them."""
    from sebp_probe.integrations import grad_stats as stats_module
    from sebp_probe.integrations.hf import add_grad_stats

    own, reduce = [], stats_module._all_reduce

    def spy(counts, device):
        own.append(counts.pack().tolist())
        return reduce(counts, device)

    stats_module._all_reduce = spy
    try:
        trainer = make_trainer("trainer", out)
        callback = add_grad_stats(trainer, every=2)
        trainer.train()
    finally:
        stats_module._all_reduce = reduce
    logged = [{k: v for k, v in h.items() if k.startswith("grad_stats/") or k == "step"}
              for h in trainer.state.log_history if any(k.startswith("grad_stats/") for k in h)]
    names = list(callback.records[0]["layers"]) if callback.records else []  # the order of the packed counts
    return {"own": own, "names": names, "records": callback.records, "logged": logged,
            "processes": trainer.accelerator.num_processes}


def main() -> None:
    out, kinds = Path(sys.argv[1]), sys.argv[2:]
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    result = {"rank": rank}
    for kind in kinds:
        if kind == "grad_stats":
            result[kind] = grad_stats(out / kind)
            continue
        result[kind] = {"plain": train(kind, False, rank, out / kind), "sebp": train(kind, True, rank, out / kind)}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    # the trainers leave accelerate's process group up: torn down by the interpreter's exit instead, gloo's
    # threads now and then aborted a rank there
    exit_after_teardown()


if __name__ == "__main__":
    main()
