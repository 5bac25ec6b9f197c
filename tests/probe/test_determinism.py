"""``finetune --deterministic``: torch's deterministic algorithms for the whole run, put back after it; an op
without a deterministic implementation ends the run in one line."""
from __future__ import annotations

import json

import pytest
import torch

from sebp_probe.config import DataConfig, FinetuneConfig, FinetuneError
from sebp_probe.data.assets import LoadedModel
from sebp_probe.model.losses import Head
from sebp_probe.train import finetune as ft
from sebp_probe.train import checkpoints, loop, rundir
from sebp_probe.train.determinism import CUBLAS_WORKSPACE, NotDeterministic, deterministic
from tests.convergence.finetune_helpers import isolated_accelerate, synthetic_data  # noqa: F401
from tests.tiny_models import tiny_model

# what torch raises for such an op (e.g. a CUDA index_add_ in strict mode); no CPU op of the run raises it
_TORCH_MESSAGE = ("index_add_cuda_ does not have a deterministic implementation, but you set "
                  "'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for this "
                  "operation, or you can use the 'warn_only=True' option, if that's acceptable for your "
                  "application.\nMore lines")


def _flags():
    return (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark)


def test_the_settings_hold_within_the_block_and_are_put_back(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = _flags()
    assert not before[0]
    with deterministic(True):
        assert _flags() == (True, True, False)
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # strict: nothing nondeterministic runs
        import os

        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE
    assert _flags() == before
    with deterministic(False):
        assert _flags() == before


def test_a_users_cublas_workspace_setting_is_kept(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    with deterministic(True):
        import os

        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_an_op_without_a_deterministic_implementation_is_one_line():
    with pytest.raises(NotDeterministic) as e, deterministic(True):
        raise RuntimeError(_TORCH_MESSAGE)
    assert str(e.value).startswith("--deterministic: index_add_cuda_ does not have a deterministic")
    assert "\n" not in str(e.value)
    assert not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(RuntimeError, match="something else"), deterministic(True):  # other errors pass as they are
        raise RuntimeError("something else")


def _run(tmp_path, name, **kw):
    data = synthetic_data("causal-lm", n=24, n_eval=8, prompt=0.5)
    load = lambda: LoadedModel(tiny_model("llama"), None, data.task, "tiny", "config")  # noqa: E731
    settings = dict(model="tiny", data=DataConfig(max_length=24, batch_size=8, padding="longest"),
                    output_dir=str(tmp_path / name), max_steps=2, method="dense", seed=0, eval_samples=8,
                    warmup_ratio=0.0)
    cfg = FinetuneConfig(**{**settings, **kw})
    return ft.finetune(cfg, load_fn=load, data=data)


def test_a_deterministic_run_trains_under_the_settings_and_records_them(tmp_path, monkeypatch):
    seen, real = [], Head.loss
    monkeypatch.setattr(Head, "loss", lambda *a, **k: seen.append(_flags()) or real(*a, **k))
    before = _flags()
    summary = _run(tmp_path, "det", deterministic=True)
    assert summary["status"] == "completed"
    assert len(seen) >= 2 and all(f == (True, True, False) for f in seen)
    assert _flags() == before
    assert json.loads((tmp_path / "det" / rundir.RUN_CONFIG).read_text())["config"]["deterministic"] is True
    seen.clear()
    _run(tmp_path, "plain")
    assert seen and all(f == before for f in seen)


def test_an_op_that_cannot_run_deterministically_ends_the_run_in_one_line(tmp_path, monkeypatch):
    def refuse(*a, **k):
        if torch.are_deterministic_algorithms_enabled():
            raise RuntimeError(_TORCH_MESSAGE)
        raise AssertionError("the run's step ran without the deterministic settings")

    monkeypatch.setattr(Head, "loss", refuse)
    with pytest.raises(FinetuneError, match=r"^--deterministic: index_add_cuda_ does not have a deterministic "
                                            r"implementation, but you set .*application\.$"):
        _run(tmp_path, "det", deterministic=True)
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.gpu
def test_two_deterministic_runs_on_a_gpu_compute_the_same_bits(tmp_path):
    """bf16 on a GPU: sdpa's attention backward and cuBLAS deterministic, every logged loss and the final
    parameters bit-equal between two runs of one command."""
    runs = [_run(tmp_path, f"run{i}", deterministic=True, precision="bf16", max_steps=4) for i in range(2)]
    assert all(r["status"] == "completed" for r in runs)
    losses = [[json.loads(x)["loss"] for x in (tmp_path / f"run{i}" / "metrics.jsonl").read_text().splitlines()
               if json.loads(x)["type"] == "train"] for i in range(2)]
    assert len(losses[0]) == 4 and losses[0] == losses[1]


def test_a_checkpoint_keeps_the_padding_row_verdict_and_a_resume_restores_it(tmp_path, monkeypatch):
    """The state file of every checkpoint holds each process's verdict and the linears that select their own
    rows; the resumed run hands its own to restore_pad_rows after patching (on a CPU the torch backward never
    checks, so the verdict and the linears are given here)."""
    import os
    import signal

    from sebp_probe.model.patch import pad_rows_of, pad_rows_own

    own = "model.layers.1.mlp.down_proj"
    monkeypatch.setattr(checkpoints, "pad_rows_verdict", lambda model: "on")
    monkeypatch.setattr(checkpoints, "pad_rows_own", lambda model: [own])
    restored, real_restore = [], loop.restore_pad_rows

    def restore(model, verdict, names):  # the resumed model's own PadRows takes it (it exists by then)
        real_restore(model, verdict, names)
        restored.append((verdict, pad_rows_of(model).state, pad_rows_own(model)))

    monkeypatch.setattr(loop, "restore_pad_rows", restore)

    def kill_at_1(kind, p):
        if kind == "step" and p["step"] == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    data = synthetic_data("causal-lm", n=24, n_eval=8, prompt=0.5)
    load = lambda: LoadedModel(tiny_model("llama"), None, data.task, "tiny", "config")  # noqa: E731
    cfg = FinetuneConfig(model="tiny", data=DataConfig(max_length=24, batch_size=8, padding="longest"),
                         output_dir=str(tmp_path / "run"), max_steps=2, method="sebp", seed=0, eval_samples=8,
                         warmup_ratio=0.0, fallback_if_slower=False, dense_fallback=1.0)
    assert ft.finetune(cfg, load_fn=load, data=data, on_event=kill_at_1)["status"] == "interrupted"
    state = json.loads((rundir.list_checkpoints(tmp_path / "run")[-1] / rundir.STATE).read_text())
    assert state["pad_rows"] == ["on"] and state["pad_rows_own"] == [[own]] and restored == []
    assert ft.finetune(cfg, resume=True, load_fn=load, data=data)["status"] == "completed"
    assert restored == [("on", "on", [own])]
