"""A few real fine-tuning steps of all-MiniLM-L6-v2 on real tweets: SEBP exact gives dense's losses."""
from __future__ import annotations

import copy

import pytest
import torch

from sebp_kernels import SEBPConfig
from sebp_probe.data.assets import load_model
from sebp_probe.config import DataConfig
from sebp_probe.model.patch import patch_model
from sebp_probe.data.textdata import load_text_data, make_loader


def _train(model, batches, lr=5e-4):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for b in batches:
        opt.zero_grad(set_to_none=True)
        loss = model(**b).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_minilm_sebp_exact_reproduces_dense_losses():
    torch.manual_seed(0)
    lm = load_model("minilm", num_labels=3)
    cfg = DataConfig(batch_size=16, max_length=64)
    batches = list(make_loader(lm, load_text_data(DataConfig(max_samples=96), "classification"), cfg))
    assert (torch.cat([b["attention_mask"] for b in batches]) == 0).float().mean() > 0.3  # real padding
    dense = lm.model.train()
    for mod in dense.modules():  # dropout would draw different masks in the two runs
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    sebp = copy.deepcopy(dense)
    assert len(patch_model(sebp, SEBPConfig("exact"))) == 36
    d, s = _train(dense, batches), _train(sebp, batches)
    assert d[-1] < d[0]  # it learns
    for i, (a, b) in enumerate(zip(d, s)):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), f"step {i}: dense {a:.6f} vs sebp {b:.6f}"
