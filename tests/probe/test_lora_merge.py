"""sebp_probe.train.lora_merge (how a sharded LoRA run saves): the merged state dict equals peft's merge_and_unload,
unsharded here (tests/kernels/test_fsdp.py checks it gathered from FSDP2 shards); what it does not cover is
refused in one line."""
from __future__ import annotations

import pytest
import torch

from sebp_probe.train.lora_merge import lora_scalings, merge_lora_state
from tests.tiny_models import tiny_model

peft = pytest.importorskip("peft")


def _lora(**kw):
    cfg = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"], lora_dropout=0.0,
               init_lora_weights=False)
    return peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(**{**cfg, **kw}))


def test_merged_state_equals_merge_and_unload():
    model = _lora()
    scalings = lora_scalings(model)
    assert len(scalings) == 8 and set(scalings.values()) == {2.0}  # alpha / r
    merged = merge_lora_state(model.state_dict(), scalings)
    want = model.merge_and_unload().state_dict()
    assert sorted(merged) == sorted(want)
    changed = 0
    for k, v in want.items():
        torch.testing.assert_close(merged[k], v, atol=1e-6, rtol=1e-6)
        changed += "proj" in k and not torch.equal(merged[k], tiny_model("llama").state_dict()[k])
    assert changed == 8  # every adapted weight moved (B is not zero here)


def test_dora_is_refused():
    with pytest.raises(ValueError, match="DoRA"):
        lora_scalings(_lora(use_dora=True))
