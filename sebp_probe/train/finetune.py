"""Fine-tuning with SEBP linears, measured against dense: the entry point ``finetune``.

One run: seed -> load the model -> [LoRA] -> calibrate -> patch -> train -> evaluate -> save. The pieces:
:mod:`.train_data` (examples, order, batches), :mod:`.calibration` (which layers run SEBP),
:mod:`.loop` (one run), :mod:`.metrics` (what is measured), :mod:`.rundir` (the output directory).
This module checks the settings, loads the model and the report, runs dense and/or SEBP, and compares them.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from ..data.assets import LoadedModel, load_model, model_task
from .calibration import candidate_layers, measure_density, rng_devices
from .calibration_budget import CalibBudget, run_budget
from ..config import AUTO_COMPILE_MODE, COMPILE_AUTO, FinetuneConfig, FinetuneError
from ..layouts import LAYOUTS
from .determinism import NotDeterministic, deterministic
from .loop import Event, Run, graphed_compile, wrap_lora
from ..model.losses import auto_heads, choose_head
from ..model.sdpa import without_cudnn_attention
from .metrics import compare_runs, loss_gap, same_computation, timed_steps
from ..notes import collect_notes, note
from .rundir import (RUN_CONFIG, SUMMARY, SetAside, check_output_dir, check_resume_data, check_resume_processes,
                     device_name, has_progress, read_json, versions, write_json)
from .layout_prior import Timer, wall_timer
from .strategy import PaddingChoice, choose_padding
from ..data.train_data import TrainData, first_batches, load_train_data

__all__ = ["FinetuneError", "finetune"]


def _analysis_on_main(loaded: LoadedModel, cfg: FinetuneConfig, acc, progress) -> dict:
    """``--auto-eps``: the main process analyses, the others take its report (one analysis, not one per
    process). An analysis that fails stops every process with the main one's message."""
    from ..analysis.analyze import analyze_for_finetune

    if acc is None or acc.num_processes == 1:
        return analyze_for_finetune(loaded, cfg.data, progress=progress)
    from accelerate.utils import broadcast_object_list

    payload, failure = [None], None
    if acc.is_main_process:
        try:
            payload = [{"report": analyze_for_finetune(loaded, cfg.data, progress=progress)}]
        except Exception as exc:  # noqa: BLE001  (sent to the other processes, then raised here)
            failure = exc
            payload = [{"error": f"{type(exc).__name__}: {exc}"}]
    payload = broadcast_object_list(payload)[0]
    if failure is not None:
        raise failure
    if "error" in payload:
        raise FinetuneError(f"the analysis failed on the main process: {payload['error']}")
    return payload["report"]


def _load_report(cfg: FinetuneConfig, loaded: LoadedModel, out: Path, resume: bool,
                 progress: Callable[[int, int], None] | None = None, acc=None) -> dict | None:
    """The report of ``--report``, or the analysis run now (``--auto-eps``; reused when resuming; under
    data parallel only the main process analyses, see :func:`_analysis_on_main`)."""
    if not cfg.uses_report:
        return None
    from ..analysis import report as rep

    saved = out / "report.json"
    if cfg.report:
        report = rep.load_report(cfg.report)
    elif resume and saved.exists():
        report = rep.load_report(saved)
    else:
        report = _analysis_on_main(loaded, cfg, acc, progress)
    rep.check_report_for_model(report, loaded.model)
    if cfg.mode == "topk":  # N counts rows of a batch: it only means something for the batches it was measured on
        pad = report.get("padding", {})
        theirs = (pad.get("batch_size"), pad.get("max_length"), pad.get("padding"))
        ours = (cfg.data.batch_size, cfg.data.max_length, cfg.data.padding)
        if theirs != ours:
            raise FinetuneError(
                f"the report's N was measured on batches of {theirs[0]} x {theirs[1]} ({theirs[2]}); this run "
                f"uses {ours[0]} x {ours[1]} ({ours[2]}): analyze with the same --batch-size, --max-length and "
                "--padding, or use --mode threshold/exact")
    return report


def _check_some_rows_active(model, cfg: FinetuneConfig, data: TrainData, cands: dict, acc) -> None:
    model.to(acc.device).train()
    with torch.random.fork_rng(devices=rng_devices(acc.device)):
        density = measure_density(model, first_batches(cfg, data, acc.device), cands, acc.device, acc.autocast)
    model.zero_grad(set_to_none=True)
    if max(density.values()) == 0.0:
        raise FinetuneError("with these eps values no row of any layer is active on the first batches: SEBP "
                            "would drop every gradient; pick a smaller --eps (or use --auto-eps)")


def finetune(cfg: FinetuneConfig, *, resume: bool = False, overwrite: bool = False, on_event: Event | None = None,
             load_fn: Callable[[], LoadedModel] | None = None, data: TrainData | None = None,
             padding_timer: Timer = wall_timer) -> dict:
    """Train ``cfg.method`` (or dense then SEBP with ``cfg.compare``), write the output directory, and return
    the summary. ``load_fn``/``data`` replace the asset loading (the GPU script uses models built from
    configs and synthetic batches); ``padding_timer`` times ``--padding auto``'s passes (tests pass one that
    returns chosen times; :data:`~.layout_prior.Timer`). Every note of the run (:mod:`.notes`: the data's, a
    family's fallbacks, the checkpoint resumed from) is one ``note`` event and a line of the summary's
    ``notes``. sdpa runs without cuDNN's attention throughout (:mod:`~sebp_probe.model.sdpa`), unless every batch has one shape
    (``max_length``); ``cfg.deterministic`` runs it under :func:`~.determinism.deterministic`. Raises
    FinetuneError for bad input, a diverged run included (and an op that has no deterministic implementation
    under ``--deterministic``)."""
    emit = on_event or (lambda kind, payload: None)
    # the whole run (calibration, --padding auto's timings, training) on the same attention kernels; batches
    # of one shape (max_length) leave sdpa its choice: cuDNN then plans once
    attention = contextlib.nullcontext() if cfg.data.padding == "max_length" else without_cudnn_attention()
    try:
        with collect_notes(lambda text: emit("note", {"text": text})) as notes, attention, \
                deterministic(cfg.deterministic):
            return _finetune(cfg, resume, overwrite, emit, load_fn, data, notes, padding_timer)
    except NotDeterministic as e:
        raise FinetuneError(str(e)) from None


def _finetune(cfg: FinetuneConfig, resume: bool, overwrite: bool, emit: Event,
              load_fn: Callable[[], LoadedModel] | None, data: TrainData | None, notes: list[str],
              padding_timer: Timer = wall_timer) -> dict:
    """Check the settings, load the first model, data and report, choose the layout; only then write the
    output directory, run the plan and summarize it."""
    acc = _accelerator(cfg)
    out = Path(cfg.output_dir)
    resuming, stale = check_output_dir(cfg, resume, overwrite)
    if resuming:
        check_resume_processes(out, acc.num_processes)
    from accelerate.utils import set_seed

    set_seed(cfg.seed)  # the new head's initialization and the --auto-eps analysis are part of the run
    load_fn, first, data = _first_model_and_data(cfg, load_fn, data)
    if resuming:
        check_resume_data(out, data.identity)
    for part in data.identity.values():
        for line in part.get("notes", []) if isinstance(part, dict) else []:
            note(line)
    cfg = _packed_or_bucket(cfg, first)
    if cfg.auto_eps and not resuming:
        first.model.to(acc.device)
    report = _load_report(cfg, first, out, resuming,
                          progress=lambda done, total: emit("analysis", {"done": done, "total": total}), acc=acc)
    report_layers = _report_layers(cfg, report)
    _check_sebp_candidates(cfg, first, data, report_layers, acc)
    choice = None
    if cfg.data.padding == "auto":
        choice = _padding_choice(cfg, first, data, report_layers, acc, out if resuming else None,
                                 say=lambda text: emit("calibrating", {"text": text}), timer=padding_timer)
        emit("padding", choice.to_dict())
    del first
    plan = _run_plan(cfg, choice)
    line = _compiled_sebp_note(plan)
    if line:
        emit("note", {"text": line})
    # Everything is checked: only now is an old run set aside (deleted once the new one has taken a step) and
    # the new one written.
    made_dir = not out.exists()
    aside = _start_output(cfg, out, stale, resuming, report, choice, data, acc)
    budget = run_budget(cfg, len(data.train), choice and choice.to_dict(), padding_timer)
    summaries, records = _run_plan_runs(plan, cfg, out, acc, data, load_fn, report_layers, resuming, made_dir,
                                        aside, emit, budget)
    restored = aside is not None and bool(aside.names)
    if restored:  # no step taken (diverged at the first): the old run stays as it was, its plots included
        aside.restore()
    summary = _overall_summary(cfg, plan, choice, summaries, records, out, notes)
    if acc.is_main_process and not restored:
        if cfg.compare:
            write_json(out / SUMMARY, summary)
        summary["plots"] = _plot(records, out)
    acc.wait_for_everyone()
    acc.end_training()
    err = next((s.get("error") for s in summaries.values() if s.get("error")), None)
    if err:
        raise FinetuneError(err)
    return summary


def _accelerator(cfg: FinetuneConfig):
    """The run's ``Accelerator``, refused where accelerate would compile on its own, where each process would
    train alone, or where CUDA graphs cannot run."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    if cfg.precision == "fp16" and not torch.cuda.is_available():
        raise FinetuneError("fp16 training needs a CUDA GPU; use --bf16 on CPU")
    dynamo = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no")
    if dynamo.lower() not in ("", "no"):
        raise FinetuneError(f"ACCELERATE_DYNAMO_BACKEND={dynamo} is set (accelerate's config, or TrainingArguments("
                            "torch_compile=True) earlier in this process); finetune compiles only with --compile "
                            "MODE, which knows the SEBP layers: unset it")
    # dynamo_backend="no": accelerate's own compile (from the environment) would bypass --compile's checks
    # non_blocking: batches (page-locked on a GPU, see make_loaders) go to the device without waiting for it
    acc = Accelerator(mixed_precision={"fp32": "no"}.get(cfg.precision, cfg.precision), dynamo_backend="no",
                      dataloader_config=DataLoaderConfiguration(non_blocking=torch.cuda.is_available()))
    backend = acc.state.dynamo_plugin.backend  # the process's state: the first Accelerator's settings hold
    backend = str(getattr(backend, "value", backend))
    if backend.lower() != "no":
        raise FinetuneError(f"accelerate in this process already compiles every model it prepares (dynamo backend "
                            f"{backend}, from an earlier Accelerator or TrainingArguments("
                            "torch_compile=True)); finetune compiles only with --compile MODE: run it in a fresh "
                            "process")
    world = os.environ.get("WORLD_SIZE", "1")
    if world.isdigit() and int(world) > 1 and acc.num_processes == 1:
        # torchrun on CPU without ACCELERATE_USE_CPU: accelerate runs every process as its own single-process
        # training, all writing the same output directory
        raise FinetuneError(f"launched as {world} processes (WORLD_SIZE={world}) but accelerate runs each as its "
                            "own training, which would overwrite each other's output; on CPU set "
                            "ACCELERATE_USE_CPU=1 (or use accelerate launch --cpu)")
    if cfg.cuda_graphs:
        _check_graphs_possible(cfg, acc)
    if graphed_compile(cfg, acc):
        _check_graphs_possible(cfg, acc, f"--compile {cfg.compile}")
    return acc


def _first_model_and_data(cfg: FinetuneConfig, load_fn: Callable[[], LoadedModel] | None,
                          data: TrainData | None) -> tuple[Callable[[], LoadedModel], LoadedModel, TrainData]:
    """(how each run loads its model, the first model, the data): from the assets unless given."""
    if load_fn is None:
        task = model_task(cfg.model, cfg.task, cfg.data.max_length)
        if data is None:
            probe = load_model(cfg.model, task)  # the tokenizer, and the labels that size the head
            data = load_train_data(cfg, probe)
            del probe
        labels = list(data.label_names) or None
        load_fn = lambda: load_model(cfg.model, task, label_names=labels)  # noqa: E731
        first = load_fn()
    else:
        first = load_fn()
        if data is None:
            data = load_train_data(cfg, first)
    return load_fn, first, data


def _report_layers(cfg: FinetuneConfig, report: dict | None) -> dict | None:
    """No --mode: each layer's recommendation (threshold where the analysis found a knee, else exact)."""
    if report is None:
        return None
    from ..analysis.report import layer_configs_from_report

    return layer_configs_from_report(report, cfg.mode, backend=cfg.backend)


def _check_sebp_candidates(cfg: FinetuneConfig, first: LoadedModel, data: TrainData, report_layers: dict | None,
                           acc) -> None:
    """Bad targets and an eps that drops everything fail before anything is written."""
    if "sebp" not in cfg.methods():
        return
    cands = candidate_layers(first.model, cfg, report_layers)
    if any(c.mode == "threshold" and c.eps > 0 for c in cands.values()):
        _check_some_rows_active(first.model, cfg, data, cands, acc)


def _start_output(cfg: FinetuneConfig, out: Path, stale, resuming: bool, report: dict | None,
                  choice: PaddingChoice | None, data: TrainData, acc) -> SetAside | None:
    """Set an old run aside (main process; returned) and write the new run's report and settings."""
    aside = None
    if acc.is_main_process:
        aside = SetAside(out, stale)
        out.mkdir(parents=True, exist_ok=True)
        if report is not None and cfg.auto_eps and not resuming:
            from ..analysis.report import save_report

            save_report(report, out / "report.json")
        if not resuming:
            write_json(out / RUN_CONFIG, {
                "tool": "sebp-probe finetune", "created": datetime.datetime.now().isoformat(timespec="seconds"),
                "config": cfg.to_dict(), "versions": versions(), "device": device_name(acc.device),
                "num_processes": acc.num_processes, "data": data.identity,
                "train_examples": len(data.train), "eval_examples": len(data.eval),
                **({"padding_choice": choice.to_dict()} if choice else {})})
    acc.wait_for_everyone()
    return aside


def _run_plan_runs(plan: list[tuple[str, FinetuneConfig]], cfg: FinetuneConfig, out: Path, acc, data: TrainData,
                   load_fn: Callable[[], LoadedModel], report_layers: dict | None, resuming: bool, made_dir: bool,
                   aside: SetAside | None, emit: Event, budget: CalibBudget | None = None) -> tuple[dict, dict]:
    """Each run of the plan in order, until one does not complete: (method -> summary, method -> records). A
    failure before any step leaves no trace of the new run (the old one restored). ``budget``: the SEBP
    calibration's (what ``--padding auto`` left of ``--calib-budget``)."""

    def on_run_event(kind: str, payload: dict) -> None:
        if kind == "note":  # the run's notes take the one channel (said once, listed in the summary)
            note(payload["text"])
            return
        if kind == "step" and aside is not None:  # the new run has taken its first step: the old one goes
            aside.discard()
        emit(kind, payload)

    summaries, records, dense_steps = {}, {}, None
    try:
        for method, run_cfg in plan:
            run_dir = out / method if cfg.compare else out
            if run_cfg.compile and summaries:  # compiles afresh, as the first run did, not past its graphs
                torch._dynamo.reset()
            run = Run(run_cfg, method, run_dir, acc, data, load_fn, report_layers, dense_steps, on_run_event, budget)
            summaries[method] = run.run(resuming)
            records[method] = run.records
            if method == "dense" and _same_batches(plan):  # the other run's progress compares with its steps
                dense_steps = {s: r["backward_ms"] for s, r in timed_steps(run.records).items()}
            if summaries[method]["status"] != "completed":
                break
    except BaseException:
        if not resuming and acc.is_main_process and not has_progress(out):  # failed before any step: leave no trace
            aside.restore()
            if made_dir:
                out.rmdir()
        elif aside is not None:
            aside.discard()
        raise
    return summaries, records


def _overall_summary(cfg: FinetuneConfig, plan: list[tuple[str, FinetuneConfig]], choice: PaddingChoice | None,
                     summaries: dict, records: dict, out: Path, notes: list[str]) -> dict:
    """The one run's summary, or with ``--compare`` both runs' and their comparison; the worst status."""
    summaries = {m: summaries[m] for m in ("dense", cfg.method) if m in summaries}  # dense first, whatever the order
    records = {m: records[m] for m in summaries if m in records}
    paddings = {m: c.data.padding for m, c in plan}
    for m, s in summaries.items():
        s["padding"] = paddings[m]
        kept = same_computation(s)
        if kept:  # said in the final table too, not only in the calibration line
            mode = cfg.sebp_mode
            s["kept_dense"] = kept + ("" if mode == "exact" else f"; the approximate --mode {mode} was not applied")
    summary = dict(summaries[plan[0][0]]) if not cfg.compare else {"runs": summaries, "order": [m for m, _ in plan]}
    if choice is not None:
        summary["padding_choice"] = choice.to_dict()
    other = cfg.method
    if cfg.compare and all(summaries.get(m, {}).get("status") == "completed" for m in ("dense", other)):
        same_batches = _same_batches(plan)
        summary["comparison"] = compare_runs(summaries["dense"], summaries[other], records["dense"],
                                             records[other], paired=same_batches, same_setup=_same_setup(plan))
        # the same sequences in every step unless one of the runs drew length-grouped batches
        same_seqs = same_batches or not any(LAYOUTS[p].grouped for p in paddings.values())
        summary["comparison"]["max_abs_loss_gap"] = loss_gap(records["dense"], records[other]) if same_seqs \
            else None
    statuses = [s["status"] for s in summaries.values()]
    summary["status"] = next((s for s in ("diverged", "interrupted") if s in statuses), "completed")
    summary["output_dir"] = str(out)
    summary["notes"] = notes
    return summary


def _same_batches(plan: list[tuple[str, FinetuneConfig]]) -> bool:
    """Do the runs of the plan draw the same batches in every step (one layout)?"""
    return len({c.data.padding for _, c in plan}) == 1


def _same_setup(plan: list[tuple[str, FinetuneConfig]]) -> bool:
    """Do the runs of the plan differ only in their method: one layout (the same batches), one head, one compile
    setting? Only then can an SEBP run that patched nothing have computed what dense did."""
    return len({(c.data.padding, c.head, c.compile) for _, c in plan}) == 1


def _padding_choice(cfg: FinetuneConfig, first: LoadedModel, data: TrainData, report_layers: dict | None, acc,
                    resumed_from: Path | None, say: Callable[[str], None] | None = None,
                    timer: Timer = wall_timer) -> PaddingChoice:
    """``--padding auto``: the layouts measured on the first model (LoRA-wrapped as the runs will be), or, when
    resuming, the choice the run made at its start; chosen once, before any run (``--compare``: both runs take
    it). Under data parallel the main process measures and the others take its choice. ``say``: its progress,
    one line a phase and a candidate; ``timer``: times one pass (:data:`~.layout_prior.Timer`)."""
    if resumed_from is not None:
        stored = (read_json(resumed_from / RUN_CONFIG) or {}).get("padding_choice")
        if stored:
            return PaddingChoice.from_dict(stored)
    model = wrap_lora(first.model, first.task, cfg) if cfg.lora else first.model
    model.to(acc.device).train()
    head, _ = choose_head(model, first.task, cfg.head, acc.num_processes, cfg.cuda_graphs, cfg.compile is not None,
                          cfg.data.padding)
    cands = candidate_layers(model, cfg, report_layers) if "sebp" in cfg.methods() else {}
    payload = [None]
    if acc.is_main_process:
        graphs = cfg.cuda_graphs or graphed_compile(cfg, acc)
        heads = auto_heads(model, first.task, head.kind, acc.device, acc.num_processes)
        choice = choose_padding(model, cfg, data, cands, acc.device, acc.autocast, graphs, heads=heads, timer=timer,
                                say=say, head=head)
        choice.processes = acc.num_processes
        payload = [choice.to_dict()]
    if acc.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        payload = broadcast_object_list(payload)
    return PaddingChoice.from_dict(payload[0])


def _packed_or_bucket(cfg: FinetuneConfig, first: LoadedModel) -> FinetuneConfig:
    """``--padding packed`` on a model it cannot run exactly becomes ``bucket`` (the layout nearest to it), said
    in one line."""
    if cfg.data.padding != "packed":
        return cfg
    from ..data.batching import PackingError
    from ..model.packing import check_packable

    try:
        check_packable(first.model, first.task)
    except PackingError as e:
        note(f"--padding packed runs as --padding bucket: {e}")
        return replace(cfg, data=replace(cfg.data, padding="bucket"))
    return cfg


def _run_plan(cfg: FinetuneConfig, choice: PaddingChoice | None) -> list[tuple[str, FinetuneConfig]]:
    """(method, its run's settings) in training order. Under ``auto`` every run takes the one choice: its layout,
    head and compile setting (with ``--compare`` dense and SEBP on the same batches, so that they compare); the
    method is the choice's (dense too, if SEBP did not beat it), or with ``--compare`` (and resprop) each of
    the run's."""
    if choice is None:
        return [(m, cfg) for m in cfg.methods()]
    methods = cfg.methods() if cfg.compare or cfg.method == "resprop" else (choice.method,)
    compiled = cfg.compile if cfg.compile != COMPILE_AUTO else (AUTO_COMPILE_MODE if choice.compiled else None)
    run_cfg = replace(cfg, data=replace(cfg.data, padding=choice.padding), head=choice.head or cfg.head,
                      compile=compiled)
    return [(m, run_cfg) for m in methods]


def _compiled_sebp_note(plan: list[tuple[str, FinetuneConfig]]) -> str | None:
    """One line where an SEBP run compiles: what SEBP covers under Inductor (the linears; the norms and
    activations only where the user asked for them, as opaque ops Inductor cannot fuse)."""
    cfg = next((c for m, c in plan if m == "sebp" and c.compile), None)
    if cfg is None:
        return None
    forced = [f for f, on in (("--sebp-norms", cfg.sebp_norms), ("--sebp-acts", cfg.sebp_acts)) if on]
    if forced:
        return (f"--compile with {' and '.join(forced)}: those run as opaque sebp:: ops, which keep Inductor from "
                "fusing them with the residual adds around them")
    return ("--compile: SEBP runs on the linear layers only; the norms and activations are left to Inductor, which "
            "fuses them with the residual adds (--sebp-norms / --sebp-acts put them on SEBP)")


def _check_graphs_possible(cfg: FinetuneConfig, acc, what: str = "--cuda-graphs") -> None:
    """``--cuda-graphs`` (or a ``--compile`` mode that records CUDA graphs) needs one process on a CUDA GPU,
    and the Triton kernels where SEBP runs."""
    if acc.device.type != "cuda":
        raise FinetuneError(f"{what} needs a CUDA GPU; this run is on {acc.device.type}")
    if acc.num_processes > 1:
        raise FinetuneError(f"{what} trains in one process; this run has {acc.num_processes} (DDP's "
                            "gradient hooks are not captured)")
    if "sebp" in cfg.methods():
        from sebp_kernels.functional import _triton_backward

        if cfg.backend == "torch" or _triton_backward() is None:
            raise FinetuneError(f"{what} needs the Triton SEBP kernels (triton is not importable or the "
                                "torch backend was chosen): the torch path syncs with the host")


def _plot(records: dict[str, list[dict]], out: Path) -> list[str]:
    from ..analysis.plots import plot_training_curves

    return [str(p) for p in plot_training_curves(records, out)]
