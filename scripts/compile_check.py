"""What ``torch.compile`` does to a model with SEBP layers on a CUDA GPU: tiny BERT and Llama models (fp32, eval
mode so that dropout is off, right-padded batch), SEBP on every linear, norm and MLP activation. It compares
the gradients of one backward through the compiled model with eager SEBP's and with the dense model's,
counts Dynamo's graph breaks by reason, and counts the SEBP Triton kernels that one eager and one compiled
forward+backward launch (torch profiler): whether the compiled model still runs the SEBP backward.

    python scripts/compile_check.py [out.json]
"""
import collections
import datetime
import json
import sys

import torch
import transformers
import triton
from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM

from sebp_kernels import SEBPConfig
from sebp_probe.patch import patch_activations, patch_model, patch_norms


def models():
    bert = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=256, num_labels=2)
    llama = LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=256, pad_token_id=0)
    return {"bert": lambda: BertForSequenceClassification(bert), "llama": lambda: LlamaForCausalLM(llama)}


def batch(arch, dev):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (4, 64), generator=g)
    mask = torch.ones_like(ids)
    for i, n in enumerate((10, 25, 64, 3)):
        mask[i, n:] = 0
        ids[i, n:] = 0
    kw = {"input_ids": ids.to(dev), "attention_mask": mask.to(dev)}
    if arch == "bert":
        kw["labels"] = torch.tensor([0, 1, 1, 0], device=dev)
    else:
        labels = ids.clone()
        labels[mask == 0] = -100
        kw["labels"] = labels.to(dev)
    return kw


def grads(model, kw, owner=None):
    """Gradients of one backward, by the parameter names of ``owner`` (the module a compiled model wraps)."""
    owner = owner or model
    owner.zero_grad(set_to_none=True)
    model(**kw).loss.backward()
    return {n: p.grad.detach().clone() for n, p in owner.named_parameters() if p.grad is not None}


def sebp_kernels_run(fn):
    """Launches of the SEBP Triton kernels (by name) during ``fn()``, from the profiler; {} without CUDA."""
    if not torch.cuda.is_available():
        return {}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {e.key: e.count for e in prof.key_averages()}
    wanted = ("_grads_kernel", "_row_flags_kernel", "_compact_kernel", "_act_", "_norm_")
    found = {n: c for n, c in names.items() if any(w in n for w in wanted)}
    found["(events profiled)"] = sum(names.values())
    return found


def max_diff(a, b):
    missing = sorted(set(a) ^ set(b))
    return max((a[n] - b[n]).abs().max().item() for n in a if n in b), missing


def main():
    import torch._dynamo as dynamo

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__, "triton": triton.__version__,
           "transformers": transformers.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": "python scripts/compile_check.py " + " ".join(sys.argv[1:]), "runs": []}
    for arch, make in models().items():
        torch.manual_seed(0)
        dense = make().to(dev).eval()
        sebp = make().to(dev).eval()
        sebp.load_state_dict(dense.state_dict())
        patch_model(sebp, SEBPConfig("exact"))
        patch_norms(sebp)
        patch_activations(sebp)
        kw = batch(arch, dev)
        g_dense, g_eager = grads(dense, kw), grads(sebp, kw)
        run = {"arch": arch, "eager_vs_dense": max_diff(g_eager, g_dense)[0],
               "eager_sebp_kernels": sebp_kernels_run(lambda: grads(sebp, kw))}
        dynamo.reset()
        dynamo.utils.counters.clear()
        try:
            compiled = torch.compile(sebp)
            g1 = grads(compiled, kw, sebp)
            g2 = grads(compiled, kw, sebp)  # a second call: the cached graphs
            run["compiled_vs_eager"], run["missing_grads"] = max_diff(g1, g_eager)
            run["second_call_vs_first"] = max_diff(g2, g1)[0]
            run["compiled_vs_dense"] = max_diff(g1, g_dense)[0]
            run["compiled_sebp_kernels"] = sebp_kernels_run(lambda: grads(compiled, kw, sebp))
        except Exception as e:  # noqa: BLE001 - what a user would see is the point
            run["error"] = f"{type(e).__name__}: {str(e)[:800]}"
        breaks = collections.Counter()
        for reason, n in dynamo.utils.counters["graph_break"].items():
            breaks[reason.splitlines()[0][:160]] += n
        run["graph_breaks"] = dict(breaks)
        print(json.dumps(run, indent=1), flush=True)
        out["runs"].append(run)
    if len(sys.argv) > 1:
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
