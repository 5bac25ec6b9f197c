"""Where the whole-model backward spends its time: GPU time per kernel (torch.profiler) and host time of the
eager ``loss.backward()`` call, dense vs SEBP, on the padded batch of ``sebp-probe bench --scope model``.

    python scripts/model_profile.py OUT.json [bert-base,llama-3.2-3b]

For decoders it also runs each variant without the padding mask ("causal"; right padding: same loss and
gradients, see ``bench.check_pad_mask``). ``sebp-probe bench --scope model --breakdown`` gives the split by
kernel kind; this script adds the longest kernels by name and the host time of the backward call.
"""
import json
import statistics
import sys
import time

import torch

from sebp_kernels import SEBPConfig
from sebp_probe.bench import (DECODER_TARGETS, MODEL_CASES, _batch, _build_model, backward_breakdown,
                              environment, sample_lengths)
from sebp_probe.patch import patch_model, unpatch_model


def step_times(model, batch, repeats=5):
    """Median host ms of the loss.backward() call (no sync inside) and median GPU ms of the backward."""
    host, gpu = [], []
    for i in range(repeats + 2):
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        torch.cuda.synchronize()  # the backward starts on an idle GPU: its host time is not hidden by the forward
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        t0 = time.perf_counter()
        loss.backward()
        t1 = time.perf_counter()
        e1.record()
        e1.synchronize()
        if i >= 2:
            host.append((t1 - t0) * 1e3)
            gpu.append(e0.elapsed_time(e1))
    model.zero_grad(set_to_none=True)
    return round(statistics.median(host), 3), round(statistics.median(gpu), 3), float(loss.detach())


def main():
    out = sys.argv[1]
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else ["bert-base", "llama-3.2-3b"]
    result = {"command": "python " + " ".join(sys.argv), "environment": environment(), "cases": {}}
    for name in names:
        case = MODEL_CASES[name]
        model = _build_model(case, torch.bfloat16)
        lengths = sample_lengths(case.lengths, case.batch, case.seq, seed=0)
        variants = {"padded": _batch(case, lengths, case.seq, model.config.vocab_size, seed=0)}
        if case.arch != "bert":
            variants["causal"] = _batch(case, lengths, case.seq, model.config.vocab_size, seed=0, pad_mask=False)
        targets = DECODER_TARGETS if case.arch != "bert" else None
        res = {}
        for vname, batch in variants.items():
            for method in ("dense", "sebp"):
                if method == "sebp":
                    patch_model(model, SEBPConfig("exact"), target_modules=targets)
                host, gpu, loss = step_times(model, batch)
                table = backward_breakdown(model, batch, top=20)
                if method == "sebp":
                    unpatch_model(model)
                key = f"{method}_{vname}"
                res[key] = {"backward_host_ms": host, "backward_gpu_ms": gpu, "loss": loss, "kernels": table}
                print(f"{name:14s} {key:14s} loss {loss:.5f}  backward: host {host:8.2f} ms  GPU {gpu:8.2f} ms  "
                      f"kernels {table['total_ms']:8.2f} ms  " +
                      "  ".join(f"{k} {v:.2f}" for k, v in table["by_kind_ms"].items()), flush=True)
                for r in table["top"][:12]:
                    print(f"      {r['ms']:9.3f} ms {r['calls']:5d}x  {r['kernel']}")
        result["cases"][name] = res
        del model
        torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
