"""Hugging Face Trainer with ``torch_compile=True`` on a model patched with SEBP linears, norms and activations:
one Dynamo graph (the SEBP layers are sebp:: custom ops) and the losses of the same Trainer run uncompiled."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo

from sebp_kernels import SEBPConfig
from sebp_probe import patch_activations, patch_model, patch_norms
from tests.convergence.finetune_helpers import isolated_accelerate  # noqa: F401 (the Trainer's accelerate state
from tests.tiny_models import padded_batch, tiny_model  # would otherwise compile later tests' models)


class _Rows(torch.utils.data.Dataset):
    """Padded samples of a few tiny batches (fixed length: one compiled shape)."""

    def __init__(self, arch):
        self.items = []
        for seed in range(4):
            b = padded_batch(arch, seed=seed)
            self.items += [{k: v[i] for k, v in b.items()} for i in range(b["input_ids"].shape[0])]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _train(arch, tmp_path, compiled, device, monkeypatch):
    from transformers import Trainer, TrainingArguments

    # TrainingArguments(torch_compile=True) sets these for the whole process, and accelerate reads them; set
    # to their defaults here, monkeypatch puts back what was there before at the test's end.
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "no")
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "default")

    model = tiny_model(arch)
    patch_model(model, SEBPConfig("exact"))
    patch_norms(model)
    patch_activations(model)
    kw = {}
    if compiled:
        kw = dict(torch_compile=True, torch_compile_backend="aot_eager" if device == "cpu" else "inductor",
                  torch_compile_mode=None if device == "cpu" else "reduce-overhead")
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3, max_steps=4,
                             learning_rate=1e-3, use_cpu=device == "cpu", report_to=[], logging_steps=1,
                             save_strategy="no", seed=0, dataloader_drop_last=True, disable_tqdm=True, **kw)
    dynamo.reset()
    dynamo.utils.counters.clear()
    try:
        trainer = Trainer(model=model, args=args, train_dataset=_Rows(arch))
        trainer.train()
        stats = dict(dynamo.utils.counters["stats"]), sum(dynamo.utils.counters["graph_break"].values())
    finally:
        dynamo.reset()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], stats


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_trainer_torch_compile_gives_the_uncompiled_losses_in_one_graph(arch, device, tmp_path, monkeypatch):
    """CPU: the aot_eager backend (no C++ build); GPU: Inductor with mode="reduce-overhead" (CUDA graphs)."""
    eager, _ = _train(arch, tmp_path, False, device, monkeypatch)
    got, ((stats, breaks)) = _train(arch, tmp_path, True, device, monkeypatch)
    assert len(got) == len(eager) == 4
    assert stats.get("unique_graphs", 0) >= 1 and breaks == 0
    tol = 1e-6 if device == "cpu" else 1e-4
    assert got == pytest.approx(eager, rel=tol, abs=tol)
