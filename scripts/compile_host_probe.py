"""Where the host time of a SEBP backward goes, eager vs ``torch.compile`` (default mode), BERT-base bf16.

For each run: the wall time of ``loss.backward()`` (GPU idle at its start, synchronised at its end), and the
host time spent inside the SEBP gradient functions themselves (``linear_grads``, the norm and activation
backwards), summed over the layers; the rest is autograd, the compiled graph's wrapper code and the op
dispatch. Medians over ``--repeats`` backwards.

    python scripts/compile_host_probe.py [--repeats 10]
"""
import argparse
import statistics
import time

import torch
import torch._dynamo as dynamo

from sebp_kernels import SEBPConfig, activations, functional, norms
from sebp_probe.bench import MODEL_CASES, _batch, _build_model, sample_lengths
from sebp_probe.patch import patch_activations, patch_model, patch_norms

SPENT = {"s": 0.0, "n": 0}


def timed(fn):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            SPENT["s"] += time.perf_counter() - t0
            SPENT["n"] += 1
    return wrapper


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    functional.linear_grads = timed(functional.linear_grads)
    norms._backward = timed(norms._backward)
    activations._triton_grads = timed(activations._triton_grads)
    case = MODEL_CASES["bert-base"]
    model = _build_model(case, torch.bfloat16)
    lengths = sample_lengths(case.lengths, case.batch, case.seq, seed=0)
    batch = _batch(case, lengths, case.seq, model.config.vocab_size, seed=0)
    patch_model(model, SEBPConfig("exact"))
    patch_norms(model)
    patch_activations(model)
    for name, fn in (("eager", model), ("compiled", None)):
        if fn is None:
            dynamo.reset()
            fn = torch.compile(model)
        walls, inside, calls = [], [], []
        for i in range(args.repeats + 3):
            model.zero_grad(set_to_none=True)
            loss = fn(**batch).loss
            torch.cuda.synchronize()
            SPENT.update(s=0.0, n=0)
            t0 = time.perf_counter()
            loss.backward()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            if i >= 3:
                walls.append((t2 - t0) * 1e3)
                inside.append(SPENT["s"] * 1e3)
                calls.append(SPENT["n"])
                host = (t1 - t0) * 1e3
        print(name, {"backward_wall_ms": round(statistics.median(walls), 2),
                     "issue_ms_last": round(host, 2),
                     "inside_sebp_functions_ms": round(statistics.median(inside), 2),
                     "sebp_function_calls": calls[-1]}, flush=True)


if __name__ == "__main__":
    main()
