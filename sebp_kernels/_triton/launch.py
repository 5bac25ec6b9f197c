"""Kernel launches with less host work than Triton's JIT launcher.

``fn[grid](...)`` binds the arguments, specialises each one, builds a cache key, checks the globals the
kernel read and then calls the compiled kernel's C launcher. Measured on the H100 host of the device
machine (Triton 3.6): 16.5 us per launch of an empty kernel, 10.5 us through the compiled kernel directly.
The backward of one layer launches several kernels and the collector one per hook, so this is a real share
of a small model's step.

:class:`FastLaunch` goes through Triton's launcher the first time it sees a specialisation, keeps the
compiled kernel it returns, and afterwards calls that kernel's launcher itself. Its cache key holds, for
every argument, all that Triton specialises on (tensor dtype and 16-byte alignment, integer == 1,
divisibility by 16 and 32-bit range) plus the constexprs and launch options, so a key never maps to a
kernel compiled for different arguments (it may only split one Triton specialisation into several keys).
Under the interpreter, without CUDA, or while Triton launch hooks are set (profilers), every call takes the
JIT path.

The kernels' row count and the integers that follow from it (splits, tile and program counts) are declared
``do_not_specialize``: padded batches change them with every step, and Triton would otherwise compile a
kernel anew for each mix of "== 1" and "divisible by 16" among them. On an H100, on a fresh Triton cache,
4 of SFTTrainer's 30 timed steps on padded llama-3.2-1b-sft batches took 3.6 to 6.3 s without these
declarations; with them 1 step took 3.9 s (results/trainer.json, run eager). The feature sizes and strides,
fixed per layer, stay specialised. The row count's pointer (its 16-byte alignment: the count of a layer's own
rows and the padding's count sit at different offsets) and the fused gradient kernel's bias column blocks
(``DB_COLS``, not divisible by 16 for Llama's 512-wide key/value projections, whatever ``DO_DB`` says) are
declared ``do_not_specialize`` too: specialised, they made a one-GPU `finetune` of the Llama-3.2-1B shape on
SFT batches compile ``_grads_kernel`` once more at its ninth step, 4.7 s (Triton's JIT hook shows it).
"""
from __future__ import annotations

import itertools
import warnings

import torch
from triton.runtime.errors import OutOfResources

from ..interpret import INTERPRET

# Numbers of launch plans (see FastLaunch.launch_planned): never reused, even across threads (the autograd
# engine runs each device's backward on its own thread; next() on a count is atomic under the GIL).
plan_ids = itertools.count()
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


def _spec(v):
    """What Triton could specialise on for one argument (a superset of it)."""
    if type(v) is int:
        return (v == 1, not v & 15, _I32_MIN <= v <= _I32_MAX)
    if isinstance(v, torch.Tensor):
        return (v.dtype, not v.data_ptr() & 15)
    if type(v) is float:
        return float
    return (type(v), v)  # bool, None, anything else: by value


# The current CUDA stream of a device, as Triton's own launcher gets it (absent from CPU-only torch builds,
# which then always take the JIT path).
_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _active(hook) -> bool:
    """Whether a Triton launch hook would do anything: None or an empty chain (Triton >= 3.5 keeps a
    ``HookChain`` there, empty unless a profiler added to it) does not."""
    return hook is not None and bool(getattr(hook, "calls", True))


class FastLaunch:
    """Wraps a ``@triton.jit`` kernel: ``FastLaunch(kernel)[grid](*args, **constexprs_and_options)``.

    Positional arguments must come first in the kernel's signature order and the first must be a tensor
    (its device picks the stream); keywords are the remaining parameters (constexprs) and launch options.
    """

    def __init__(self, fn):
        self.fn = fn
        self._cache: dict = {}
        self._hooks = None
        if not INTERPRET and _stream is not None:
            from triton import knobs

            self._hooks = knobs.runtime

    def __getitem__(self, grid):
        return lambda *args, **kw: self._launch(grid, args, kw)

    def _launch(self, grid, args, kw):
        if self._hooks is None:
            return self.fn[grid](*args, **kw)
        dev = args[0].get_device()
        return self._run(grid, args, kw, dev, (dev, tuple(map(_spec, args)), tuple(kw.items())))

    def launch_planned(self, grid, plan: int, n_tensors: int, args, kw):
        """A launch whose caller vouches that the int ``plan`` fixes everything Triton specialises on but the
        alignment of the first ``n_tensors`` arguments (the tensors): every integer and float argument, every
        tensor's dtype, the constexprs and the options. The key then costs one ``data_ptr`` per tensor
        instead of a ``_spec`` per argument (the fused gradient kernel has 37 arguments)."""
        if self._hooks is None:
            return self.fn[grid](*args, **kw)
        dev = args[0].get_device()
        return self._run(grid, args, kw, dev, (dev, plan, *[not a.data_ptr() & 15 for a in args[:n_tensors]]))

    def clear(self) -> None:
        """Forget the compiled kernels kept for the fast path (the next launch of each key goes through
        Triton again, which has them cached)."""
        self._cache.clear()

    def _run(self, grid, args, kw, dev, key):
        hit = self._cache.get(key)
        if hit is not None and not _active(self._hooks.launch_enter_hook):
            k, tail = hit
            g1 = grid[1] if len(grid) > 1 else 1
            g2 = grid[2] if len(grid) > 2 else 1
            k.run(grid[0], g1, g2, _stream(dev), k.function, k.packed_metadata, None, None, None, *args, *tail)
            return k
        k = self.fn[grid](*args, **kw)
        if hasattr(k, "result"):  # an asynchronous compile's future
            k = k.result()
        if getattr(k, "function", None) is not None:
            names = self.fn.arg_names[len(args):]
            self._cache[key] = (k, tuple(kw[n] for n in names))
        return k


class Plans:
    """Launch plans by key (shapes, dtypes, strides, settings), each worked out once and numbered from
    ``plan_ids`` for :meth:`FastLaunch.launch_planned`. Past ``limit`` keys (many shapes: dynamic padding) it
    starts afresh, and so do the fast-path caches of its launchers, so memory stays bounded."""

    def __init__(self, *launchers: FastLaunch, limit: int = 4096):
        self._plans: dict = {}
        self._launchers = launchers
        self._limit = limit

    def get(self, key):
        return self._plans.get(key)

    def add(self, key, plan):
        if len(self._plans) >= self._limit:
            self._plans.clear()
            for launcher in self._launchers:
                launcher.clear()
        self._plans[key] = plan
        return plan


def fit_to_device(chosen: dict, device: torch.device, settings, run, what: str):
    """``run(setting)`` with the first of ``settings`` whose kernels launch on ``device``, starting from the
    one kept for it in ``chosen`` (device index -> position). A launch that fails for lack of resources
    (Triton's ``OutOfResources``: a GPU with less shared memory than the H100's) moves to the next setting,
    kept from then on, with a one-line warning; past the last the error stands."""
    i = chosen.get(device.index, 0)
    while True:
        try:
            return run(settings[i])
        except OutOfResources as err:
            if i + 1 >= len(settings):
                raise
            i = chosen[device.index] = i + 1
            warnings.warn(f"sebp: {what} on {device} (setting {i} of {len(settings) - 1}): its shared memory does "
                          f"not hold the H100 setting's: {str(err).splitlines()[0]}", stacklevel=3)
