"""Where the collector's host time goes on a small launch-bound GPU step (MiniLM-shaped, bf16 autocast):
time inside the gradient hooks, inside the per-batch flush, and a profiler table of the collected step.

    python scripts/collector_profile.py [--fp32]
"""
import cProfile
import io
import pstats
import sys
import threading
import time

import torch

sys.path.insert(0, "scripts")
from collector_overhead import SHAPES, batches  # noqa: E402

from sebp_probe.hooks import GradientStatsCollector  # noqa: E402

dev = torch.device("cuda")
amp = None if "--fp32" in sys.argv else torch.bfloat16
torch.manual_seed(0)
model = SHAPES["minilm"]().to(dev).train()
bs = [{k: v.to(dev) for k, v in b.items()} for b in batches("minilm", 2, 32, 128, "right")]
acc = {"hook": 0.0, "flush": 0.0, "hook_calls": 0}
hook_prof = cProfile.Profile()  # enabled inside the hook: it runs on the autograd engine's thread
orig_grad, orig_flush = GradientStatsCollector._on_grad, GradientStatsCollector._flush


def on_grad(self, *a):
    t = time.perf_counter()
    if acc.get("profile"):
        hook_prof.enable()
        orig_grad(self, *a)
        hook_prof.disable()
    else:
        orig_grad(self, *a)
    acc["hook"] += time.perf_counter() - t
    acc["hook_calls"] += 1


def flush(self, *a):
    t = time.perf_counter()
    orig_flush(self, *a)
    acc["flush"] += time.perf_counter() - t


GradientStatsCollector._on_grad, GradientStatsCollector._flush = on_grad, flush


def step(b):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=amp, enabled=amp is not None):
        loss = model(**b).loss
    loss.backward()


with GradientStatsCollector(model) as col:
    for _ in range(3):
        with col.batch(bs[0]["attention_mask"]):
            step(bs[0])
        step(bs[1])
    torch.cuda.synchronize()
    for k in acc:
        acc[k] = 0
    n = 10
    plain = coll = 0.0
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step(bs[1])
        torch.cuda.synchronize()
        plain += time.perf_counter() - t
        t = time.perf_counter()
        with col.batch(bs[1]["attention_mask"]):
            step(bs[1])
        torch.cuda.synchronize()
        coll += time.perf_counter() - t
    print(f"amp={amp}: plain {1e3 * plain / n:.2f} ms, collected {1e3 * coll / n:.2f} ms, ratio {coll / plain:.3f}; "
          f"hooks {1e3 * acc['hook'] / n:.2f} ms/batch over {acc['hook_calls'] // n} calls "
          f"({1e6 * acc['hook'] / max(acc['hook_calls'], 1):.1f} us/call), flush {1e3 * acc['flush'] / n:.2f} ms/batch",
          flush=True)
    acc["profile"] = True
    for _ in range(5):
        with col.batch(bs[1]["attention_mask"]):
            step(bs[1])
    torch.cuda.synchronize()
    acc["profile"] = False
    out = io.StringIO()
    pstats.Stats(hook_prof, stream=out).sort_stats("tottime").print_stats(20)
    print("cProfile inside the hooks, 5 batches (thread of the hook vs main: "
          f"{threading.main_thread().ident})\n" + "\n".join(out.getvalue().splitlines()[:34]), flush=True)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with col.batch(bs[1]["attention_mask"]):
            step(bs[1])
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
