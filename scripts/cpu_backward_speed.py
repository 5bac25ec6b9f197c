"""Backward time of the real MiniLM classifier on CPU: dense vs SEBP (exact, torch path), with SEBP norms.

The third variant puts the SEBP backward on the LayerNorms too.

Usage: python scripts/cpu_backward_speed.py [--batch 32] [--length 128] [--repeats 5] [--output FILE] [--compile]
Batches are real tweets from the bundled corpus, padded to a fixed length. ``--compile``: every variant runs
as ``torch.compile(model)`` (Inductor; the SEBP layers as sebp:: custom ops), timed after two warm-up steps.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import statistics
import sys
import time

import torch

from sebp_kernels import SEBPConfig
from sebp_probe.assets import load_model, load_text_data, make_loader
from sebp_probe.config import DataConfig
from sebp_probe.patch import patch_model, patch_norms


def time_backward(model, batches, repeats):
    fwd, bwd = [], []
    for _ in range(repeats):
        for b in batches:
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss = model(**b).loss
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return statistics.median(fwd), statistics.median(bwd)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output")
    ap.add_argument("--compile", action="store_true", help="time torch.compile(model) of each variant")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    lm = load_model("minilm", num_labels=3)
    cfg = DataConfig(batch_size=a.batch, max_length=a.length)
    loader = make_loader(lm, load_text_data(DataConfig(max_samples=a.batch * a.batches), "classification"), cfg)
    batches = list(loader)
    density = float(torch.cat([b["attention_mask"] for b in batches]).float().mean())
    dense = lm.model.train()
    sebp = copy.deepcopy(dense)
    patch_model(sebp, SEBPConfig("exact", backend="torch"))
    norms = copy.deepcopy(sebp)
    patch_norms(norms, SEBPConfig("exact", backend="torch"))
    models = (("dense", dense), ("sebp_exact", sebp), ("sebp_exact_norms", norms))
    compile_s = {}
    if a.compile:
        import torch._dynamo as dynamo

        dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, 64)
        compiled = []
        for name, m in models:
            c = torch.compile(m)
            t0 = time.perf_counter()
            for _ in range(2):
                c(**batches[0]).loss.backward()
            compile_s[name] = round(time.perf_counter() - t0, 1)
            compiled.append((name, c))
        models = tuple(compiled)
    for _, m in models:  # warm-up
        m(**batches[0]).loss.backward()
    res = {}
    for name, m in models:
        f, b = time_backward(m, batches, a.repeats)
        res[name] = {"forward_s": f, "backward_s": b}
    out = {
        "what": "MiniLM (all-MiniLM-L6-v2) classifier backward on CPU, dense vs SEBP exact (torch path), "
                "without and with the SEBP norms",
        "batch": a.batch, "length": a.length, "token_density": density,
        "compiled": a.compile, "warmup_s": compile_s or None, "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__, "date": datetime.date.today().isoformat(),
        "command": "python " + " ".join(sys.argv),
        **res,
        "backward_speedup": res["dense"]["backward_s"] / res["sebp_exact"]["backward_s"],
        "backward_speedup_with_norms": res["dense"]["backward_s"] / res["sebp_exact_norms"]["backward_s"],
    }
    print(json.dumps(out, indent=2))
    if a.output:
        with open(a.output, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
