"""GPU memory of a training step replayed as CUDA graphs (``sebp_probe.graphs``), dense vs SEBP.

BERT-base from its config, fp32 weights, bf16 autocast, batch 32 x 128 with short right-padded samples,
AdamW: allocated memory after an eager step, after capture, and the peak of replayed steps (forward,
backward, clipping, optimizer), with the CUDA tensors Python still references counted apart. Variants: SEBP
after the calibration's timing graphs (``finetune._graphed_backward_ms``), as ``finetune --cuda-graphs`` does.

    python scripts/graph_memory.py [OUT.json]
"""
from __future__ import annotations

import gc
import json
import sys

import torch
from transformers import AutoModelForSequenceClassification, BertConfig

from sebp_kernels import SEBPConfig
from sebp_probe import finetune as ft
from sebp_probe import calibration
from sebp_probe.graphs import StepGraphs
from sebp_probe.patch import patch_model

MIB = 2**20


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 64, (32,), generator=g)
    ids = torch.randint(5, 30000, (32, 128), generator=g)
    mask = (torch.arange(128)[None] < lengths[:, None]).long()
    return {"input_ids": (ids * mask).cuda(), "attention_mask": mask.cuda(),
            "labels": torch.randint(0, 3, (32,), generator=g).cuda()}


def _python_cuda_bytes() -> int:
    seen, total = set(), 0
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and o.is_cuda:
                s = o.untyped_storage()
                if s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    total += s.nbytes()
        except Exception:  # noqa: BLE001 (objects that fail isinstance/attribute access)
            pass
    return total


def one(method: str, calib: bool) -> dict:
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(BertConfig(num_labels=3)).cuda().train()
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    b = _batch()
    if calib:  # what calibrate() runs before training: timing graphs of the dense and the SEBP model
        calibration.graphed_backward_ms(model, b, autocast)
    if method == "sebp":
        patch_model(model, SEBPConfig("exact", backend="triton"))
        if calib:
            calibration.graphed_backward_ms(model, b, autocast)
    gc.collect()
    torch.cuda.synchronize()
    out = {"method": method, "after_calibration_graphs": calib,
           "start_mib": torch.cuda.memory_allocated() / MIB}
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    torch.cuda.reset_peak_memory_stats()
    with autocast():
        loss = model(**b).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    del loss
    torch.cuda.synchronize()
    out["eager_step_peak_mib"] = torch.cuda.max_memory_allocated() / MIB
    out["after_eager_mib"] = torch.cuda.memory_allocated() / MIB
    steps = StepGraphs(model, b, autocast)
    torch.cuda.synchronize()
    out["after_capture_mib"] = torch.cuda.memory_allocated() / MIB
    torch.cuda.reset_peak_memory_stats()
    for i in range(3):
        steps.forward(_batch(i + 1))
        steps.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    out["replayed_step_peak_mib"] = torch.cuda.max_memory_allocated() / MIB
    out["after_replays_mib"] = torch.cuda.memory_allocated() / MIB
    out["python_held_cuda_mib"] = _python_cuda_bytes() / MIB
    out["pool_reserved_mib"] = torch.cuda.memory_reserved() / MIB
    steps.close()
    del steps, opt, model, params
    gc.collect()
    torch.cuda.synchronize()
    out["after_close_mib"] = torch.cuda.memory_allocated() / MIB
    torch.cuda.empty_cache()
    print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()}))
    return out


def main():
    res = [one("dense", False), one("sebp", False), one("sebp", True), one("dense", True)]
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": res}, fh, indent=1)


if __name__ == "__main__":
    main()
