"""apply_sebp on trainers it cannot make exact (one warning line, the trainer unchanged), on a loss it cannot
reproduce (the trainer's own loss, SEBP layers on), with a report, and its undo."""
from __future__ import annotations

import logging

import pytest
import torch

from sebp_kernels import SEBPLinear
from sebp_probe.integrations.hf import apply_sebp
from sebp_probe.model.patch import PatchError
from sebp_probe.analysis.report import ReportError, layer_configs_from_report
from tests.convergence.finetune_helpers import isolated_accelerate  # noqa: F401 (a fresh accelerate state per test)
from tests.tiny_models import padded_batch, tiny_model, word_tokenizer

LOGGER = "sebp_probe.integrations.hf"


def _rows(arch="llama"):
    b = padded_batch(arch, lengths=(9, 4, 7, 5))
    return [{k: v[i] for k, v in b.items()} for i in range(4)]


def _args(tmp_path, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, use_cpu=True,
                             report_to=[], save_strategy="no", disable_tqdm=True, **kw)


def _trainer(tmp_path, model=None, cls=None, **kw):
    from transformers import Trainer

    return (cls or Trainer)(model=model if model is not None else tiny_model("llama"), args=_args(tmp_path),
                            train_dataset=_rows(), **kw)


def _one_warning(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    return lines[0]


def _assert_unchanged(trainer, handle):
    assert not handle.applied and handle.reason
    assert "compute_loss" not in vars(trainer)
    assert not any(isinstance(m, SEBPLinear) for m in trainer.model.modules())


def test_a_custom_compute_loss_leaves_the_trainer_unchanged(tmp_path, caplog):
    from transformers import Trainer

    class MyTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch) * 2

    trainer = _trainer(tmp_path, cls=MyTrainer)
    handle = apply_sebp(trainer)
    _assert_unchanged(trainer, handle)
    assert "MyTrainer computes its own loss" in _one_warning(caplog)
    trainer.train()  # runs as before


def test_a_compute_loss_func_leaves_the_trainer_unchanged(tmp_path, caplog):
    def my_loss(outputs, labels, num_items_in_batch=None):
        return outputs.logits.sum()

    trainer = _trainer(tmp_path, compute_loss_func=my_loss)
    handle = apply_sebp(trainer)
    _assert_unchanged(trainer, handle)
    assert "compute_loss_func" in _one_warning(caplog)


class _Projection(torch.nn.Module):
    """A projection of a kind SEBP does not know (neither nn.Linear nor Conv1D), over a Conv1D's Parameters."""

    def __init__(self, conv):
        super().__init__()
        self.weight, self.bias = conv.weight, conv.bias

    def forward(self, x):
        return x @ self.weight + self.bias


def test_a_model_with_nothing_to_swap_leaves_the_trainer_unchanged(tmp_path, caplog):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=120, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    for name, module in list(gpt2.named_modules()):
        if type(module).__name__ == "Conv1D":
            parent, _, child = name.rpartition(".")
            setattr(gpt2.get_submodule(parent), child, _Projection(module))
    trainer = _trainer(tmp_path, model=gpt2)
    handle = apply_sebp(trainer)
    _assert_unchanged(trainer, handle)
    assert "no nn.Linear layer but its output head" in _one_warning(caplog)


def test_bad_arguments_raise_one_line(tmp_path, llama_report):
    trainer = _trainer(tmp_path)
    with pytest.raises(PatchError, match="matches no linear layer"):
        apply_sebp(trainer, targets=["no_such_proj"], calibrate=False)
    with pytest.raises(ValueError, match="unknown head"):
        apply_sebp(trainer, head="cls")
    other = _trainer(tmp_path, model=tiny_model("qwen2"))
    with pytest.raises(ReportError, match="made for"):
        apply_sebp(other, report=llama_report, calibrate=False)
    from transformers import Trainer

    no_data = Trainer(model=tiny_model("llama"), args=_args(tmp_path))
    with pytest.raises(ValueError, match="train_dataset"):
        apply_sebp(no_data)
    for t in (trainer, other, no_data):  # a failed call leaves nothing behind
        assert not any(isinstance(m, SEBPLinear) for m in t.model.modules()) and "compute_loss" not in vars(t)
        assert not _set_on(t.model)


def _set_on(model) -> list[str]:
    """The sebp attributes set on the model object itself (the chosen head travels as an object, not there)."""
    return [k for k in vars(model) if k.startswith("_sebp")]


@pytest.fixture(scope="module")
def llama_report():
    from tests.probe.test_report import _report

    return _report("llama")[0]


def test_a_report_gives_the_layers_and_undo_restores_the_plain_trainer(tmp_path, llama_report):
    trainer = _trainer(tmp_path)
    plain_loss = type(trainer).compute_loss
    handle = apply_sebp(trainer, report=llama_report, calibrate=False)
    assert apply_sebp(trainer) is handle  # a second call changes nothing
    assert set(handle.layers) == set(layer_configs_from_report(llama_report)) and handle.head == "labelled"
    assert handle.layers == {n: m.sebp_config for n, m in trainer.model.named_modules() if isinstance(m, SEBPLinear)}
    assert "compute_loss" in vars(trainer) and not _set_on(trainer.model)  # the head is the handle's, not the model's
    handle.undo()
    handle.undo()
    assert not handle.applied and "compute_loss" not in vars(trainer) and type(trainer).compute_loss is plain_loss
    assert not any(isinstance(m, SEBPLinear) for m in trainer.model.modules())
    assert not _set_on(trainer.model)
    trainer.train()
    assert apply_sebp(trainer, calibrate=False) is not handle  # applies anew after the undo


def test_an_sft_loss_it_cannot_reproduce_keeps_the_trainers_loss_with_sebp_layers(tmp_path, caplog):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    data = Dataset.from_list([{"prompt": "w1 w2 w3", "completion": " w4 w5"}, {"prompt": "w6", "completion": " w7"}])
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, use_cpu=True,
                         report_to=[], save_strategy="no", loss_type="dft", bf16=False, max_length=None)
    trainer = trl.SFTTrainer(model=tiny_model("llama"), args=args, train_dataset=data,
                             processing_class=word_tokenizer())
    handle = apply_sebp(trainer, calibrate=False)
    assert handle.applied and handle.head == "full" and "loss_type 'dft'" in handle.reason
    assert "loss_type 'dft'" in _one_warning(caplog) and "compute_loss" not in vars(trainer)
    assert handle.layers and all(isinstance(trainer.model.get_submodule(n), SEBPLinear) for n in handle.layers)
    trainer.train()
    assert torch.isfinite(torch.tensor(trainer.state.log_history[-1]["train_loss"]))


def test_liger_kernels_compose_and_a_cpu_keeps_sdpas_choice(tmp_path, caplog):
    """use_liger_kernel=True no longer leaves the trainer unchanged (Liger's kernels compose with SEBP: the GPU
    test in tests/convergence/test_hf_trainer.py); off a GPU sdpa keeps its own choice of kernel."""
    from transformers import Trainer

    trainer = Trainer(model=tiny_model("llama"), args=_args(tmp_path, use_liger_kernel=True), train_dataset=_rows())
    handle = apply_sebp(trainer, calibrate=False)
    assert handle.applied and handle.head == "labelled" and handle.layers
    assert handle.cudnn_attention is True and handle.to_dict()["cudnn_attention"] is True
    handle.undo()
    assert "compute_loss" not in vars(trainer)


def test_training_steps_run_without_cudnn_attention_and_undo_takes_it_back(tmp_path, monkeypatch):
    """Where the model's sdpa runs on a GPU, every training step (its backward, and so a checkpointed layer's
    recomputation, included) runs with cuDNN's attention off; undo puts the trainer's own step back."""
    import sebp_probe.integrations.hf as hf
    from transformers import Trainer

    monkeypatch.setattr(hf, "_sdpa_on_gpu", lambda model: True)
    seen = []

    class Watched(Trainer):
        def training_step(self, *args, **kwargs):
            seen.append(torch.backends.cuda.cudnn_sdp_enabled())
            return super().training_step(*args, **kwargs)

    trainer = Watched(model=tiny_model("llama"), args=_args(tmp_path), train_dataset=_rows())
    handle = apply_sebp(trainer, calibrate=False)
    assert handle.cudnn_attention is False and "training_step" in vars(trainer)
    trainer.train()
    assert seen == [False] and torch.backends.cuda.cudnn_sdp_enabled()
    handle.undo()
    assert "training_step" not in vars(trainer) and "compute_loss" not in vars(trainer)


def test_the_layers_know_a_batch_s_most_rows_where_the_arguments_bound_it():
    """Compiled under a trainer, the layers know a batch's most rows where the arguments bound every sequence's
    length (TRL's SFTConfig.max_length truncates to it); transformers' own arguments name none."""
    from types import SimpleNamespace

    from sebp_probe.integrations.hf import _row_bound

    assert _row_bound(SimpleNamespace(per_device_train_batch_size=4, max_length=512)) == 2048
    assert _row_bound(SimpleNamespace(per_device_train_batch_size=4, max_length=None)) is None
    assert _row_bound(SimpleNamespace(per_device_train_batch_size=4)) is None
