"""The default commands on every family of the registry (sebp_probe.families), as a new user runs them: a tiny
model of the family saved as a local directory with a tokenizer, `analyze` and `finetune --compare` with no
--targets or --head, on packed batches where the family allows them (else bucket, said in one line); SEBP
trains exactly as dense. A family without an entry (OPT) runs with its fallbacks, each said once."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from typer.testing import CliRunner

from sebp_probe.cli import app
from sebp_probe.families import FAMILIES
from tests.convergence.finetune_helpers import isolated_accelerate  # noqa: F401
from tests.tiny_models import FAMILY_TASKS, family_config

SIZES = ["--max-samples", "24", "--batch-size", "8", "--max-length", "24"]


def _save(model_type: str, path: Path) -> str:
    from sebp_probe.data.assets import minilm_dir

    tok = AutoTokenizer.from_pretrained(minilm_dir())
    auto = AutoModelForCausalLM if FAMILY_TASKS.get(model_type, "causal-lm") == "causal-lm" \
        else AutoModelForSequenceClassification
    vocab = tok.vocab_size
    for _ in range(2):
        cfg = family_config(model_type, vocab, tok.pad_token_id, tok.cls_token_id, tok.sep_token_id)
        auto.from_config(cfg).save_pretrained(path)
        tok.save_pretrained(path)
        # transformers loads the family's own tokenizer class from the saved files (Qwen2's adds <|endoftext|>):
        # the model embeds every token of that one
        vocab, before = len(AutoTokenizer.from_pretrained(path)), vocab
        if vocab == before:
            break
    return str(path)


def _notes(result) -> list[str]:
    return [x for x in result.stderr.splitlines() if x.startswith("note: ")]


def _commands(model: str, out: Path):
    runner = CliRunner()
    analyze = runner.invoke(app, ["analyze", model, "tweets", *SIZES, "--max-batches", "1", "--json"])
    finetune = runner.invoke(app, ["finetune", model, "tweets", *SIZES, "--compare", "--max-steps", "2",
                                   "--eval-samples", "8", "--padding", "packed", "-o", str(out), "--json"])
    return analyze, finetune


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(FAMILY_TASKS))
def test_default_commands_run_and_sebp_trains_as_dense(model_type, tmp_path):
    family = FAMILIES[model_type]
    analyze, finetune = _commands(_save(model_type, tmp_path / "model"), tmp_path / "run")
    assert analyze.exit_code == 0, analyze.output
    report = json.loads(analyze.stdout)
    assert report["model"]["model_type"] == model_type and report["layers"]
    assert finetune.exit_code == 0, finetune.output
    summary = json.loads(finetune.stdout)
    assert summary["comparison"]["max_abs_loss_gap"] <= 1e-5
    sebp = summary["runs"]["sebp"]
    assert sebp["padding"] == ("packed" if family.packed else "bucket")
    notes = _notes(finetune)
    assert all("--targets" not in n for n in notes)  # the entry's projections are found
    if not family.packed:
        assert any(n.startswith("note: --padding packed runs as --padding bucket:") for n in notes), notes
    if family.layer is None:
        assert any(n.startswith("note: --head labelled runs as --head full") for n in notes), notes
    assert len(notes) == len(set(notes))


@pytest.mark.slow
def test_a_family_without_an_entry_runs_with_one_line_per_fallback(tmp_path):
    analyze, finetune = _commands(_save("opt", tmp_path / "model"), tmp_path / "run")
    assert analyze.exit_code == 0, analyze.output
    assert _notes(analyze) == ["note: model type 'opt' has no entry: SEBP targets every linear but the output head "
                               "(fc1, fc2, self_attn.k_proj, self_attn.out_proj, self_attn.q_proj, "
                               "self_attn.v_proj); left dense: lm_head (Linear); choose with --targets"]
    assert finetune.exit_code == 0, finetune.output
    summary = json.loads(finetune.stdout)
    assert summary["comparison"]["max_abs_loss_gap"] <= 1e-5 and summary["runs"]["sebp"]["padding"] == "bucket"
    # a run this short also takes its SEBP calibration untimed within --calib-budget, and says so
    notes = [n for n in _notes(finetune) if not n.startswith("note: calibration: the budget")]
    assert len(notes) == 3 and len(set(notes)) == 3, notes
    assert notes[0].startswith("note: --padding packed runs as --padding bucket: padding 'packed' runs exactly "
                               "only on llama")
    assert any(n.startswith("note: model type 'opt' has no entry: SEBP targets every linear") for n in notes)
    assert "note: --head labelled runs as --head full (the model's own loss): model type 'opt' has no entry in " \
           "sebp-probe's model families" in notes
    assert not any("target_modules" in n or "backend=" in n for n in notes)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["gpt2", "albert"])
def test_the_default_command_and_sebp_on_every_projection_train_as_dense(model_type, tmp_path):
    """GPT-2's Conv1D projections and ALBERT's shared layers: the default command (`--padding auto`), and SEBP
    kept on every projection of the entry on padded batches (`--always-sebp`: calibration keeps none of these
    tiny layers), both exact."""
    model, runner = _save(model_type, tmp_path / "model"), CliRunner()
    common = ["finetune", model, "tweets", "--max-samples", "24", "--batch-size", "8", "--compare",
              "--max-steps", "2", "--eval-samples", "8", "--json"]
    default = runner.invoke(app, [*common, "--max-length", "24", "-o", str(tmp_path / "default")])
    assert default.exit_code == 0, default.output
    assert json.loads(default.stdout)["comparison"]["max_abs_loss_gap"] <= 1e-5
    forced = runner.invoke(app, [*common, "--max-length", "64", "--padding", "max_length", "--always-sebp", "-o",
                                 str(tmp_path / "forced")])
    assert forced.exit_code == 0, forced.output
    summary = json.loads(forced.stdout)
    layers = summary["runs"]["sebp"]["calibration"]["layers"]
    suffixes = {t.rsplit(".", 1)[-1] for t in FAMILIES[model_type].targets}
    assert {n.rsplit(".", 1)[-1] for n in layers} == suffixes
    assert summary["comparison"]["max_abs_loss_gap"] <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_moe_trains_as_dense_with_sebp_on_its_experts_and_the_routers_loss(model_type, tmp_path):
    """SEBP kept on (--always-sebp) on batches padded to the maximum length, the routers' load-balancing loss on:
    the experts run the SEBP backward, the labelled-rows head gives way to the model's own loss (one note), and the
    loss is dense's."""
    from transformers import AutoConfig

    model = _save(model_type, tmp_path / "model")
    cfg = AutoConfig.from_pretrained(model)
    cfg.output_router_logits = True
    cfg.save_pretrained(model)
    sizes = [*SIZES[:-1], "64"]  # tweets padded to 64 tokens: rows enough without gradient for SEBP
    finetune = CliRunner().invoke(app, ["finetune", model, "tweets", *sizes, "--compare", "--max-steps", "2",
                                        "--eval-samples", "8", "--padding", "max_length", "--always-sebp",
                                        "-o", str(tmp_path / "run"), "--json"])
    assert finetune.exit_code == 0, finetune.output
    summary = json.loads(finetune.stdout)
    assert summary["comparison"]["max_abs_loss_gap"] <= 1e-5
    assert summary["runs"]["sebp"]["calibration"]["layers"]  # SEBP ran, the experts with the projections
    notes = _notes(finetune)
    name = FAMILIES[model_type].name
    assert f"note: {name}: SEBP runs on the fused experts (mlp.experts: gate_up_proj and down_proj, backward over " \
           "their routed rows whose dL/dY is not zero) beside the projections; the router (mlp.gate) stays dense" \
           in notes, notes
    assert any(n.startswith("note: --head labelled runs as --head full") and "output_router_logits" in n
               for n in notes), notes
