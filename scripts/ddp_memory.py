"""Where the peak memory of a DDP training step goes, dense vs SEBP (the 2-GPU fine-tuning runs measured SEBP
8% above dense, one GPU did not).

Plain torch DDP (the defaults accelerate uses), fp32, one fixed right-padded batch of synthetic tokens, the
models of ``scripts/gpu_finetune.py``. Each method (a method may repeat: ``--order dense,dense``) gets a fresh
model and DDP wrapper; the allocator's history is recorded over its first four steps, and rank 0 prints the
peak after each step, how far the trace rose, and the blocks allocated before step 1 (the parameters, DDP's
first buckets) that were freed by the peak. ``gpu_finetune.py`` (MEMORY_TRACE=1) uses the same recording.

    torchrun --nproc_per_node 2 scripts/ddp_memory.py --model llama [--norms] [--order sebp,dense]
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
from collections import defaultdict

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from gpu_finetune import LLAMA_TARGETS, model_loader  # noqa: E402

SHAPES = {"bert": (32, 128, 40), "llama": (8, 512, 160)}  # batch, length, real tokens per sample


def batch(kind: str, vocab: int, dev):
    b, n, real = SHAPES[kind]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (b, n), generator=g)
    mask = torch.zeros(b, n, dtype=torch.long)
    for i in range(b):
        mask[i, : real + 7 * i % real] = 1
    ids = ids * mask
    out = {"input_ids": ids.to(dev), "attention_mask": mask.to(dev)}
    if kind == "bert":
        out["labels"] = torch.randint(0, 3, (b,), generator=g).to(dev)
    else:
        out["labels"] = torch.where(mask.bool(), ids, -100).to(dev)
    return out


def frame_key(frames) -> str:
    """The first three Python frames outside torch's own nn/autograd plumbing."""
    keep = [f for f in frames if f.get("filename", "").endswith(".py")
            and "/torch/nn/modules/module.py" not in f["filename"]
            and "/torch/autograd/" not in f["filename"]]
    return " < ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in keep[:3]) or "(no frame)"


def live_at_peak(snapshot, dev: int):
    """(peak bytes above the trace's start, {frames: bytes} allocated in the trace and alive then, {frames of
    the free: bytes} of blocks from before the trace freed by then, bytes whose free was requested but not
    completed then (a stream still used them))."""
    live, pending, cur, best = {}, {}, 0, (0, {}, {}, 0)
    pre_freed = defaultdict(int)
    for ev in snapshot["device_traces"][dev]:
        act, addr = ev["action"], ev["addr"]
        if act == "alloc":
            live[addr] = (ev["size"], frame_key(ev.get("frames", [])))
            cur += ev["size"]
        elif act == "free_requested":
            pending[addr] = ev["size"]
        elif act == "free_completed":
            cur -= ev["size"]
            pending.pop(addr, None)
            if live.pop(addr, None) is None:
                pre_freed[frame_key(ev.get("frames", []))] += ev["size"]
        if cur > best[0]:
            best = (cur, dict(live), dict(pre_freed), sum(pending.values()))
    groups = defaultdict(int)
    for size, key in best[1].values():
        groups[key] += size
    return best[0], groups, best[2], best[3]


def start_recording() -> None:
    """Record the CUDA allocator's history (Python stacks) from now on."""
    torch.cuda.memory._record_memory_history(max_entries=1000000, stacks="python")


def stop_recording(dev: int):
    """Stop recording and return :func:`live_at_peak` of what was recorded on device ``dev``."""
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return live_at_peak(snap, dev)


def step(model, opt, data):
    loss = model(**data).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(kind: str, method: str, norms: bool, bucket_view: bool, dev):
    from sebp_kernels import SEBPConfig
    from sebp_probe.patch import patch_model, patch_norms

    loader, vocab = model_loader(kind)
    torch.manual_seed(0)
    model = loader().model
    if method == "sebp":
        patch_model(model, SEBPConfig("exact"), target_modules=LLAMA_TARGETS if kind == "llama" else None)
        if norms:
            patch_norms(model)
    model = model.to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index],
                                                    gradient_as_bucket_view=bucket_view)
    opt = torch.optim.AdamW([p for p in ddp.parameters() if p.requires_grad], lr=1e-5)
    data = batch(kind, vocab, dev)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    start_recording()
    peaks = []
    for _ in range(4):  # DDP rebuilds its buckets at the start of the second step
        step(ddp, opt, data)
        peaks.append(torch.cuda.max_memory_allocated(dev) / 2**20)
    rise, groups, pre_freed, pending = stop_recording(dev.index)
    del ddp, opt, model, data
    gc.collect()
    torch.cuda.empty_cache()
    return {"start_mib": start / 2**20, "peaks_mib": peaks, "trace_rise_mib": rise / 2**20, "groups": groups,
            "pre_freed": pre_freed, "pending_mib": pending / 2**20}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama", choices=sorted(SHAPES))
    ap.add_argument("--norms", action="store_true")
    ap.add_argument("--bucket-view", action="store_true")
    ap.add_argument("--order", default="dense,sebp")
    a = ap.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    res = [(m, measure(a.model, m, a.norms, a.bucket_view, dev)) for m in a.order.split(",")]
    if rank == 0:
        print(f"== {a.model} norms={a.norms} bucket_view={a.bucket_view} order={a.order}")
        for m, r in res:
            print(f"{m:6s} start {r['start_mib']:.0f} MiB  peak after steps 1-4 "
                  + " ".join(f"{p:.0f}" for p in r["peaks_mib"])
                  + f" MiB  rise (trace) {r['trace_rise_mib']:.0f} MiB  free pending {r['pending_mib']:.0f} MiB")
            for k, v in sorted(r["pre_freed"].items(), key=lambda kv: -kv[1])[:4]:
                print(f"    freed by the peak, allocated before step 1: {v / 2**20:8.1f} MiB  {k}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
