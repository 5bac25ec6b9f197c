"""apply_sebp(trainer, mode="sampled", budget=...): the targets sample their rows (approximate), calibration's
passes leave no draws behind, and bad settings raise one line."""
from __future__ import annotations

import pytest

from sebp_kernels import SEBPLinear
from sebp_probe.integrations.hf import apply_sebp
from sebp_probe.model.sampled import sampled_summary
from tests.convergence.finetune_helpers import isolated_accelerate  # noqa: F401 (a fresh accelerate state per test)
from tests.probe.test_hf_integration import _trainer


def test_sampled_mode_reaches_the_layers_and_trains(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.args.max_steps = 2
    handle = apply_sebp(trainer, mode="sampled", budget=0.5, calib_batches=1)
    layers = [m for m in trainer.model.modules() if isinstance(m, SEBPLinear)]
    assert layers and all(m.sebp_config.mode == "sampled" and m.sebp_config.budget == 0.5 for m in layers)
    assert all(m.sebp_config.seed == trainer.args.seed for m in layers)
    assert all(m._sebp_sampler.calls == 0 for m in layers)  # calibration's backwards are not the run's
    assert len({m._sebp_sampler.layer_key for m in layers}) == len(layers)
    trainer.train()
    s = sampled_summary(trainer.model)
    assert s["approximate"] and s["nonzero"] > 0 and 0 < s["kept"] < s["nonzero"]
    assert all(m._sebp_sampler.calls == 2 for m in layers)
    handle.undo()
    assert not any(isinstance(m, SEBPLinear) for m in trainer.model.modules())


def test_sampled_mode_without_a_budget_is_auto(tmp_path):
    trainer = _trainer(tmp_path)
    handle = apply_sebp(trainer, mode="sampled", calibrate=False, variance_tau=0.1)
    layers = [m for m in trainer.model.modules() if isinstance(m, SEBPLinear)]
    assert layers and all(m.sebp_config.budget == "auto" for m in layers)
    assert all(m.sebp_config.variance_tau == 0.1 for m in layers)
    handle.undo()


def test_bad_sampled_settings_raise_one_line(tmp_path):
    trainer = _trainer(tmp_path)
    with pytest.raises(ValueError, match="or auto"):
        apply_sebp(trainer, mode="sampled", budget="half", calibrate=False)
    with pytest.raises(ValueError, match="share in \\(0, 1\\]"):
        apply_sebp(trainer, mode="sampled", budget=2.0, calibrate=False)
    with pytest.raises(ValueError, match="mode must be exact or sampled"):
        apply_sebp(trainer, mode="topk", calibrate=False)
    assert not any(isinstance(m, SEBPLinear) for m in trainer.model.modules())
