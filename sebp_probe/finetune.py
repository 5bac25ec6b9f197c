"""Fine-tuning with SEBP linears, measured against dense, on accelerate's ``Accelerator``.

One run: seed -> load the model -> [LoRA] -> calibrate -> patch -> train -> evaluate -> save.

* Calibration runs a few dense forward/backward passes on the first batches (RNG forked, gradients
  discarded, so training is untouched): it measures each candidate layer's share of active rows under its
  SEBP setting and leaves dense every layer above ``dense_fallback`` (SEBP would not pay there), and it times
  dense vs SEBP backward for the live speedup of a run without a dense twin.
* Data order is a pure function of (seed, epoch, micro-batch index): a resumed run skips to the same place
  and, with the RNG states restored by ``Accelerator.load_state``, reaches the same result.
* ``accelerate launch`` / ``torchrun`` give DDP through ``Accelerator.prepare``; there is no communication
  code here beyond accelerate's reduce/gather/trigger calls.
* SIGINT/SIGTERM set a flag; at the next step boundary every process checkpoints and the run ends
  ``interrupted``. A non-finite loss stops before the optimizer step and keeps the earlier checkpoints.

Output directory (``compare`` puts one run directory per method under it, ``dense/`` and ``sebp/``)::

    run_config.json  metrics.jsonl  summary.json  loss.png  eval.png  model/  checkpoints/step-000040/
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import json
import math
import os
import platform
import resource
import shutil
import signal
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from sebp_kernels import SEBPConfig, SEBPNorm, select_rows

from .assets import AssetError, LoadedModel, PadCollator, load_model, load_text_data, model_task, padding_side, tokenize
from .config import DEFAULT_MAX_STEPS, GRAPHED_COMPILE_MODES, FinetuneConfig
from .graphs import StepGraphs, replay_ms, shape_key
from .patch import find_targets, patch_activations, patch_model, patch_norms, patched_activations

RUN_CONFIG = "run_config.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
STATE = "trainer_state.json"
CHECKPOINTS = "checkpoints"
MODEL_DIR = "model"
OWN_ENTRIES = (RUN_CONFIG, METRICS, SUMMARY, CHECKPOINTS, MODEL_DIR, "dense", "sebp", "report.json",
               "loss.png", "eval.png")
# A resumed run must be the same run: every setting must match except these.
RESUMABLE_CHANGES = ("output_dir", "eval_steps", "save_steps", "save_total_limit", "compile",
                     "sebp_first")  # the same math
# Settings added after runs were first written: a run config without one ran with this value.
ADDED_SETTINGS = {"sebp_norms": False, "sebp_acts": False, "cuda_graphs": False, "graph_bucket": 32,
                  "compile": None, "sebp_first": False}

Event = Callable[[str, dict], None]


class FinetuneError(ValueError):
    """A run that cannot start or could not finish; the message is one line for the user."""


# ------------------------------------------------------------------------------------------------ data


@dataclass
class TrainData:
    """Tokenized, unpadded examples ({input_ids, label} or {input_ids, labels}) and how to pad them."""

    task: str
    train: list[dict]
    eval: list[dict]
    pad_id: int
    padding_side: str = "right"
    label_names: list[str] = field(default_factory=list)
    identity: dict = field(default_factory=dict)


def load_train_data(cfg: FinetuneConfig, loaded: LoadedModel) -> TrainData:
    """Train and held-out examples of ``cfg.data``: ``eval_split`` if given, the bundled test split of
    ``tweets``, else a deterministic 10% of the training split; at most ``eval_samples`` of them."""
    data = load_text_data(cfg.data, loaded.task)
    if cfg.data.eval_split or cfg.data.dataset == "tweets":
        held = load_text_data(replace(cfg.data, max_samples=None), loaded.task,  # --eval-samples caps this one
                              split=cfg.data.eval_split or "test", label_names=data.label_names or None)
    else:
        data, held = data.split_off(0.1, seed=cfg.seed)
    if cfg.eval_samples is not None:
        held.examples = held.examples[: cfg.eval_samples]
    train, ev = tokenize(loaded, data, cfg.data.max_length), tokenize(loaded, held, cfg.data.max_length)
    if not train or not ev:
        raise AssetError(f"dataset {cfg.data.dataset!r} has no non-empty text to train or evaluate on")
    side = padding_side(loaded, cfg.data)
    identity = {"train": data.identity, "eval": held.identity}
    return TrainData(loaded.task, train, ev, loaded.tokenizer.pad_token_id, side, data.label_names, identity)


class EpochSampler(torch.utils.data.Sampler):
    """A fresh permutation per epoch, a pure function of (seed, epoch), so a resumed run replays it."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


def _loaders(cfg: FinetuneConfig, data: TrainData, pin: bool = False):
    """(train loader, eval loader, sampler). ``pin``: batches in page-locked memory (on a GPU), so that their
    copy to the device does not wait for the work already queued there (a copy from pageable memory does)."""
    collate = PadCollator(data.pad_id, data.task, cfg.data.padding, cfg.data.max_length, data.padding_side,
                          cfg.graph_bucket if cfg.cuda_graphs else 1)  # graphs: few batch shapes
    # Own generators: creating a loader iterator must not draw from the global RNG (it holds dropout's state).
    gen = lambda: torch.Generator().manual_seed(cfg.seed)  # noqa: E731
    sampler = EpochSampler(len(data.train), cfg.seed)
    train = torch.utils.data.DataLoader(data.train, batch_size=cfg.data.batch_size, sampler=sampler,
                                        collate_fn=collate, generator=gen(), pin_memory=pin)
    ev = torch.utils.data.DataLoader(data.eval, batch_size=cfg.data.batch_size, shuffle=False,
                                     collate_fn=collate, generator=gen(), pin_memory=pin)
    return train, ev, sampler


# --------------------------------------------------------------------------------------------- patching


def _wrap_lora(model: torch.nn.Module, task: str, cfg: FinetuneConfig) -> torch.nn.Module:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise FinetuneError("--lora needs the 'peft' package: pip install peft") from None
    targets = find_targets(model, list(cfg.targets) if cfg.targets else None)
    lcfg = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules=targets,
                      task_type="SEQ_CLS" if task == "classification" else "CAUSAL_LM")
    return get_peft_model(model, lcfg)


def _linear_name(modules: dict, name: str) -> str:
    from .report import linear_name

    real = linear_name(modules, name)
    if real is None:
        raise FinetuneError(f"layer {name!r} of the SEBP settings is not in this model")
    return real


def candidate_layers(model: torch.nn.Module, cfg: FinetuneConfig,
                     report_layers: dict[str, SEBPConfig] | None) -> dict[str, SEBPConfig]:
    """Name of an nn.Linear in ``model`` -> its SEBP setting, before the density check."""
    if report_layers is not None:
        modules = dict(model.named_modules())
        return {_linear_name(modules, n): c for n, c in report_layers.items()}
    return {n: cfg.sebp_config() for n in find_targets(model, list(cfg.targets) if cfg.targets else None)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_optimizer(params: list, cfg: FinetuneConfig) -> torch.optim.Optimizer:
    """AdamW; on a GPU its fused implementation (one kernel per parameter group and dtype, as Hugging Face's
    ``Trainer`` uses by default): the multi-tensor one took 6-7 ms of host time a step for BERT-base on the
    device machine, longer than the GPU needed for it (``scripts/gpu_finetune.py`` with PROFILE_STEPS). Same
    update rule; the CPU keeps the default implementation."""
    fused = bool(params) and all(p.is_cuda and p.is_floating_point() for p in params)
    if fused:
        try:
            return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
        except (RuntimeError, ValueError):  # a parameter kind the fused kernel does not take
            pass
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _timed_backward(model, batch, device, autocast) -> float:
    with autocast():
        loss = model(**batch).loss
    _sync(device)
    t0 = time.perf_counter()
    loss.backward()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3


def _graphed_backward_ms(model, batch, autocast, repeats: int = 3) -> float:
    """Median milliseconds of the backward replayed as a CUDA graph (``--cuda-graphs``); the gradients it
    wrote are dropped."""
    return replay_ms(model, batch, repeats, autocast)[1]


def _rng_devices(device: torch.device) -> list[int]:
    return [device.index or 0] if device.type == "cuda" else []


def measure_density(model, batches: list[dict], candidates: dict[str, SEBPConfig], device: torch.device,
                    autocast=contextlib.nullcontext) -> dict[str, float]:
    """Each candidate layer's share of rows of dL/dY that its SEBP setting keeps, over dense backward passes
    on ``batches``. The caller discards the gradients (and forks the RNG when it matters)."""
    modules = dict(model.named_modules())
    counts = {n: [0, 0] for n in candidates}

    def hook_for(name, scfg):
        def fwd(_mod, _inp, out):
            if out.requires_grad:
                def grad(g):
                    g2 = g.detach().reshape(-1, g.shape[-1])
                    counts[name][0] += select_rows(g2, scfg).numel()
                    counts[name][1] += g2.shape[0]
                out.register_hook(grad)
        return fwd

    handles = [modules[n].register_forward_hook(hook_for(n, c)) for n, c in candidates.items()]
    try:
        for b in batches:
            _timed_backward(model, b, device, autocast)
    finally:
        for h in handles:
            h.remove()
    return {n: (k / m if m else 1.0) for n, (k, m) in counts.items()}


def _first_batches(cfg: FinetuneConfig, data: TrainData, device: torch.device) -> list[dict]:
    loader, _, sampler = _loaders(cfg, data)
    sampler.set_epoch(0)
    out = []
    for b in loader:
        out.append({k: v.to(device) for k, v in b.items()})
        if len(out) >= max(1, cfg.calib_batches):
            break
    return out


@dataclass
class Calibration:
    density: dict[str, float]
    dense_backward_ms: float | None
    sebp_backward_ms: float | None
    layers: dict[str, SEBPConfig]
    fallback: list[str]
    reason: str | None = None
    norms: list[str] = field(default_factory=list)  # norms with the SEBP backward (``sebp_norms``)
    acts: list[str] = field(default_factory=list)  # MLPs with the SEBP activation (``sebp_acts``)

    def to_dict(self) -> dict:
        return {"density": self.density, "dense_backward_ms": self.dense_backward_ms,
                "sebp_backward_ms": self.sebp_backward_ms, "fallback_dense": self.fallback,
                "fallback_reason": self.reason, "layers": {n: s.to_dict() for n, s in self.layers.items()},
                "norms": self.norms, "activations": self.acts}


def _backend_variants(layers: dict[str, SEBPConfig], device: torch.device,
                      graphs: bool = False) -> list[dict[str, SEBPConfig]]:
    """The SEBP implementations worth timing: on CUDA with backend ``auto``, both the Triton kernels and the
    torch path (gather + cuBLAS + scatter, one host sync per layer), since which one wins depends on the GPU,
    the dtype and the shapes; elsewhere just the configured one. With ``graphs`` only the Triton kernels: the
    torch path's host sync cannot be captured."""
    from sebp_kernels.functional import _triton_backward

    if device.type != "cuda" or any(c.backend != "auto" for c in layers.values()):
        return [layers]
    if graphs:
        return [{n: replace(c, backend="triton") for n, c in layers.items()}]
    backends = ("triton", "torch") if _triton_backward() is not None else ("torch",)
    return [{n: replace(c, backend=b) for n, c in layers.items()} for b in backends]


def apply_sebp(model, layers: dict[str, SEBPConfig], norms: bool = False, acts: bool = False) -> list[str]:
    """Patch ``layers`` into ``model``, and with ``norms`` (and any layer at all) its norms too, with ``acts``
    its MLP activations; return the names of the model's SEBP norms (patched now or before)."""
    if not layers:
        return []
    patch_model(model, layer_configs=layers)
    if acts:
        patch_activations(model)
    if not norms:
        return []
    patch_norms(model)
    return [n for n, m in model.named_modules() if isinstance(m, SEBPNorm)]


def calibrate(model, batches: list[dict], candidates: dict[str, SEBPConfig], fallback: float,
              device: torch.device, autocast=contextlib.nullcontext, if_slower: bool = True,
              reps: int = 2, norms: bool = False, acts: bool = False, graphs: bool = False) -> Calibration:
    """Decide which candidate layers run SEBP, and patch them into ``model`` (with ``norms``, its norms too,
    with ``acts`` its MLP activations: they are timed and kept or dropped together with the linear layers).

    1. One dense backward per batch measures each layer's share of active rows under its setting; layers
       above ``fallback`` stay dense (gathering nearly every row costs more than it saves).
    2. Dense and SEBP backward are timed interleaved on the same batches (median of ``reps`` rounds); on CUDA
       with backend ``auto`` the Triton and the torch implementations are both timed and the faster kept.
       With ``if_slower``, SEBP slower than dense leaves the whole model dense: SEBP never costs backward
       time as timed here. With ``graphs`` both backward passes are timed as CUDA-graph replays, as
       ``--cuda-graphs`` (and the graph-recording ``--compile`` modes) train; otherwise eagerly, also under
       ``--compile default``, whose compiled backward can rank differently.

    Leaves no gradients and no trace in the RNG.
    """
    from .patch import unpatch_model

    dense_ms, sebp_ms, reason, norm_names = [], [], None, []
    if graphs:
        timed = lambda b: _graphed_backward_ms(model, b, autocast)  # noqa: E731
    else:
        timed = lambda b: _timed_backward(model, b, device, autocast)  # noqa: E731
    with torch.random.fork_rng(devices=_rng_devices(device)):
        density = measure_density(model, batches, candidates, device, autocast)  # also the dense warm-up
        layers = {n: c for n, c in candidates.items() if density[n] <= fallback}
        if layers:
            best = None
            for cfgs in _backend_variants(layers, device, graphs):
                apply_sebp(model, cfgs, norms, acts)
                for b in batches:  # SEBP warm-up: kernel compilation and tuning for these row counts, allocator
                    _timed_backward(model, b, device, autocast)
                d_ms, s_ms = [], []
                for _ in range(reps):
                    for b in batches:
                        unpatch_model(model)
                        d_ms.append(timed(b))
                        apply_sebp(model, cfgs, norms, acts)
                        s_ms.append(timed(b))
                if best is None or statistics.median(s_ms) < statistics.median(best[2]):
                    best = (cfgs, d_ms, s_ms)
            layers, dense_ms, sebp_ms = best
            norm_names = apply_sebp(model, layers, norms, acts)  # the chosen backend in place of the last one timed
            if if_slower and statistics.median(sebp_ms) > statistics.median(dense_ms):
                unpatch_model(model)
                reason = "SEBP backward measured slower than dense on the calibration batches"
                if device.type == "cuda" and not graphs:  # eager on a GPU: often the host's launch overhead
                    reason += " (eager: where the host is the bound, --cuda-graphs may reverse it)"
                layers, norm_names = {}, []
        else:
            dense_ms = [timed(b) for b in batches]
        model.zero_grad(set_to_none=True)
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return Calibration(density, med(dense_ms), med(sebp_ms), layers,
                       sorted(n for n in candidates if n not in layers), reason, norm_names)


# ---------------------------------------------------------------------------------------- output dir


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    tmp.replace(path)  # atomic: a killed run never leaves half a file


def _config_changes(old: dict, new: dict) -> list[str]:
    keys = sorted(set(old) | set(new))
    out = []
    for k in keys:
        if k in RESUMABLE_CHANGES:
            continue
        if isinstance(old.get(k), dict) and isinstance(new.get(k), dict):
            out += [f"{k}.{s}" for s in _config_changes(old[k], new[k])]
        elif old.get(k, ADDED_SETTINGS.get(k)) != new.get(k, ADDED_SETTINGS.get(k)):
            out.append(k)
    return out


def _has_progress(out: Path) -> bool:
    """Did the run in ``out`` train at all (metrics or checkpoints)? One that failed before is replaceable."""
    for d in (out, out / "dense", out / "sebp"):
        m = d / METRICS
        if (m.exists() and m.stat().st_size) or (d / CHECKPOINTS).exists():
            return True
    return False


def check_output_dir(cfg: FinetuneConfig, resume: bool, overwrite: bool) -> tuple[bool, list[Path]]:
    """(resuming, entries to delete before a fresh run); raises FinetuneError when the directory is refused.

    A directory holding another run is refused unless ``resume`` (same settings) or ``overwrite``; one
    holding anything else is always refused, so no user file is ever deleted. Nothing is changed here.
    """
    if resume and overwrite:
        raise FinetuneError("--resume and --overwrite contradict each other; pass one")
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise FinetuneError(f"output dir {out} is a file")
    entries = sorted(p.name for p in out.iterdir()) if out.exists() else []
    stored = _read_json(out / RUN_CONFIG) if entries else None
    if resume:
        if stored is None:
            raise FinetuneError(f"--resume: {out} holds no sebp-probe finetune run to resume")
        changed = _config_changes(stored.get("config", {}), cfg.to_dict())
        if changed:
            raise FinetuneError(f"--resume: settings differ from the run in {out}: {', '.join(changed)}; "
                                "resume with the same settings or use --overwrite")
        return True, []
    if entries:
        if stored is None:
            raise FinetuneError(f"output dir {out} is not empty and holds no sebp-probe run "
                                f"({', '.join(entries[:4])}{' ...' if len(entries) > 4 else ''}); pick another")
        if not overwrite and _has_progress(out):
            raise FinetuneError(f"output dir {out} holds another run; pass --resume to continue it or "
                                "--overwrite to replace it")
        foreign = [e for e in entries if e not in OWN_ENTRIES]
        if foreign:
            raise FinetuneError(f"--overwrite: {out} also holds files of its own ({', '.join(foreign[:4])}); "
                                "move them or pick another output dir")
        return False, [out / e for e in entries]
    return False, []


def _clear(paths: list[Path]) -> None:
    for p in paths:
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def _checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints (their trainer_state.json is written last), oldest first."""
    d = run_dir / CHECKPOINTS
    if not d.is_dir():
        return []
    return sorted((p for p in d.iterdir() if p.name.startswith("step-") and (p / STATE).exists()),
                  key=lambda p: int(p.name.split("-")[1]))


def versions() -> dict:
    import accelerate
    import transformers

    from . import __version__

    v = {"sebp_probe": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
         "accelerate": accelerate.__version__, "python": platform.python_version()}
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:
        pass
    return v


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


# ------------------------------------------------------------------------------------------- signals


class StopRequest:
    """Turns the first SIGINT/SIGTERM into a flag read at the next step boundary; a second one interrupts."""

    def __init__(self):
        self.requested = False
        self._old: dict = {}

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)
        return False


# ---------------------------------------------------------------------------------------------- runs


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


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


@torch.no_grad()
def evaluate(model, loader, accelerator, task: str) -> dict:
    """Held-out loss, and accuracy (classification) or perplexity (causal LM), over every example once."""
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    count = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    correct = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    for batch in loader:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        labels = batch["labels"]
        if task == "classification":
            per = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
            hits = (logits.argmax(-1) == labels).double()
            per, hits = accelerator.gather_for_metrics((per, hits))
            loss_sum += per.double().sum()
            count += per.numel()
            correct += hits.sum()
        else:
            lg, lb = logits[:, :-1], labels[:, 1:]
            tok = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), lb.reshape(-1),
                                                    ignore_index=-100, reduction="none").view(lb.shape)
            per, n = tok.double().sum(1), (lb != -100).double().sum(1)
            per, n = accelerator.gather_for_metrics((per, n))
            loss_sum += per.sum()
            count += n.sum()
    model.train(was_training)
    loss = (loss_sum / count.clamp(min=1)).item()
    out = {"eval_loss": loss}
    if task == "classification":
        out["eval_accuracy"] = (correct / count.clamp(min=1)).item()
    else:
        out["eval_perplexity"] = math.exp(min(loss, 700.0))
    return out


def _skip_warmup(n: int) -> int:
    return min(10, n // 10) if n > 1 else 0


def summarize_records(records: list[dict]) -> dict:
    """Mean/median backward and step time (first steps skipped as warm-up), peak memory, final loss."""
    train = [r for r in records if r.get("type") == "train"]
    evals = [r for r in records if r.get("type") == "eval"]
    timed = train[_skip_warmup(len(train)):]
    out = {"steps": train[-1]["step"] if train else 0}
    if timed:
        for key in ("backward_ms", "step_ms"):
            vals = [r[key] for r in timed]
            out[f"mean_{key}"] = statistics.fmean(vals)
            out[f"median_{key}"] = statistics.median(vals)
        out["peak_mem_mb"] = max(r["peak_mem_mb"] for r in train)
        # Under DDP the second step's peak may or may not still hold the first step's gradient buckets
        # (one copy of the parameters), for dense and SEBP alike: the peak from step 3 on, beside the whole
        # run's (CUDA only: the CPU's max RSS cannot be reset per step).
        later = [r["step_peak_mem_mb"] for r in train if r["step"] > 2 and "step_peak_mem_mb" in r]
        if later:
            out["peak_mem_mb_from_step3"] = max(later)
        last = train[-10:]
        out["final_train_loss"] = statistics.fmean(r["loss"] for r in last)
    if evals:
        out["final_eval"] = {k: v for k, v in evals[-1].items() if k.startswith("eval_")}
    return out


class Run:
    """One training run (dense or SEBP) in its run directory."""

    def __init__(self, cfg: FinetuneConfig, method: str, run_dir: Path, accelerator, data: TrainData,
                 load_fn: Callable[[], LoadedModel], report_layers: dict[str, SEBPConfig] | None,
                 dense_reference: dict | None, on_event: Event):
        self.cfg, self.method, self.dir, self.acc, self.data = cfg, method, run_dir, accelerator, data
        self.load_fn, self.report_layers, self.dense_ref, self.emit = load_fn, report_layers, dense_reference, on_event
        self.main = accelerator.is_main_process
        self.records: list[dict] = []

    # -- setup

    def _setup_model(self, state: dict | None):
        from accelerate.utils import set_seed

        set_seed(self.cfg.seed)
        loaded = self.load_fn()
        model = loaded.model
        if self.cfg.lora:
            model = _wrap_lora(model, loaded.task, self.cfg)
        model.to(self.acc.device)
        model.train()
        calib = None
        if self.method == "sebp":
            if state is not None:  # resume: the layers chosen at the start, no new calibration
                layers = {n: SEBPConfig.from_dict(d) for n, d in state["layers"].items()}
                apply_sebp(model, layers, self.cfg.sebp_norms, self.cfg.sebp_acts)
                calib = state.get("calibration")
            else:
                cands = candidate_layers(model, self.cfg, self.report_layers)
                calib = self._calibrate(model, cands)
        return loaded, model, calib

    def _calibrate(self, model, cands: dict[str, SEBPConfig]) -> dict:
        batches = _first_batches(self.cfg, self.data, self.acc.device)
        if self.cfg.calib_batches == 0:  # no measurement: patch every candidate
            c = Calibration({}, None, None, cands, [], norms=apply_sebp(model, cands, self.cfg.sebp_norms,
                                                                         self.cfg.sebp_acts))
        else:
            c = calibrate(model, batches, cands, self.cfg.dense_fallback, self.acc.device, self.acc.autocast,
                          if_slower=self.cfg.fallback_if_slower, norms=self.cfg.sebp_norms,
                          acts=self.cfg.sebp_acts, graphs=self.cfg.cuda_graphs or _graphed_compile(self.cfg,
                                                                                                   self.acc))
        if self.acc.num_processes > 1:  # timings differ per process: every process takes the main one's choice
            from accelerate.utils import broadcast_object_list

            from .patch import unpatch_model

            chosen = broadcast_object_list([{n: sc.to_dict() for n, sc in c.layers.items()}])[0]
            unpatch_model(model)
            c.layers = {n: SEBPConfig.from_dict(d) for n, d in chosen.items()}
            c.fallback = sorted(n for n in cands if n not in c.layers)
            c.norms = apply_sebp(model, c.layers, self.cfg.sebp_norms, self.cfg.sebp_acts)
        c.acts = patched_activations(model)
        info = c.to_dict()
        self.emit("calibrated", {"run": self.method, **info})
        return info

    # -- bookkeeping

    def _log(self, rec: dict) -> None:
        self.records.append(rec)
        if self.main:
            with open(self.dir / METRICS, "a") as fh:
                fh.write(json.dumps(rec) + "\n")

    def _save_checkpoint(self, step: int, calib: dict | None) -> Path:
        path = self.dir / CHECKPOINTS / f"step-{step:06d}"
        self.acc.wait_for_everyone()
        self.acc.save_state(str(path))
        if self.main:
            layers = (calib or {}).get("layers", {})
            _write_json(path / STATE, {"step": step, "layers": layers, "calibration": calib})
            for old in _checkpoints(self.dir)[: -self.cfg.save_total_limit]:
                shutil.rmtree(old, ignore_errors=True)
        self.acc.wait_for_everyone()
        return path

    def _restore(self) -> dict | None:
        ckpts = _checkpoints(self.dir)
        if not ckpts:
            if self.main:
                (self.dir / METRICS).unlink(missing_ok=True)
            return None
        state = _read_json(ckpts[-1] / STATE)
        state["path"] = str(ckpts[-1])
        kept = []
        if (self.dir / METRICS).exists():
            for line in (self.dir / METRICS).read_text().splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut by a kill
                if rec.get("step", 0) <= state["step"]:
                    kept.append(rec)
        self.records = kept
        if self.main:
            tmp = self.dir / (METRICS + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            tmp.replace(self.dir / METRICS)
        return state

    # -- the loop

    def run(self, resume: bool) -> dict:
        if self.main:
            self.dir.mkdir(parents=True, exist_ok=True)
        self.acc.wait_for_everyone()
        done = _read_json(self.dir / SUMMARY)
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
        cfg, acc, dev = self.cfg, self.acc, self.acc.device
        train_loader, eval_loader, sampler = _loaders(cfg, self.data, pin=dev.type == "cuda")
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = make_optimizer(params, cfg)
        model, optimizer, train_loader, eval_loader = acc.prepare(model, optimizer, train_loader, eval_loader)
        # Graph replays add into .grad in place. Under --compile, a .grad that autograd took over from a graph's
        # output (it does when .grad is None) would be overwritten by the next micro-batch's replay.
        keep_grads = cfg.cuda_graphs or (_graphed_compile(cfg, acc) and cfg.grad_accum > 1)
        dynamo_before = _dynamo_counts()
        if cfg.compile:  # in place: the module, its parameter names and checkpoints stay as they are
            model.compile(mode=cfg.compile)
            if keep_grads:
                for p in params:
                    p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        n_batches = len(train_loader)
        A = cfg.grad_accum
        if cfg.max_steps is not None:
            total = cfg.max_steps
        elif cfg.epochs is not None:
            total = max(1, math.ceil(cfg.epochs * n_batches / A))
        else:
            total = DEFAULT_MAX_STEPS
        eval_every = cfg.eval_steps or max(1, total // 4)
        step = 0
        if state is not None:
            acc.load_state(state["path"])
            step = state["step"]
        ref_ms = self._reference_backward_ms(calib)
        self.emit("start", {"run": self.method, "total": total, "step": step, "resumed": state is not None,
                            "patched": len((calib or {}).get("layers", {})),
                            "fallback_dense": (calib or {}).get("fallback_dense", [])})

        def stream(start_micro: int):
            epoch, offset = divmod(start_micro, n_batches)
            while True:
                train_loader.set_epoch(epoch)
                sampler.set_epoch(epoch)
                loader = acc.skip_first_batches(train_loader, offset) if offset else train_loader
                for b in loader:
                    yield epoch, b
                epoch, offset = epoch + 1, 0

        batches = stream(step * A)
        use_events = dev.type == "cuda"
        graphs: dict = {}  # --cuda-graphs: batch shape -> its StepGraphs, captured at its first batch
        pool = torch.cuda.graph_pool_handle() if cfg.cuda_graphs else None  # one memory pool for all of them
        status, error, last_ckpt = "completed", None, state["path"] if state else None
        live_bwd: list[float] = []
        run_peak = 0.0
        # One host wait per step, for the loss (a non-finite loss stops the run before its update): the
        # optimizer's work and the next batch's copy run on the GPU while the host goes on. A step's time is
        # the host's, from the end of the step before (the first: from a synchronized GPU); at a step after which
        # something else runs (evaluation, checkpoint, the end) the GPU is waited for, so that no GPU work is
        # left out of the steps' times or counted in them twice.
        _sync(dev)
        with StopRequest() as stop:
            while step < total:
                t_step = time.perf_counter()
                loss_sum, tokens_dev, rows, epoch = torch.zeros((), device=dev), torch.zeros((), device=dev), 0, 0
                timers: list = []  # the backward's CUDA events, read after the wait for the loss
                bwd_ms = 0.0
                replayed = 0  # micro-batches run as graph replays (--cuda-graphs)
                for i in range(A):
                    epoch, batch = next(batches)
                    tokens_dev += batch["attention_mask"].sum()
                    rows += batch["attention_mask"].numel()
                    if cfg.cuda_graphs:
                        key = shape_key(batch)
                        step_graphs = graphs.get(key)
                        if step_graphs is None:  # adds into the .grad tensors, keeping what they hold
                            step_graphs = graphs[key] = StepGraphs(model, batch, scale=1.0 / A, pool=pool)
                        loss_sum += step_graphs.forward(batch).detach().float()
                        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        ev0.record()
                        step_graphs.backward()
                        ev1.record()
                        timers.append((ev0, ev1))
                        replayed += 1
                        continue
                    ctx = acc.no_sync(model) if i < A - 1 else contextlib.nullcontext()
                    with ctx:
                        loss = model(**batch).loss
                        loss_sum += loss.detach().float()
                        if use_events:
                            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            ev0.record()
                            acc.backward(loss / A)
                            ev1.record()
                            timers.append((ev0, ev1))
                        else:
                            t0 = time.perf_counter()
                            acc.backward(loss / A)
                            bwd_ms += (time.perf_counter() - t0) * 1e3
                mean_loss = acc.reduce(loss_sum / A, "mean").item()  # the step's one wait for the GPU
                tokens = int(tokens_dev)
                for ev0, ev1 in timers:
                    ev1.synchronize()  # (done by now)
                    bwd_ms += ev0.elapsed_time(ev1)
                # Ctrl-C / SIGTERM: every process stops after the same step. Across processes that takes a
                # reduction (accelerate's trigger), made here, where the host waits anyway: a request that comes
                # later is seen in the next step, which then finishes. One process reads its flag at the step's end.
                many = acc.num_processes > 1
                if many and stop.requested:
                    acc.set_trigger()
                stopping = many and acc.check_trigger()
                if not math.isfinite(mean_loss):
                    status = "diverged"
                    where = f"last good checkpoint: {last_ckpt}" if last_ckpt else \
                        "no checkpoint was written before it (use --save-steps)"
                    error = (f"loss became non-finite ({mean_loss}) at step {step + 1}; stopped before applying "
                             f"that step; {where}")
                    break
                if cfg.max_grad_norm is not None:
                    acc.clip_grad_norm_(params, cfg.max_grad_norm)
                lr = _lr_at(step, total, cfg)
                for g in optimizer.param_groups:
                    g["lr"] = lr
                optimizer.step()
                optimizer.zero_grad(set_to_none=not keep_grads)  # the graphs keep adding into these
                step += 1
                evaluating = step % eval_every == 0 or step == total
                saving = bool(cfg.save_steps) and step % cfg.save_steps == 0 and step < total
                if evaluating or saving or stopping:
                    _sync(dev)
                rec = {"type": "train", "step": step, "epoch": epoch, "loss": mean_loss, "lr": lr,
                       "backward_ms": bwd_ms, "step_ms": (time.perf_counter() - t_step) * 1e3,
                       "peak_mem_mb": _peak_memory_mb(dev), "tokens": tokens, "rows": rows}
                if cfg.cuda_graphs:
                    rec["graph_replays"] = replayed  # of the step's grad_accum micro-batches
                    rec["graphs"] = len(graphs)  # captured so far (one per batch shape)
                if dev.type == "cuda":  # this step's own peak too (the run's peak is the running maximum)
                    rec["step_peak_mem_mb"] = rec["peak_mem_mb"]
                    run_peak = rec["peak_mem_mb"] = max(run_peak, rec["peak_mem_mb"])
                    torch.cuda.reset_peak_memory_stats(dev)
                live_bwd.append(bwd_ms)
                if ref_ms:
                    recent = live_bwd[-20:]
                    rec["speedup_backward"] = ref_ms / statistics.fmean(recent)
                self._log(rec)
                self.emit("step", {"run": self.method, **rec, "total": total})
                if evaluating:
                    ev = {"type": "eval", "step": step, **evaluate(model, eval_loader, acc, self.data.task)}
                    self._log(ev)
                    self.emit("eval", {"run": self.method, **ev})
                if stopping or (not many and stop.requested):
                    status = "interrupted"
                    last_ckpt = str(self._save_checkpoint(step, calib))
                    break
                if saving:
                    last_ckpt = str(self._save_checkpoint(step, calib))
        for step_graphs in graphs.values():
            step_graphs.close()  # and with the last of them their memory pool, before the model is saved
        graphs.clear()
        if status == "completed":
            last_ckpt = str(self._save_checkpoint(step, calib))
            self._save_model(model, loaded)
        summary = {"status": status, "method": self.method, "total_steps": total,
                   **summarize_records(self.records), "checkpoint": last_ckpt,
                   "model_dir": str(self.dir / MODEL_DIR) if status == "completed" else None,
                   "calibration": calib, "device": device_name(dev), "num_processes": acc.num_processes,
                   "peak_mem_kind": "torch.cuda.max_memory_allocated" if dev.type == "cuda" else
                   "process max RSS (CPU: grows over the runs of one process)"}
        if cfg.compile:  # what Dynamo made of this run's model (this process)
            graphs, breaks = (a - b for a, b in zip(_dynamo_counts(), dynamo_before))
            summary["compile"] = {"mode": cfg.compile, "graphs": graphs, "graph_breaks": breaks}
        if error:
            summary["error"] = error
        if self.main:
            _write_json(self.dir / SUMMARY, summary)
        self.emit("end", {"run": self.method, "summary": summary})
        return summary

    def _reference_backward_ms(self, calib: dict | None) -> float | None:
        if self.method != "sebp":
            return None
        if self.dense_ref and self.dense_ref.get("mean_backward_ms"):
            return self.dense_ref["mean_backward_ms"]
        return (calib or {}).get("dense_backward_ms")

    def _save_model(self, model, loaded: LoadedModel) -> None:
        """The fine-tuned model as a plain Hugging Face model: LoRA merged, SEBP layers back to nn.Linear."""
        from .patch import unpatch_model

        from accelerate.utils import DistributedType

        self.acc.wait_for_everyone()
        sharded = self.acc.distributed_type == DistributedType.FSDP
        state_dict = self.acc.get_state_dict(model) if sharded and not self.cfg.lora else None  # gathered
        plain = self.acc.unwrap_model(model)
        if self.cfg.lora:
            plain = plain.merge_and_unload()
        unpatch_model(plain)
        if self.main:
            from transformers.utils import logging as hf_logging

            target = self.dir / MODEL_DIR
            hf_logging.disable_progress_bar()
            try:
                plain.save_pretrained(target, state_dict=state_dict, safe_serialization=True)
            finally:
                hf_logging.enable_progress_bar()
            if loaded.tokenizer is not None and hasattr(loaded.tokenizer, "save_pretrained"):
                loaded.tokenizer.save_pretrained(target)
        self.acc.wait_for_everyone()


# ------------------------------------------------------------------------------------------ top level


def _analysis_on_main(loaded: LoadedModel, cfg: FinetuneConfig, acc, progress) -> dict:
    """``--auto-eps``: the main process analyses, the others take its report (one analysis, not one per
    process). An analysis that fails stops every process with the main one's message."""
    from .analyze import analyze_for_finetune

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
    from . import report as rep

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
    with torch.random.fork_rng(devices=_rng_devices(acc.device)):
        density = measure_density(model, _first_batches(cfg, data, acc.device), cands, acc.device, acc.autocast)
    model.zero_grad(set_to_none=True)
    if max(density.values()) == 0.0:
        raise FinetuneError("with these eps values no row of any layer is active on the first batches: SEBP "
                            "would drop every gradient; pick a smaller --eps (or use --auto-eps)")


def _compare(dense: dict, sebp: dict) -> dict:
    out = {}
    for what in ("backward", "step"):
        for stat, suffix in (("mean", ""), ("median", "_median")):
            d, s = dense.get(f"{stat}_{what}_ms"), sebp.get(f"{stat}_{what}_ms")
            if d and s:
                out[f"speedup_{what}{suffix}"] = d / s
    for key, name in (("peak_mem_mb", "peak_mem_ratio"), ("peak_mem_mb_from_step3", "peak_mem_ratio_from_step3")):
        if dense.get(key) and sebp.get(key):
            out[name] = sebp[key] / dense[key]
    de, se = dense.get("final_eval", {}), sebp.get("final_eval", {})
    for k in de:
        if k in se:
            out[f"delta_{k}"] = se[k] - de[k]
    return out


def _loss_gap(dense_records: list[dict], sebp_records: list[dict]) -> float | None:
    d = {r["step"]: r["loss"] for r in dense_records if r.get("type") == "train"}
    s = {r["step"]: r["loss"] for r in sebp_records if r.get("type") == "train"}
    common = sorted(set(d) & set(s))
    return max(abs(d[k] - s[k]) for k in common) if common else None


def finetune(cfg: FinetuneConfig, *, resume: bool = False, overwrite: bool = False, on_event: Event | None = None,
             load_fn: Callable[[], LoadedModel] | None = None, data: TrainData | None = None) -> dict:
    """Train ``cfg.method`` (or dense then SEBP with ``cfg.compare``), write the output directory, and return
    the summary. ``load_fn``/``data`` replace the asset loading (the GPU script uses models built from
    configs and synthetic batches). Raises FinetuneError for bad input, a diverged run included."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    emit = on_event or (lambda kind, payload: None)
    if cfg.precision == "fp16" and not torch.cuda.is_available():
        raise FinetuneError("fp16 training needs a CUDA GPU; use --bf16 on CPU")
    dynamo = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no")
    if dynamo.lower() not in ("", "no"):
        raise FinetuneError(f"ACCELERATE_DYNAMO_BACKEND={dynamo} is set (accelerate's config, or TrainingArguments("
                            "torch_compile=True) earlier in this process); finetune compiles only with --compile "
                            "MODE, which knows the SEBP layers: unset it")
    # dynamo_backend="no": accelerate's own compile (from the environment) would bypass --compile's checks
    # non_blocking: batches (page-locked on a GPU, see _loaders) go to the device without waiting for it
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
    if _graphed_compile(cfg, acc):
        _check_graphs_possible(cfg, acc, f"--compile {cfg.compile}")
    out = Path(cfg.output_dir)
    resuming, stale = check_output_dir(cfg, resume, overwrite)
    from accelerate.utils import set_seed

    set_seed(cfg.seed)  # the new head's initialization and the --auto-eps analysis are part of the run

    if load_fn is None:
        task = model_task(cfg.model, cfg.task)
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
    if cfg.auto_eps and not resuming:
        first.model.to(acc.device)
    report = _load_report(cfg, first, out, resuming,
                          progress=lambda done, total: emit("analysis", {"done": done, "total": total}), acc=acc)
    report_layers = None
    if report is not None:
        from .report import layer_configs_from_report

        # No --mode: each layer's recommendation (threshold where the analysis found a knee, else exact).
        report_layers = layer_configs_from_report(report, cfg.mode, backend=cfg.backend)
    if "sebp" in cfg.methods():  # bad targets and an eps that drops everything fail before anything is written
        cands = candidate_layers(first.model, cfg, report_layers)
        if any(c.mode == "threshold" and c.eps > 0 for c in cands.values()):
            _check_some_rows_active(first.model, cfg, data, cands, acc)
    del first

    # Everything is checked: only now is an old run replaced and the new one written.
    made_dir = not out.exists()
    if acc.is_main_process:
        _clear(stale)
        out.mkdir(parents=True, exist_ok=True)
        if report is not None and cfg.auto_eps and not resuming:
            from .report import save_report

            save_report(report, out / "report.json")
        if not resuming:
            _write_json(out / RUN_CONFIG, {
                "tool": "sebp-probe finetune", "created": datetime.datetime.now().isoformat(timespec="seconds"),
                "config": cfg.to_dict(), "versions": versions(), "device": device_name(acc.device),
                "num_processes": acc.num_processes, "data": data.identity,
                "train_examples": len(data.train), "eval_examples": len(data.eval)})
    acc.wait_for_everyone()

    summaries, records, dense_ref = {}, {}, None
    try:
        for method in cfg.methods():
            run_dir = out / method if cfg.compare else out
            run = Run(cfg, method, run_dir, acc, data, load_fn, report_layers, dense_ref, emit)
            summaries[method] = run.run(resuming)
            records[method] = run.records
            if method == "dense":
                dense_ref = summaries[method]
            if summaries[method]["status"] != "completed":
                break
    except BaseException:
        if not resuming and acc.is_main_process and not _has_progress(out):  # failed before any step: leave no trace
            _clear([out / e for e in os.listdir(out)])
            if made_dir:
                out.rmdir()
        raise

    summaries = {m: summaries[m] for m in ("dense", "sebp") if m in summaries}  # dense first, whatever the order
    records = {m: records[m] for m in summaries if m in records}
    summary = dict(summaries[cfg.methods()[0]]) if not cfg.compare else {"runs": summaries,
                                                                          "order": list(cfg.methods())}
    if cfg.compare and all(summaries.get(m, {}).get("status") == "completed" for m in ("dense", "sebp")):
        summary["comparison"] = _compare(summaries["dense"], summaries["sebp"])
        summary["comparison"]["max_abs_loss_gap"] = _loss_gap(records["dense"], records["sebp"])
    statuses = [s["status"] for s in summaries.values()]
    summary["status"] = next((s for s in ("diverged", "interrupted") if s in statuses), "completed")
    summary["output_dir"] = str(out)
    if acc.is_main_process:
        if cfg.compare:
            _write_json(out / SUMMARY, summary)
        summary["plots"] = _plot(records, out)
    acc.wait_for_everyone()
    acc.end_training()
    err = next((s.get("error") for s in summaries.values() if s.get("error")), None)
    if err:
        raise FinetuneError(err)
    return summary


def _dynamo_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) by Dynamo in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _graphed_compile(cfg: FinetuneConfig, acc) -> bool:
    """Does ``--compile`` record CUDA graphs here (its mode does, on a CUDA device)?"""
    return cfg.compile in GRAPHED_COMPILE_MODES and acc.device.type == "cuda"


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
    from .plots import plot_training_curves

    return [str(p) for p in plot_training_curves(records, out)]
