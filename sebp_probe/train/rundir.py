"""A fine-tune's output directory: what it holds, when it may be replaced or resumed, its JSON files.

    run_config.json  metrics.jsonl  summary.json  loss.png  eval.png  model/  checkpoints/step-000040/

(``compare`` puts one run directory per method under it, ``dense/`` and ``sebp/``.)
"""
from __future__ import annotations

import json
import platform
import shutil
from pathlib import Path

import torch

from ..config import FinetuneConfig, FinetuneError

RUN_CONFIG = "run_config.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
STATE = "trainer_state.json"
CHECKPOINTS = "checkpoints"
MODEL_DIR = "model"
PARTIAL = ".partial-"  # a checkpoint being written: renamed to step-N once complete
ASIDE = ".replaced"  # an --overwrite's old run, until the new one has taken a step (SetAside)
# What a run directory holds; anything else in it is the user's and is never deleted.
OWN_ENTRIES = (RUN_CONFIG, METRICS, SUMMARY, CHECKPOINTS, MODEL_DIR, "dense", "sebp", "resprop", "report.json",
               "loss.png", "eval.png")
# A resumed run must be the same run: every setting must match except these.
RESUMABLE_CHANGES = ("output_dir", "eval_steps", "save_steps", "save_total_limit", "compile",
                     "compile_scope", "deterministic", "sebp_first", "probe_every")  # the same math
# Settings added after runs were first written: a run config without one ran with this value.
ADDED_SETTINGS = {"sebp_norms": False, "sebp_acts": False, "cuda_graphs": False, "graph_bucket": 32,
                  "compile": None, "sebp_first": False, "reuse": 0.9,
                  "head": "full", "probe_every": None}


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    tmp.replace(path)  # atomic: a killed run never leaves half a file


def config_changes(old: dict, new: dict) -> list[str]:
    keys = sorted(set(old) | set(new))
    out = []
    for k in keys:
        if k in RESUMABLE_CHANGES:
            continue
        if isinstance(old.get(k), dict) and isinstance(new.get(k), dict):
            out += [f"{k}.{s}" for s in config_changes(old[k], new[k])]
        elif old.get(k, ADDED_SETTINGS.get(k)) != new.get(k, ADDED_SETTINGS.get(k)):
            out.append(k)
    return out


# What identifies a run's data (textdata.load_text_data): a resumed run must see the same.
DATA_IDENTITY = ("origin", "size", "rows", "num_samples", "sha256")


def data_changes(stored: dict, now: dict) -> list[str]:
    """``part key old -> new`` for each identity field the two data identities ({train, eval}) both record
    and disagree on."""
    out = []
    for part in (p for p in now if p in stored):
        a, b = stored[part], now[part]
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{part} {k} {a[k]} -> {b[k]}" for k in DATA_IDENTITY if k in a and k in b and a[k] != b[k]]
    return out


def check_resume_data(out: Path, identity: dict) -> None:
    """Refuse to resume the run in ``out`` on data other than it trained on (the file changed on disk, or a
    relative path that names another file from here)."""
    stored = (read_json(out / RUN_CONFIG) or {}).get("data") or {}
    changed = data_changes(stored, identity)
    if changed:
        raise FinetuneError(f"--resume: the data are not those the run in {out} trained on ({'; '.join(changed[:3])}"
                            f"); resume with the same data or use --overwrite")


def check_resume_processes(out: Path, num_processes: int) -> None:
    """Refuse to resume the run in ``out`` on another number of processes: each process's share of every batch,
    hence the data order and the (sharded) checkpoint, depends on it."""
    stored = (read_json(out / RUN_CONFIG) or {}).get("num_processes")
    if stored is not None and stored != num_processes:
        raise FinetuneError(f"--resume: the run in {out} trained on {stored} process(es), this launch has "
                            f"{num_processes}; resume it with {stored} (its data order and checkpoints depend on it)")


def has_progress(out: Path) -> bool:
    """Did the run in ``out`` train at all (metrics or checkpoints)? One that failed before is replaceable."""
    for d in (out, out / "dense", out / "sebp", out / "resprop"):
        m = d / METRICS
        if (m.exists() and m.stat().st_size) or (d / CHECKPOINTS).exists():
            return True
    return False


def check_output_dir(cfg: FinetuneConfig, resume: bool, overwrite: bool) -> tuple[bool, list[Path]]:
    """(resuming, entries to replace before a fresh run); raises FinetuneError when the directory is refused.

    A directory holding another run is refused unless ``resume`` (same settings) or ``overwrite``; one
    holding anything else is always refused, so no user file is ever deleted. Nothing is changed here.
    """
    if resume and overwrite:
        raise FinetuneError("--resume and --overwrite contradict each other; pass one")
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise FinetuneError(f"output dir {out} is a file")
    entries = sorted(p.name for p in out.iterdir()) if out.exists() else []
    if ASIDE in entries:  # only a killed process leaves it: the user decides which run to keep
        raise FinetuneError(f"{out / ASIDE} holds the run an interrupted --overwrite replaced: move its files back "
                            f"into {out} (or delete it), then run again")
    stored = read_json(out / RUN_CONFIG) if entries else None
    if resume:
        if stored is None:
            raise FinetuneError(f"--resume: {out} holds no sebp-probe finetune run to resume")
        changed = config_changes(stored.get("config", {}), cfg.to_dict())
        origin = ((stored.get("data") or {}).get("train") or {}).get("origin")
        if "data.dataset" in changed and origin and str(Path(cfg.data.dataset).expanduser().resolve()) == origin:
            changed.remove("data.dataset")  # the same file by another path: its content is checked once read
        if changed:
            raise FinetuneError(f"--resume: settings differ from the run in {out}: {', '.join(changed)}; "
                                "resume with the same settings or use --overwrite")
        return True, []
    if entries:
        if stored is None:
            raise FinetuneError(f"output dir {out} is not empty and holds no sebp-probe run "
                                f"({', '.join(entries[:4])}{' ...' if len(entries) > 4 else ''}); pick another")
        if not overwrite and has_progress(out):
            raise FinetuneError(f"output dir {out} holds another run; pass --resume to continue it or "
                                "--overwrite to replace it")
        foreign = [e for e in entries if e not in OWN_ENTRIES]
        if foreign:
            raise FinetuneError(f"--overwrite: {out} also holds files of its own ({', '.join(foreign[:4])}); "
                                "move them or pick another output dir")
        return False, [out / e for e in entries]
    return False, []


def clear_entries(paths: list[Path]) -> None:
    for p in paths:
        shutil.rmtree(p) if p.is_dir() else p.unlink()


class SetAside:
    """The entries of a run that ``--overwrite`` replaces, moved into ``out/.replaced`` (a rename: nothing is
    copied) until the new run has taken its first step (:meth:`discard`), or put back when it fails before
    that (:meth:`restore`): a new run that cannot start never costs the old one."""

    def __init__(self, out: Path, entries: list[Path]):
        self.out, self.names = out, [p.name for p in entries]
        self.dir = out / ASIDE
        if self.names:
            self.dir.mkdir()
            for name in self.names:
                (out / name).rename(self.dir / name)

    def discard(self) -> None:
        if self.dir.exists():
            shutil.rmtree(self.dir)
        self.names = []

    def restore(self) -> None:
        """Delete what the new run wrote and put the old run back."""
        clear_entries([p for p in self.out.iterdir() if p.name != ASIDE])
        for name in self.names:
            (self.dir / name).rename(self.out / name)
        if self.dir.exists():
            self.dir.rmdir()
        self.names = []


def _step_of(p: Path) -> int | None:
    tail = p.name.removeprefix(PARTIAL).removeprefix("step-")
    return int(tail) if tail.isdigit() else None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first: ``step-N`` folders holding their trainer_state.json (a checkpoint is
    written as ``.partial-step-N``, given its state last, then renamed)."""
    d = run_dir / CHECKPOINTS
    if not d.is_dir():
        return []
    return sorted((p for p in d.iterdir() if p.name.startswith("step-") and _step_of(p) is not None
                   and (p / STATE).exists()), key=_step_of)


def partial_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint folders whose write was cut (a kill, a second Ctrl-C): never resumed from."""
    d = run_dir / CHECKPOINTS
    if not d.is_dir():
        return []
    done = set(list_checkpoints(run_dir))
    return sorted((p for p in d.iterdir() if p.name.startswith(("step-", PARTIAL)) and p not in done),
                  key=lambda p: (_step_of(p) or 0, p.name))


def versions() -> dict:
    """Package versions."""
    import accelerate
    import transformers

    from .._version import __version__

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
