"""One training run (dense or SEBP) on accelerate's ``Accelerator``: set up, train, evaluate, checkpoint, save.

* ``accelerate launch`` / ``torchrun`` give DDP through ``Accelerator.prepare``; there is no communication
  code here beyond accelerate's reduce/gather/trigger calls.
* SIGINT/SIGTERM set a flag; at the next step boundary every process checkpoints and the run ends
  ``interrupted``. A non-finite loss stops before the optimizer step and keeps the earlier checkpoints.
* Resuming restores the RNG states with ``Accelerator.load_state`` and skips to the same batch, so a resumed
  run reaches the uninterrupted run's result.
"""
from __future__ import annotations

import gc
import json
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from sebp_kernels import SEBPConfig, label_checks

from ..data.assets import LoadedModel
from .calibration import CalibBudget, Calibration, apply_sebp, calibrate, candidate_layers, sync, take_main_choice
from .compiling import compile_layers_or_eager, compile_or_eager, compiles_whole, dynamo_counts, evaluating_eagerly
from ..config import GRAPHED_COMPILE_MODES, FinetuneConfig, FinetuneError
from ..layouts import LAYOUTS
from ..model.losses import choose_head, ready_to_compile
from .metrics import MIN_TIMED_STEPS, evaluate, peak_memory_mb, summarize_records
from ..model.patch import find_targets, pad_rows_of, pad_rows_summary, patched_activations, restore_pad_rows
from ..model.sampled import load_sampler_states, reset_samplers, sampled_summary
from .sample_guard import SampleGuard, guard_summary
from .checkpoints import restore, save_checkpoint, save_model
from .probe_steps import StepProbe, probe_summary
from .rundir import METRICS, MODEL_DIR, SUMMARY, device_name, read_json, write_json
from ..data.train_data import TrainData, first_batches, make_loaders, most_rows
from .train_step import UNTIMED, MicroBatches, StepTally, StopRequest, untimed_reason

Event = Callable[[str, dict], None]


def wrap_lora(model: torch.nn.Module, task: str, cfg: FinetuneConfig) -> torch.nn.Module:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise FinetuneError("--lora needs the 'peft' package: pip install peft") from None
    targets = find_targets(model, list(cfg.targets) if cfg.targets else None)
    lcfg = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules=targets,
                      task_type={"classification": "SEQ_CLS", "causal-lm": "CAUSAL_LM"}.get(task))
    return get_peft_model(model, lcfg)


def make_optimizer(params: list, cfg: FinetuneConfig) -> torch.optim.Optimizer:
    """AdamW in its fused implementation (one kernel per parameter group and dtype, on the GPU and the CPU), as
    Hugging Face's ``Trainer`` uses by default; the same update rule as the default multi-tensor one. On the GPU
    the multi-tensor one took 6-7 ms of host time a step for BERT-base, longer than the GPU needed for it
    (torch.profiler over training steps); on the CPU it took several times the fused one's time for MiniLM's
    22.7M parameters (results/tuning/adamw_cpu.json). A torch without the fused kernel for these parameters
    gets the default."""
    if params and all(p.is_floating_point() and p.device.type in ("cuda", "cpu") for p in params):
        try:
            return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
        except (RuntimeError, ValueError):  # a parameter kind or torch the fused kernel does not take
            pass
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _lr_at(step: int, total: int, cfg: FinetuneConfig) -> float:
    warm = int(total * cfg.warmup_ratio)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    return cfg.lr * max(0.0, (total - step) / max(1, total - warm))


def _warm_cublas(device: torch.device) -> None:
    """Make torch allocate the current stream's cuBLAS workspace now: it lives as long as the process, so the
    first run of a --compare would count it in its peak and the second not. An eager run's first step
    allocated it anyway; with --cuda-graphs the dense run's first matmul on this stream came with its final
    evaluation, and the SEBP run's steps then carried 65 MiB the dense run's had not."""
    for dtype in (torch.float32, torch.bfloat16):  # cuBLAS and cuBLASLt (addmm with a bias) workspaces
        a = torch.ones(8, 8, device=device, dtype=dtype)
        torch.nn.functional.linear(a @ a, a, a[0]).sum().item()


def graphed_compile(cfg: FinetuneConfig, acc) -> bool:
    """Does ``--compile`` record CUDA graphs here (its mode does, on a CUDA device)?"""
    return cfg.compile in GRAPHED_COMPILE_MODES and acc.device.type == "cuda"


@dataclass
class _Prepared:
    """A run's prepared objects and its steps' count."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    train_loader: object
    eval_loader: object
    sampler: object
    params: list  # the trainable parameters, after prepare
    loss_fn: Callable
    keep_grads: bool  # CUDA graphs add into the .grad tensors: zeroed, never set to None
    total: int
    eval_every: int
    taken_before: int  # padding rows the calibration's backwards took
    dynamo_before: tuple[int, int]


@dataclass
class _Progress:
    """Where a run stands: its last step, its status and its last checkpoint."""

    step: int
    last_ckpt: str | None
    status: str = "completed"
    error: str | None = None
    run_peak: float = 0.0  # the steps' peak memory so far (MB)

    def diverged(self, loss: float) -> None:
        where = f"last good checkpoint: {self.last_ckpt}" if self.last_ckpt else \
            "no checkpoint was written before it (use --save-steps)"
        self.status = "diverged"
        self.error = (f"loss became non-finite ({loss}) at step {self.step + 1}; stopped before applying "
                      f"that step; {where}")


class Run:
    """One training run (dense or SEBP) in its run directory."""

    def __init__(self, cfg: FinetuneConfig, method: str, run_dir: Path, accelerator, data: TrainData,
                 load_fn: Callable[[], LoadedModel], report_layers: dict[str, SEBPConfig] | None,
                 dense_steps: dict[int, float] | None, on_event: Event, budget: CalibBudget | None = None):
        """``dense_steps``: step -> backward ms of a dense run on the same batches (``--compare`` with dense first
        and one layout), which the progress compares this run's recent steps with; ``budget``: calibration's."""
        self.cfg, self.method, self.dir, self.acc, self.data = cfg, method, run_dir, accelerator, data
        self.load_fn, self.report_layers, self.dense_steps, self.emit = load_fn, report_layers, dense_steps, on_event
        self.main, self.budget = accelerator.is_main_process, budget
        self.compile_scope: str | None = None  # under --compile, what compiled (set with the step's loss)
        self.records: list[dict] = []
        self.sampled: dict | None = None  # sampled mode's measured rows (sebp_probe.model.sampled)

    # -- setup

    def _setup_model(self, state: dict | None):
        from accelerate.utils import set_seed

        set_seed(self.cfg.seed)
        loaded = self.load_fn()
        model, self.tokenizer = loaded.model, loaded.tokenizer  # the tokenizer goes into the checkpoints
        if self.cfg.lora:
            model = wrap_lora(model, loaded.task, self.cfg)
        model.to(self.acc.device)
        model.train()
        self.head = choose_head(model, loaded.task, self.cfg.head, self.acc.num_processes, self.cfg.cuda_graphs,
                                self.cfg.compile is not None and compiles_whole(model, self.cfg.compile_scope),
                                self.cfg.data.padding)  # (the run's Head, why not the one asked for)
        calib = None
        if self.method == "sebp":
            if state is not None:  # resume: the layers chosen at the start, no new calibration
                layers = {n: SEBPConfig.from_dict(d) for n, d in state["layers"].items()}
                calib = state.get("calibration")
                kept = calib or {"norms": layers, "activations": layers}  # what the start patched
                apply_sebp(model, layers, self.cfg.sebp_norms and bool(kept.get("norms")),
                           self.cfg.sebp_acts and bool(kept.get("activations")))
                verdicts = state.get("pad_rows") or []  # one per process (a resume keeps the process count)
                owns = state.get("pad_rows_own") or []
                i = self.acc.process_index
                if i < len(verdicts):
                    restore_pad_rows(model, verdicts[i], owns[i] if i < len(owns) else ())
                samplers = state.get("sampler") or []  # sampled mode: each layer's cutoff and draw counter
                load_sampler_states(model, samplers[i] if i < len(samplers) else {})
            else:
                cands = candidate_layers(model, self.cfg, self.report_layers)
                calib = self._calibrate(model, cands)
        elif self.method == "resprop":  # no calibration: the reuse level is the user's trade of accuracy for time
            from ..model.resprop import patch_resprop

            names = patch_resprop(model, self.cfg.reuse, list(self.cfg.targets) if self.cfg.targets else None)
            self.emit("calibrated", {"run": self.method, "layers": {n: {"reuse": self.cfg.reuse} for n in names},
                                     "fallback_dense": [], "fallback_reason": None})
        return loaded, model, calib

    def _calibrate(self, model, cands: dict[str, SEBPConfig]) -> dict:
        batches = first_batches(self.cfg, self.data, self.acc.device)
        if self.cfg.calib_batches == 0:  # no measurement: patch every candidate
            c = Calibration({}, None, None, cands, [], norms=apply_sebp(model, cands, self.cfg.sebp_norms,
                                                                         self.cfg.sebp_acts))
        else:
            c = calibrate(model, batches, cands, self.cfg.dense_fallback, self.acc.device, self.acc.autocast,
                          if_slower=self.cfg.fallback_if_slower, norms=self.cfg.sebp_norms,
                          acts=self.cfg.sebp_acts, budget=self.budget, head=self.head[0],
                          graphs=self.cfg.cuda_graphs or graphed_compile(self.cfg, self.acc))
        c = take_main_choice(model, c, cands)
        reset_samplers(model)  # sampled mode: the run's draws start at its first step, not in calibration
        c.acts = patched_activations(model)
        info = c.to_dict()
        self.emit("calibrated", {"run": self.method, **info})
        return info

    def _step_loss(self, model) -> Callable:
        """What a training step calls for its loss: the run's head's (``Head.loss``). Under ``--compile``, by
        default (``--compile-scope layers``) each layer of the model's stack compiles in place and the rest of the
        step runs eagerly (:func:`~sebp_probe.train.compiling.compile_layers_or_eager`); under ``model`` (or for
        a model without a layer stack sebp-probe knows) the model compiles in place and, where the
        labelled-rows head runs (it goes around the model's forward), the whole step's loss compiles too, the
        forward inlined in its graph (:func:`~sebp_probe.train.compiling.compile_or_eager`). Either way: one
        line and eager where it cannot; the held-out evaluation runs eagerly."""
        # the heads that call the backbone around the model's forward (not the labelled head of several processes)
        cfg, loss, labelled = self.cfg, self.head[0].loss, self.head[0].calls_backbone
        if not cfg.compile:
            return loss
        if labelled:
            ready_to_compile(model, cfg.data.padding, self.acc.autocast)
        if not compiles_whole(model, cfg.compile_scope):
            scope = compile_layers_or_eager(model, cfg.compile_mode, self.acc.device,
                                            LAYOUTS[cfg.data.padding].one_shape, most_rows(cfg, self.data))
            self.compile_scope = scope or "eager"
            return loss
        if cfg.cuda_graphs:  # the graphs replay each layer compiled; a whole compiled model was never tried there
            self.emit("note", {"run": self.method, "text": f"{self.method}: --cuda-graphs replays the layers "
                               f"compiled, and {type(model).__name__} has no layer stack sebp-probe knows: the "
                               "step is replayed eagerly"})
            self.compile_scope = "eager"
            return loss
        step = compile_or_eager(model, cfg.compile_mode, self.acc.device, loss if labelled else None)
        compiled = getattr(model, "_compiled_call_impl", None) is not None  # not where Inductor cannot run
        self.compile_scope = "eager" if not compiled else "step" if labelled else "forward"
        return step or loss

    # -- bookkeeping

    def _log(self, rec: dict) -> None:
        self.records.append(rec)
        if self.main:
            with open(self.dir / METRICS, "a") as fh:
                fh.write(json.dumps(rec) + "\n")

    def _save_checkpoint(self, step: int, calib: dict | None, model) -> Path:
        return save_checkpoint(self, step, calib, model)

    def _restore(self) -> dict | None:
        return restore(self)

    # -- the loop

    def run(self, resume: bool) -> dict:
        if self.main:
            self.dir.mkdir(parents=True, exist_ok=True)
        self.acc.wait_for_everyone()
        done = read_json(self.dir / SUMMARY)
        if resume and done and done.get("status") == "completed":
            self.records = [json.loads(x) for x in (self.dir / METRICS).read_text().splitlines() if x.strip()]
            self.emit("skipped", {"run": self.method, "summary": done})
            return done
        state = self._restore() if resume else None
        if not resume and self.main:
            (self.dir / METRICS).unlink(missing_ok=True)
        self.acc.wait_for_everyone()
        loaded, model, calib = self._setup_model(state)
        if self.acc.device.type == "cuda":
            _warm_cublas(self.acc.device)
            torch.cuda.reset_peak_memory_stats(self.acc.device)
        try:
            return self._train(loaded, model, calib, state)
        finally:
            self.acc.free_memory()  # forget this run's prepared objects: a checkpoint holds one run only
            # DDP and accelerate's autocast wrapper of forward leave reference cycles: without a collection
            # the first run of a --compare would still hold its memory during the second, inflating its peak.
            del model, loaded
            gc.collect()
            if self.acc.device.type == "cuda":
                torch.cuda.empty_cache()

    def _train(self, loaded, model, calib, state) -> dict:
        """Prepare, then step until the end, a divergence or a stop request; then the summary. One host wait per
        step, for the loss (a non-finite loss stops the run before its update): the optimizer's work and the
        next batch's copy run on the GPU while the host goes on. A step's time is the host's, from the end of
        the step before (the first: from a synchronized GPU); at a step after which something else runs
        (evaluation, checkpoint, the end) the GPU is waited for, so that no GPU work is left out of the steps'
        times or counted in them twice."""
        t = self._prepare(model)
        self.probe = self._probe(t.model, loaded.task)
        self.guard = SampleGuard(self.cfg.guard_every, self.cfg.sample_warmup, self.acc.unwrap_model(t.model))
        p = _Progress(step=self._resume_state(state), last_ckpt=state["path"] if state else None)
        self.emit("start", {"run": self.method, "total": t.total, "step": p.step, "resumed": state is not None,
                            "patched": len((calib or {}).get("layers", {})),
                            "fallback_dense": (calib or {}).get("fallback_dense", [])})
        batches = self._batches(t, p.step * self.cfg.grad_accum)
        micro = MicroBatches(self.acc, self.cfg.grad_accum, self.cfg.cuda_graphs)
        sync(self.acc.device)
        with StopRequest() as stop:
            while p.step < t.total:
                if not self._step(t, p, micro, batches, stop, calib):
                    break
        self.probe.close()  # the linears' own classes back (a compiled run's taps)
        self.sampled = sampled_summary(t.model, guard_summary(self.records, self.cfg.guard_every))  # unpatched
        self.probe = self.guard = None  # they hold the model: a --compare's second run must not find it alive
        micro.close()  # the graphs and their memory pool go before the model is saved
        if p.status == "completed":
            p.last_ckpt = str(self._save_checkpoint(p.step, calib, t.model))
            self._save_model(t.model, loaded)
        return self._finish(t, p, calib)

    def _prepare(self, model) -> _Prepared:
        """Loaders, optimizer, ``Accelerator.prepare``, the step's loss and the steps' count."""
        cfg, acc = self.cfg, self.acc
        train_loader, eval_loader, sampler = make_loaders(cfg, self.data, pin=acc.device.type == "cuda")
        optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], cfg)
        model, optimizer, train_loader, eval_loader = acc.prepare(model, optimizer, train_loader, eval_loader)
        # after prepare: FSDP2 puts new (DTensor) Parameters in the model, and accelerate's clip_grad_norm_ finds
        # its model by these very objects (stale ones fail there comparing a Tensor with a DTensor)
        params = [p for p in model.parameters() if p.requires_grad]
        pad = pad_rows_of(model)
        taken_before = pad.taken if pad is not None else 0  # the calibration's backwards are not the run's
        # Graph replays add into .grad in place. Under --compile, a .grad that autograd took over from a graph's
        # output (it does when .grad is None) would be overwritten by the next micro-batch's replay.
        keep_grads = cfg.cuda_graphs or (graphed_compile(cfg, acc) and cfg.grad_accum > 1)
        dynamo_before = dynamo_counts()
        loss_fn = self._step_loss(model)
        if cfg.compile and keep_grads:
            for p in params:
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        total = cfg.optimizer_steps(len(train_loader))
        return _Prepared(model, optimizer, train_loader, eval_loader, sampler, params, loss_fn, keep_grads, total,
                         cfg.eval_steps or max(1, total // 4), taken_before, dynamo_before)

    def _resume_state(self, state: dict | None) -> int:
        """The step to start from: a resumed run's, its RNG and optimizer states restored (after prepare)."""
        if state is None:
            return 0
        self.acc.load_state(state["path"])
        return state["step"]

    def _batches(self, t: _Prepared, start_micro: int) -> Iterator:
        """(epoch, micro-batch) from micro-batch ``start_micro`` on, epoch after epoch."""
        n_batches = len(t.train_loader)
        epoch, offset = divmod(start_micro, n_batches)
        while True:
            t.train_loader.set_epoch(epoch)
            t.sampler.set_epoch(epoch)
            loader = self.acc.skip_first_batches(t.train_loader, offset) if offset else t.train_loader
            for b in loader:
                yield epoch, b
            epoch, offset = epoch + 1, 0

    def _step(self, t: _Prepared, p: _Progress, micro: MicroBatches, batches: Iterator, stop: StopRequest,
              calib: dict | None) -> bool:
        """One optimizer step, its record, evaluation and checkpoint. False: the run stops after it."""
        cfg, dev = self.cfg, self.acc.device
        t_step = time.perf_counter()
        before = (len(micro.graphs), dynamo_counts()[0] if cfg.compile else 0)  # graphs captured, compiled
        with label_checks.deferred() as checks:  # the labelled-rows head's label checks stay on the device
            with self.probe.step(p.step + 1) as around, self.guard.step(p.step + 1):  # --probe-every, the guard
                tally = micro.run(batches, t.model, t.loss_fn, around)
            untimed = untimed_reason(cfg.compile and dynamo_counts()[0] > before[1], len(micro.graphs) > before[0],
                                      tally.new_shape and dev.type == "cuda")
            mean_loss, untimed = self._reduce_loss(tally.loss_sum / cfg.grad_accum, untimed)  # the step's one wait
            checks.check()  # a bad label raises here, before the optimizer step
        stopping = self._stop_agreed(stop)
        if not math.isfinite(mean_loss):
            self._probe_record(p.step + 1)  # its statistics, non-finite rows and all
            p.diverged(mean_loss)
            return False
        lr = self._optimizer_step(t, p.step)
        p.step += 1
        evaluating = p.step % t.eval_every == 0 or p.step == t.total
        saving = bool(cfg.save_steps) and p.step % cfg.save_steps == 0 and p.step < t.total
        if evaluating or saving or stopping:
            sync(dev)
        rec = self._step_record(p, tally, mean_loss, lr, t_step, micro, untimed)
        self._log(rec)
        self._probe_record(p.step)
        live = self._vs_dense_backward()
        self.emit("step", {"run": self.method, **rec, **({"vs_dense_backward": live} if live else {}),
                           "total": t.total})
        if evaluating:
            with evaluating_eagerly(bool(cfg.compile)):
                ev = {"type": "eval", "step": p.step, **evaluate(t.model, t.eval_loader, self.acc, self.data.task)}
            self._log(ev)
            self.emit("eval", {"run": self.method, **ev})
        if stopping or (self.acc.num_processes == 1 and stop.requested):
            p.status = "interrupted"
            p.last_ckpt = str(self._save_checkpoint(p.step, calib, t.model))
            return False
        if saving:
            p.last_ckpt = str(self._save_checkpoint(p.step, calib, t.model))
        return True

    def _probe(self, model, task: str | None) -> StepProbe:
        cfg, acc = self.cfg, self.acc
        return StepProbe(cfg.probe_every, acc.unwrap_model(model), task, bool(cfg.compile),
                         (lambda x: acc.reduce(x, "sum")) if acc.num_processes > 1 else None, acc.device)

    def _probe_record(self, step: int) -> None:
        for rec in filter(None, (self.probe.take_timed(step), self.guard.take(step))):  # --probe-every's, the guard's
            self._log(rec)

    def _reduce_loss(self, loss: torch.Tensor, untimed: str | None) -> tuple[float, str | None]:
        """The step's loss averaged over the processes, and why the step is untimed on any of them: a process
        that compiles or captures holds the others up in the next collective, so such a step's time is not
        steady on any process. Both travel in the one reduction (a sum) the host waits for anyway."""
        n = self.acc.num_processes
        if n == 1:
            return self.acc.reduce(loss, "mean").item(), untimed
        flags = [loss.new_full((), float(untimed == reason), dtype=torch.float32) for reason in UNTIMED]  # no sync
        total = self.acc.reduce(torch.stack([loss.float(), *flags]), "sum").tolist()
        return total[0] / n, next((r for r, f in zip(UNTIMED, total[1:]) if f > 0), None)

    def _stop_agreed(self, stop: StopRequest) -> bool:
        """Ctrl-C / SIGTERM: every process stops after the same step. Across processes that takes a reduction
        (accelerate's trigger), made here, where the host waits anyway: a request that comes later is seen in
        the next step, which then finishes. One process reads its flag at the step's end (False here)."""
        if self.acc.num_processes == 1:
            return False
        if stop.requested:
            self.acc.set_trigger()
        return self.acc.check_trigger()

    def _optimizer_step(self, t: _Prepared, step: int) -> float:
        """Clip, set the learning rate of ``step``, step and zero the gradients; returns the learning rate."""
        if self.cfg.max_grad_norm is not None:
            self.acc.clip_grad_norm_(t.params, self.cfg.max_grad_norm)
        lr = _lr_at(step, t.total, self.cfg)
        for g in t.optimizer.param_groups:
            g["lr"] = lr
        t.optimizer.step()
        t.optimizer.zero_grad(set_to_none=not t.keep_grads)  # the graphs keep adding into these
        return lr

    def _step_record(self, p: _Progress, tally: StepTally, mean_loss: float, lr: float, t_step: float,
                     micro: MicroBatches, untimed: str | None) -> dict:
        """The step's line of metrics.jsonl; a step that compiled, captured or ran a new shape (on any process)
        is untimed."""
        cfg, dev = self.cfg, self.acc.device
        tokens, empty = int(tally.tokens), int(tally.empty)
        rec = {"type": "train", "step": p.step, "epoch": tally.epoch, "loss": mean_loss, "lr": lr,
               "backward_ms": tally.backward_ms(), "step_ms": (time.perf_counter() - t_step) * 1e3,
               "peak_mem_mb": peak_memory_mb(dev), "tokens": tokens, "rows": tally.rows}
        if untimed:  # not in the run's times: summary.json reports these steps' seconds apart
            rec["untimed"] = untimed
        if empty:
            rec["batches_without_target"] = empty
        if cfg.cuda_graphs:
            rec["graph_replays"] = tally.replayed  # of the step's grad_accum micro-batches
            rec["graphs"] = len(micro.graphs)  # captured so far (one per batch shape)
        if dev.type == "cuda":  # this step's own peak too (the run's peak is the running maximum)
            rec["step_peak_mem_mb"] = rec["peak_mem_mb"]
            p.run_peak = rec["peak_mem_mb"] = max(p.run_peak, rec["peak_mem_mb"])
            torch.cuda.reset_peak_memory_stats(dev)
        return rec

    def _finish(self, t: _Prepared, p: _Progress, calib: dict | None) -> dict:
        """The run's summary: written to summary.json and sent as the ``end`` event."""
        cfg, dev, (head, why) = self.cfg, self.acc.device, self.head
        summary = {"status": p.status, "method": self.method, "total_steps": t.total, "head": head.kind,
                   **({"head_fallback_reason": why} if why else {}),
                   **({"sampled": self.sampled} if self.sampled else {}),  # approximate: rows skipped, the guard
                   "batches_without_target": sum(r.get("batches_without_target", 0) for r in self.records),
                   **summarize_records(self.records), "checkpoint": p.last_ckpt,
                   "model_dir": str(self.dir / MODEL_DIR) if p.status == "completed" else None,
                   "calibration": calib, "device": device_name(dev), "num_processes": self.acc.num_processes,
                   "peak_mem_kind": "torch.cuda.max_memory_allocated" if dev.type == "cuda" else
                   "process max RSS (CPU: grows over the runs of one process)"}
        padding_rows = pad_rows_summary(t.model)
        if padding_rows:  # the SEBP linears' padding rows from the mask: checked, then taken (GPU)
            padding_rows["taken"] -= t.taken_before
            summary["padding_rows"] = padding_rows
        if cfg.compile:  # what Dynamo made of this run's model (this process)
            graphs, breaks = (a - b for a, b in zip(dynamo_counts(), t.dynamo_before))
            summary["compile"] = {"mode": cfg.compile, "graphs": graphs, "graph_breaks": breaks,
                                  "scope": self.compile_scope}
        grad_stats = probe_summary(self.records, cfg.probe_every)
        if grad_stats:
            summary["grad_stats"] = grad_stats
        if p.error:
            summary["error"] = p.error
        if self.main:
            write_json(self.dir / SUMMARY, summary)
        self.emit("end", {"run": self.method, "summary": summary})
        return summary

    def _vs_dense_backward(self, window: int = 20) -> float | None:
        """For the progress bar: the dense run's median backward over this run's last ``window`` timed steps
        (the same steps, so the same batches) over this run's median on them; None without such a dense run."""
        if not self.dense_steps:
            return None
        recent = [r for r in self.records[-3 * window:] if r.get("type") == "train" and r["step"] > 10]
        mine = [(r["step"], r["backward_ms"]) for r in recent if not r.get("untimed") and r["step"] in self.dense_steps]
        mine = mine[-window:]
        if len(mine) < MIN_TIMED_STEPS:
            return None
        own = statistics.median(ms for _, ms in mine)
        return statistics.median(self.dense_steps[s] for s, _ in mine) / own if own else None

    def _save_model(self, model, loaded: LoadedModel) -> None:
        save_model(self, model, loaded)
