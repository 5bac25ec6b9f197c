"""Worker of test_fsdp.py (run under torchrun, gloo, CPU): the same small model with and without SEBP linears,
each sharded with torch FSDP2 (``fully_shard``), on right-padded batches; writes ``<argv[1]>/rank<r>.json``
with the largest gradient difference per parameter, relative to the gradient's largest magnitude (a file per
process: lines two processes print to one stdout can interleave). Mode ``lora``: a tiny Llama with
peft LoRA adapters, SEBP on its frozen base projections, every decoder layer sharded; the adapters' gradients
are compared. Mode ``merge``: that LoRA model sharded, its full state dict gathered and merged as
``finetune`` saves a sharded LoRA run (sebp_probe.train.lora_merge); rank 0 compares it with peft's
``merge_and_unload`` of the same model unsharded. Mode ``compiled``: a tiny Llama with SEBP, every
decoder layer sharded, then compiled layer by layer as ``finetune --compile`` does. Mode ``kept``: the
labelled head of several processes through the sharded model's own forward. Several modes in ``argv[2:]`` run
one after the other in one launch."""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from sebp_kernels import SEBPConfig, SEBPLinear
from tests.helpers import exit_after_teardown


def build(sebp: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 40), torch.nn.GELU(),
                            torch.nn.Linear(40, 6))
    if sebp:
        for i in (0, 2, 4):
            m[i] = SEBPLinear.from_linear(m[i], SEBPConfig("exact"))
    for i in (0, 2, 4):
        fully_shard(m[i])
    fully_shard(m)
    return m


def build_lora(sebp: bool) -> torch.nn.Module:
    import peft

    from sebp_probe import patch_model
    from tests.tiny_models import tiny_model

    model = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"], lora_dropout=0.0,
        init_lora_weights=False))  # B random too: at the usual B = 0 the gradient of A is zero
    if sebp:
        patch_model(model, SEBPConfig("exact"))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def lora_grads(rank: int) -> dict:
    from tests.tiny_models import padded_batch

    dense, sebp = build_lora(False), build_lora(True)
    for step in range(2):  # each process its own data, two steps of gradient accumulation
        batch = padded_batch("llama", lengths=(11, 4, 7), side="right", seed=10 * rank + step)
        for m in (dense, sebp):
            m(**batch, use_cache=False).loss.backward()
    diffs = {}
    for (name, a), (_, b) in zip(dense.named_parameters(), sebp.named_parameters()):
        if a.requires_grad:
            ga, gb = a.grad.full_tensor(), b.grad.full_tensor()
            scale = float(ga.abs().max())
            assert scale > 0, name
            diffs[name] = float((ga - gb).abs().max()) / scale
    return diffs


def merged_diffs(rank: int) -> dict:
    import peft
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from sebp_probe.train.lora_merge import lora_scalings, merge_lora_state
    from sebp_probe.model.patch import unpatch_model
    from tests.tiny_models import tiny_model

    sharded = build_lora(True)
    state = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    scalings = lora_scalings(sharded)  # every rank, as finetune does
    if rank != 0:
        return {}
    merged = merge_lora_state(state, scalings)
    ref = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"], lora_dropout=0.0,
        init_lora_weights=False)).merge_and_unload()
    unpatch_model(ref)
    want = ref.state_dict()
    assert sorted(merged) == sorted(want), (sorted(set(merged) ^ set(want)))[:6]
    assert len(scalings) == 8
    return {k: float((merged[k].float() - want[k].float()).abs().max()) for k in want}


def sharded_llama(sebp: bool) -> torch.nn.Module:
    """A tiny Llama (SEBP on every projection where ``sebp``), each decoder layer and the model sharded."""
    from sebp_probe import patch_model
    from tests.tiny_models import tiny_model

    m = tiny_model("llama")
    if sebp:
        patch_model(m, SEBPConfig("exact"))
    for layer in m.model.layers:
        fully_shard(layer)
    fully_shard(m)
    return m


def compiled_grads(rank: int) -> dict:
    """A tiny Llama with SEBP on every projection, each decoder layer sharded and then compiled in place as
    ``finetune --compile`` does (sebp_probe.train.compiling.compile_layers; aot_eager standing in for Inductor),
    against the same model eager and dense: its gradients, and the graphs Dynamo compiled."""
    from sebp_probe.train.compiling import compile_layers, dynamo_counts
    from tests.tiny_models import padded_batch

    dense, sebp = sharded_llama(False), sharded_llama(True)
    compile_layers(sebp, backend="aot_eager", dynamic=True)
    for step in range(2):  # each process its own data, two batch shapes
        batch = padded_batch("llama", lengths=(11, 4, 7) if step else (5, 9), side="right", seed=10 * rank + step)
        for m in (dense, sebp):
            m(**batch, use_cache=False).loss.backward()
    diffs = {}
    for (name, a), (_, b) in zip(dense.named_parameters(), sebp.named_parameters()):
        ga, gb = a.grad.full_tensor(), b.grad.full_tensor()
        diffs[name] = float((ga - gb).abs().max()) / max(float(ga.abs().max()), 1e-30)
    diffs["graphs"], diffs["graph_breaks"] = dynamo_counts()
    return diffs


def kept_grads(rank: int) -> dict:
    """A tiny Llama with SEBP, every decoder layer and the model sharded: the loss of the labelled head in
    several processes (``choose_head(processes=2)``: the output layer on the labelled positions through the
    sharded model's own forward, sebp_probe.model.heads.forward_kept_loss) against the model's own loss of
    the same model, sharded and dense: its gradients, and the rows the output layer computed (fewer)."""
    from sebp_probe.model.losses import choose_head
    from tests.tiny_models import padded_batch

    dense, kept = sharded_llama(False), sharded_llama(True)
    head, why = choose_head(kept, "causal-lm", "labelled", processes=2)
    assert (head.kind, head.through_forward, why) == ("labelled", True, None)
    rows = []
    kept.lm_head.register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[:-1].numel()))
    for step in range(2):  # each process its own data, two steps of gradient accumulation
        batch = padded_batch("llama", lengths=(11, 4, 7), side="right", seed=10 * rank + step)
        batch["labels"][:, :3] = -100  # a prompt: the first positions carry no label in any row
        dense(**batch, use_cache=False).loss.backward()
        head.loss(kept, batch).backward()
    diffs = {}
    for (name, a), (_, b) in zip(dense.named_parameters(), kept.named_parameters()):
        ga, gb = a.grad.full_tensor(), b.grad.full_tensor()
        diffs[name] = float((ga - gb).abs().max()) / max(float(ga.abs().max()), 1e-30)
    diffs["head_rows"], diffs["all_rows"] = sum(rows), 2 * 3 * 11
    return diffs


def plain_grads(rank: int) -> dict:
    """The plain stack of linears with and without SEBP, both sharded: the gradients' relative differences."""
    dense, sebp = build(False), build(True)
    g = torch.Generator().manual_seed(1 + rank)  # each process its own data, as in data parallel
    for _ in range(2):  # two steps of gradient accumulation
        x = torch.randn(4, 9, 24, generator=g)
        lengths = torch.randint(1, 10, (4,), generator=g)
        mask = (torch.arange(9) < lengths[:, None]).unsqueeze(-1).float()  # right padding: pad rows get no loss
        target = torch.randn(4, 9, 6, generator=g)
        for m in (dense, sebp):
            ((m(x) - target) * mask).pow(2).sum().backward()
    diffs = {}
    for (name, a), (_, b) in zip(dense.named_parameters(), sebp.named_parameters()):
        ga, gb = a.grad.full_tensor(), b.grad.full_tensor()
        scale = float(ga.abs().max())
        assert scale > 0, name
        diffs[name] = float((ga - gb).abs().max()) / scale  # relative: only the summation order differs
    return {"sharded": type(next(sebp.parameters())).__name__, "diffs": diffs}


MODES = {"plain": plain_grads, "merge": merged_diffs, "lora": lora_grads, "compiled": compiled_grads,
         "kept": kept_grads}


def main() -> None:
    """``argv[2:]``: the modes to run, one after the other in the same process group (one launch serves every
    test); each mode's result under its name in ``rank<r>.json``."""
    import torch._dynamo as dynamo

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {"rank": rank}
    for mode in sys.argv[2:] or ["plain"]:
        dynamo.reset()  # the compiled mode counts the graphs of its own model only
        dynamo.utils.counters.clear()
        out = MODES[mode](rank)
        result[mode] = out if mode == "plain" else {"diffs": out}
    (Path(sys.argv[1]) / f"rank{rank}.json").write_text(json.dumps(result))
    exit_after_teardown()


if __name__ == "__main__":
    main()
