"""A run's files on disk: its checkpoints (written atomically, restored on --resume) and the final model.

A checkpoint folder holds accelerate's state (model.safetensors, optimizer, RNG states) and, for a model that
is not a LoRA adapter, the model's config.json and tokenizer beside it: a Hugging Face directory that
``from_pretrained`` and ``sebp-probe analyze`` load (the weights of that step). The functions take the
:class:`~sebp_probe.train.loop.Run` they work for.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..data.assets import LoadedModel
from ..model.patch import pad_rows_own, pad_rows_verdict
from ..model.sampled import sampler_states
from .rundir import CHECKPOINTS, METRICS, MODEL_DIR, STATE, list_checkpoints, read_json, write_json


def save_checkpoint(run, step: int, calib: dict | None, model) -> Path:
    """Write the checkpoint of ``step`` atomically: into ``.partial-step-N``, its state file last, then
    renamed to ``step-N``; a write cut short never looks like a checkpoint. The state file keeps, besides
    the SEBP layers, each process's padding-row verdict and the linears that select their own rows
    (:func:`restore_pad_rows`)."""
    from accelerate.utils import gather_object

    from .rundir import PARTIAL

    mine = [pad_rows_verdict(model), pad_rows_own(model), sampler_states(model)]  # the verdict first: it may
    # decide the own rows; sampled mode: each layer's cutoff and draw counter
    pairs = gather_object([mine]) if run.acc.num_processes > 1 else [mine]
    verdicts, owns, samplers = [p[0] for p in pairs], [p[1] for p in pairs], [p[2] for p in pairs]

    path = run.dir / CHECKPOINTS / f"step-{step:06d}"
    tmp = path.with_name(PARTIAL + path.name)
    if run.main:  # every process writes its shards into the folder (FSDP): it exists before they start
        if tmp.exists():  # left by a write cut short at this step: start it afresh
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    run.acc.wait_for_everyone()
    run.acc.save_state(str(tmp))
    run.acc.wait_for_everyone()  # every process's shards are written before the state file marks it complete
    if run.main:
        _loadable(run, model, tmp)
        layers = (calib or {}).get("layers", {})
        write_json(tmp / STATE, {"step": step, "layers": layers, "calibration": calib, "pad_rows": verdicts,
                                  "pad_rows_own": owns, **({"sampler": samplers} if any(samplers) else {})})
        if path.exists():  # an incomplete folder of the same step (written before checkpoints were atomic)
            shutil.rmtree(path)
        tmp.rename(path)
        for old in list_checkpoints(run.dir)[: -run.cfg.save_total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    run.acc.wait_for_everyone()
    return path


def restore(run) -> dict | None:
    """The state of the last complete checkpoint (None: none, start afresh), the metrics cut back to its
    step; says which checkpoint it took and which incomplete ones it passed over."""
    from .rundir import partial_checkpoints

    ckpts, partial = list_checkpoints(run.dir), partial_checkpoints(run.dir)
    skipped = f"; passed over incomplete {', '.join(p.name for p in partial)} (a write cut short)" \
        if partial else ""
    if not ckpts:
        run.emit("note", {"run": run.method, "text": f"{run.method}: no complete checkpoint in "
                           f"{run.dir / CHECKPOINTS}: starting from step 0{skipped}"})
        if run.main:
            (run.dir / METRICS).unlink(missing_ok=True)
        return None
    state = read_json(ckpts[-1] / STATE)
    state["path"] = str(ckpts[-1])
    run.emit("note", {"run": run.method, "text": f"{run.method}: resuming from {ckpts[-1]} (step "
                       f"{state['step']}){skipped}"})
    kept = []
    if (run.dir / METRICS).exists():
        for line in (run.dir / METRICS).read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill
            if rec.get("step", 0) <= state["step"]:
                kept.append(rec)
    run.records = kept
    if run.main:
        tmp = run.dir / (METRICS + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(run.dir / METRICS)
    return state


def save_model(run, model, loaded: LoadedModel) -> None:
    """The fine-tuned model as a plain Hugging Face model: LoRA merged, SEBP layers back to nn.Linear."""
    from ..model.patch import unpatch_model

    from accelerate.utils import DistributedType

    run.acc.wait_for_everyone()
    sharded = run.acc.distributed_type == DistributedType.FSDP
    state_dict = run.acc.get_state_dict(model) if sharded else None  # gathered: every rank takes part
    plain = run.acc.unwrap_model(model)
    if run.cfg.lora and sharded:  # the shards cannot merge in place: merge the gathered weights
        from .lora_merge import lora_scalings, merge_lora_state

        scalings = lora_scalings(plain)
        state_dict = merge_lora_state(state_dict, scalings) if run.main else None
        plain = plain.get_base_model()
    elif run.cfg.lora:
        plain = plain.merge_and_unload()
    unpatch_model(plain)
    if run.main:
        from transformers.utils import logging as hf_logging

        target = run.dir / MODEL_DIR
        hf_logging.disable_progress_bar()
        try:
            plain.save_pretrained(target, state_dict=state_dict, safe_serialization=True)
        finally:
            hf_logging.enable_progress_bar()
        if loaded.tokenizer is not None and hasattr(loaded.tokenizer, "save_pretrained"):
            loaded.tokenizer.save_pretrained(target)
    run.acc.wait_for_everyone()

def _loadable(run, model, folder: Path) -> None:
    """config.json and the tokenizer beside the checkpoint's model.safetensors, so that the folder loads as the
    model of that step. Not for LoRA runs: their weights are the adapter's wrapped names, which a plain model
    would not read (it would load the base weights without a word)."""
    if run.cfg.lora or not (folder / "model.safetensors").exists():
        return
    plain = run.acc.unwrap_model(model)
    config = getattr(plain, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    config.save_pretrained(folder)
    tokenizer = getattr(run, "tokenizer", None)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(folder)
