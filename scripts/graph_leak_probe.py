"""Which allocations outlive a captured training step once the graphs, the model and the optimizer are gone
(scripts/graph_memory.py saw allocated memory grow from run to run): allocation stacks of the blocks still
allocated, from the CUDA allocator's history.

    python scripts/graph_leak_probe.py
"""
from __future__ import annotations

import gc
import sys
from collections import Counter

import torch

sys.path.insert(0, "scripts")
from graph_memory import _batch  # noqa: E402
from transformers import AutoModelForSequenceClassification, BertConfig  # noqa: E402

from sebp_probe.graphs import StepGraphs  # noqa: E402


def main():
    torch.cuda.memory._record_memory_history(max_entries=200000)
    model = AutoModelForSequenceClassification.from_config(BertConfig(num_labels=3)).cuda().train()
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    before = torch.cuda.memory_allocated()
    steps = StepGraphs(model, _batch(), autocast, accumulate=sys.argv[1:] != ["noacc"])
    steps.forward()
    steps.backward()
    steps.close()
    del steps, model
    gc.collect()
    torch.cuda.synchronize()
    print(f"allocated before the model {before / 2**20:.1f} MiB, after everything is gone "
          f"{torch.cuda.memory_allocated() / 2**20:.1f} MiB")
    snap = torch.cuda.memory._snapshot()
    sizes = Counter()
    for seg in snap["segments"]:
        for blk in seg["blocks"]:
            if blk["state"] != "active_allocated":
                continue
            frames = blk.get("frames") or []
            where = " <- ".join(f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in frames
                                if f["filename"].endswith(".py"))[:400]
            sizes[(seg.get("segment_pool_id"), where)] += blk["size"]
    for (pool, where), n in sizes.most_common(12):
        print(f"{n / 2**20:8.1f} MiB pool {pool}: {where}")


if __name__ == "__main__":
    main()
