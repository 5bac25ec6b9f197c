"""Shared test utilities: a dense reference backward and a mismatch report."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

# Per-dtype absolute slack on top of "at most 2x plain torch's error against fp64" (flash-attention rule).
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float64: 1e-12}


def dense_grads(x, w, b, dy, dtype=None):
    """dX, dW, db of F.linear by autograd, in ``dtype`` (default: the inputs' dtype)."""
    dtype = dtype or x.dtype
    x_ = x.detach().to(dtype).requires_grad_()
    w_ = w.detach().to(dtype).requires_grad_()
    b_ = b.detach().to(dtype).requires_grad_() if b is not None else None
    F.linear(x_, w_, b_).backward(dy.to(dtype))
    return x_.grad, w_.grad, (b_.grad if b_ is not None else None)


def loss_and_grads(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The model's own loss of ``batch`` (detached) and a copy of each parameter's gradient from its backward,
    the gradients zeroed first."""
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close_report(actual, expected, atol, rtol=0.0, name="tensor"):
    """assert_close that prints the first mismatching positions when it fails."""
    actual, expected = actual.double(), expected.double()
    bad = ~torch.isclose(actual, expected, atol=atol, rtol=rtol, equal_nan=True)
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        rows = [f"  {tuple(i)}: got {actual[tuple(i)].item():.6g}, want {expected[tuple(i)].item():.6g}"
                for i in idx]
        raise AssertionError(f"{name}: {int(bad.sum())} of {bad.numel()} mismatch (atol={atol})\n"
                             + "\n".join(rows))


def assert_within_torch_error(actual, ref64, torch_same_dtype, dtype, name="tensor"):
    """|actual - ref64| <= 2 * |torch_dtype - ref64| + atol, elementwise in the max sense."""
    err = (actual.double() - ref64).abs().max().item()
    base = (torch_same_dtype.double() - ref64).abs().max().item()
    bound = 2 * base + ATOL[dtype]
    assert err <= bound, f"{name}: max error {err:.3g} > bound {bound:.3g} (torch's own error {base:.3g})"


# --- gradient-statistics collector: chosen dL/dY fed through real hooks, and a field-by-field comparison ---

def special_rows_grad(shape, dtype, seed=0, device="cpu"):
    """A dL/dY of ``shape`` (last dim = features) whose rows cycle through: exact zeros, magnitudes spread
    over 12 decades, round-off noise down to the dtype's subnormals, a NaN, a +-Inf, NaN and Inf together,
    and signed zeros among normal values."""
    g = torch.Generator().manual_seed(seed)
    *lead, cols = shape
    rows = int(torch.tensor(lead).prod()) if lead else 1
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-10, 2, cols)[torch.randperm(cols, generator=g)]
    kind = torch.arange(rows)[torch.randperm(rows, generator=g)] % 8
    col = torch.randint(0, cols, (rows,), generator=g)
    r = torch.arange(rows)
    x[kind == 0] = 0.0
    x[kind == 1] *= 1e-36 if dtype == torch.float32 else 1e-5  # down to subnormals (and exact zeros)
    x[r[kind == 2], col[kind == 2]] = float("nan")
    x[r[kind == 3], col[kind == 3]] = float("-inf")
    x[r[kind == 4], col[kind == 4]] = float("inf")
    x[r[kind == 4], (col[kind == 4] + 1) % cols] = float("nan")
    x[kind == 5, ::2] = -0.0
    return x.to(dtype).reshape(shape).to(device)


class LinearStack(torch.nn.Module):
    """Independent linears ``proj.i`` (in_i -> out_i): each call's output gets a chosen gradient."""

    def __init__(self, shapes, dtype=torch.float32, device="cpu"):
        super().__init__()
        self.proj = torch.nn.ModuleList(torch.nn.Linear(i, o, dtype=dtype, device=device) for i, o in shapes)


def collect_with_grads(model: LinearStack, steps, groups=None, **collector_kw):
    """Run the collector over ``steps``: each a list of (layer index, leading shape, dL/dY) calls of one
    batch; the gradients reach the hooks exactly as given. ``groups``: per step, the batch's row groups (the
    calls with that many rows get them) or None."""
    from sebp_probe.analysis.hooks import GradientStatsCollector

    p = next(model.parameters())
    with GradientStatsCollector(model, target_modules="all-linear", **collector_kw) as col:
        for i, calls in enumerate(steps):
            g = groups[i] if groups is not None else None
            with col.batch(row_groups=None if g is None else g.to(p.device)):
                outs = [model.proj[i](torch.randn(*lead, model.proj[i].in_features, dtype=p.dtype, device=p.device))
                        for i, lead, _ in calls]
                torch.autograd.backward(outs, [g.to(p.device) for _, _, g in calls])
    return col


def _first_mismatches(a, b, name):
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    bad = ~((a == b) | (a.isnan() & b.isnan()))
    idx = bad.nonzero()[:6].tolist()
    return f"{name}: {int(bad.sum())} mismatches, first " + ", ".join(
        f"{tuple(i)} got {a[tuple(i)].item():.6g} want {b[tuple(i)].item():.6g}" for i in idx)


def assert_same_stats(got, want):
    """Every field of every LayerStats equal (NaN equal to NaN); names the first mismatches."""
    import numpy as np

    assert got.batches == want.batches and list(got.layers) == list(want.layers)
    for name, b in want.layers.items():
        a = got.layers[name]
        for f in ("rows", "elements", "zero_rows", "nonfinite_rows", "zero_elements", "max_abs", "element_hist",
                  "row_hist"):
            x, y = np.asarray(getattr(a, f)), np.asarray(getattr(b, f))
            assert x.shape == y.shape and np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), \
                _first_mismatches(x, y, f"{name}.{f}")
        assert all(x.dtype == y.dtype for x, y in zip(a.row_octaves, b.row_octaves))
        x, y = a.octaves(), b.octaves()
        assert np.array_equal(x, y), _first_mismatches(x, y, f"{name}.row_octaves")
        x, y = a.group_octaves_seen(), b.group_octaves_seen()
        assert np.array_equal(x, y), _first_mismatches(x, y, f"{name}.group_octaves")


def run_under_interpreter(*test_files) -> None:
    """Run test files in one pytest subprocess with TRITON_INTERPRET=1 (the variable must be set before the
    kernels are decorated, and other tests have imported them already); fail with its output, which names
    the failing tests."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short", "-rfE",
         *map(str, test_files)], cwd=root, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"interpreter suites failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-3000:]}"


def fail_launches(monkeypatch, launcher, failing: set) -> list:
    """Make ``launcher.launch_planned`` (a FastLaunch) raise Triton's OutOfResources on the calls whose numbers
    (from 0) are in ``failing``, as a GPU with too little shared memory does at a kernel's first launch; the
    set may grow later. Returns the list of (plan, keywords) of every call."""
    from triton.runtime.errors import OutOfResources

    real, calls = launcher.launch_planned, []

    def launch(grid, plan, n_tensors, args, kw):
        calls.append((plan, kw))
        if len(calls) - 1 in failing:
            raise OutOfResources(300000, 232448, "shared memory")
        return real(grid, plan, n_tensors, args, kw)

    monkeypatch.setattr(launcher, "launch_planned", launch)
    return calls


@contextlib.contextmanager
def roundoff_first_queries(model: torch.nn.Module, suffix: str = "q_proj", scale: float = 1e-11):
    """Round-off in the query gradient of each sample's first real token, where the CPU's attention gives none.

    In a left-padded decoder the first real token attends only to itself: its softmax is constant and dL/dq
    is zero in exact arithmetic. Some CPUs' attention kernels leave round-off of about 1e-11 there (the
    noise rows the knee detector must separate); others (an AMD EPYC with AVX2, 2026-11-23) give exactly 0.
    This puts ``scale``-sized values into exactly-zero first-token rows of every ``suffix`` module's output
    gradient, so such tests see the noise on either kind of CPU; rows that already have round-off are left
    as they are. Its forward hook goes first (``prepend``), so its gradient hook runs before the collector's
    and every other hook on the same output, and they all see the noise."""
    state: dict = {}
    handles = [model.register_forward_pre_hook(
        lambda m, args, kw: state.__setitem__("mask", kw.get("attention_mask")), with_kwargs=True)]

    def add(grad):
        mask = state["mask"]
        first = ((mask.cumsum(1) == 1) & (mask == 1)).reshape(-1)  # the first real token of each sample
        g = grad.reshape(-1, grad.shape[-1])
        quiet = first & (g == 0).all(dim=1)
        if not quiet.any():
            return grad
        ramp = torch.linspace(1.0, 2.0, g.shape[1], dtype=g.dtype, device=g.device) * scale
        return (g + quiet[:, None].to(g.dtype) * ramp).view_as(grad)  # quiet rows are all zero

    def on_forward(module, args, out):
        if out.requires_grad:
            out.register_hook(add)

    for name, module in model.named_modules():
        if name.endswith(suffix):
            handles.append(module.register_forward_hook(on_forward, prepend=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def torchrun_failure(stderr: str, returncode: int | None, timeout: float | None = None,
                     running: list[int] | None = None) -> str:
    """What a failed or hung 2-process torchrun said, for an assertion message: the ranks that failed (torchrun's
    summary: rank, exit code or signal) or, for a hang, the ranks still running when it was stopped
    (``running``), then the last lines each of those ranks wrote to stderr (``[defaultN]:``, as
    :func:`run_torchrun` has torchrun tee them; ``[rankN]:`` from torch's own messages), else the end of
    stderr."""
    import re

    lines = stderr.splitlines()
    if returncode is None:
        failed = [str(r) for r in running or []]
        head = f"torchrun hung: no exit within {timeout:.0f} s" + (
            f"; rank(s) still running: {', '.join(failed)}" if failed else "; no rank was running")
    else:
        failed = sorted(set(re.findall(r"rank\s*:\s*(\d+)", stderr))
                        | set(re.findall(r"\[rank(\d+)\]:.*Error", stderr)))
        head = f"torchrun exited {returncode}" + (f"; failed rank(s): {', '.join(failed)}" if failed
                                                  else "; no rank named in its output")
    summary = [x for x in lines if re.search(r"^\s*(rank|exitcode|error_file|traceback|host|time)\s*:", x)]
    own = []
    for r in failed:
        mine = [x for x in lines if x.startswith((f"[default{r}]:", f"[rank{r}]:"))]
        own += [f"-- rank {r}'s last lines of stderr:"] + mine[-60:] if mine else []
    return "\n".join([head, *summary[-12:], *(own or lines[-40:])])


_RUN_TAG = "SEBP_TORCHRUN_TAG"  # set in a torchrun's environment: its workers inherit it


def _tagged(tag: str) -> list[tuple[int, int | None]]:
    """(pid, LOCAL_RANK or None) of every live process whose environment holds ``_RUN_TAG=tag``: a torchrun of
    :func:`run_torchrun` and its workers, which torch's launcher starts in sessions of their own (so a signal to
    torchrun's process group does not reach them). Read from /proc (Linux; elsewhere none)."""
    import os

    want = f"{_RUN_TAG}={tag}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":  # exited, not yet reaped
                    continue
            with open(f"/proc/{pid}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
        except (OSError, IndexError):
            continue
        if want in env:
            rank = next((int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"LOCAL_RANK=")), None)
            found.append((int(pid), rank))
    return found


def run_torchrun(args: list[str], timeout: float, env: dict | None = None, **popen_kw) -> tuple[str, str]:
    """``python -m torch.distributed.run --standalone --nproc_per_node 2 ARGS`` through this interpreter (the venv's
    torchrun script need not be on PATH, as under CI); (stdout, stderr), each rank's stderr teed into stderr with
    its ``[defaultN]:`` prefix (stdout as the ranks wrote it). A failure fails the test with
    :func:`torchrun_failure`'s message: the failed ranks and their own last lines (a rank killed by a signal
    first prints its threads' Python stacks: ``PYTHONFAULTHANDLER``). A hang: at ``timeout`` the
    ranks still running are noted, torchrun and its workers killed (each worker has a session of its own, so
    they are found by a tag in their environment), and the test fails naming those ranks."""
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    import uuid

    import pytest

    tag = uuid.uuid4().hex
    # PYTHONFAULTHANDLER: a rank killed by a signal (an abort in C++: "terminate called without an active
    # exception", twice in fresh-clone CI) prints every thread's Python stack first, into its teed stderr
    env = {"PYTHONFAULTHANDLER": "1", **(os.environ if env is None else env), _RUN_TAG: tag}
    with tempfile.TemporaryDirectory(prefix="torchrun-logs-") as logs:
        p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                              "--tee", "2", "--log-dir", logs, *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True, env=env, **popen_kw)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            procs = _tagged(tag)
            running = sorted({r for _, r in procs if r is not None})  # a rank's own children carry its rank too
            for pid, _ in procs:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                out, err = p.communicate(timeout=60)
            except subprocess.TimeoutExpired:  # something untagged still holds the pipes: the whole group goes
                os.killpg(p.pid, signal.SIGKILL)
                out, err = p.communicate()
            pytest.fail(torchrun_failure(err, None, timeout, running))
    if p.returncode != 0:
        pytest.fail(torchrun_failure(err, p.returncode))
    return out, err


def exit_after_teardown() -> None:
    """The end of a worker under :func:`run_torchrun` (its results written): every rank past a barrier, the
    process group destroyed, then out through ``os._exit(0)`` without the interpreter's own teardown. With the
    barrier and destroy alone a rank still aborted at exit now and then ("terminate called without an active
    exception", no Python frame: gloo's threads torn down during finalization): in fresh-clone CI on 1eeaa31,
    and in 1 of 10 runs of the FSDP worker here (0 of 30 with this)."""
    import os
    import sys

    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def load_benchmark(name: str, folder: str = "benchmarks"):
    """The module of ``FOLDER/NAME.py`` (scripts, not a package: ``benchmarks/``, ``tools/docs/``), registered in
    ``sys.modules`` under ``name`` (dataclasses and pickling look their module up there); the caller may pop it
    again."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class FakeCudaDriver:
    """A stand-in for Triton's active driver on a machine without a GPU: only what Triton's front end asks of one
    to lower a kernel to TTIR, which Inductor does to find what a ``wrap_triton`` kernel writes (torch 2.11 asks
    it as Dynamo traces; without a driver it takes every input as written)."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)
