"""Host time of the SEBP linear's backward operator, as the compiled path calls it, against its alternatives.

    python3 benchmarks/op_overhead.py OUT.json

Inside ``torch.compile`` each SEBP linear's backward is one operator call (``sebp::linear_backward``), about 105
a step for a Llama-3.2-1B. This times the host side of that call, on rows few enough (256 x 2048, bf16) that the
GPU never sets the pace:

- ``per_call_us``: one backward (dX and dW, half the rows active) called directly: the two dense matmuls; the
  Triton backward alone; the operator's Python function; the operator as :mod:`sebp_kernels.library` defines it
  (``library``); the same function as a ``torch.library.custom_op`` (``custom_op``, defined here under another
  namespace, called through its ``CustomOpDef`` and a wrapper that counts its calls: a fraction of a
  microsecond more than its ``OpOverload``, against the gap of tens of microseconds this measures).
- ``forward_per_call_us``: one forward of the same linear over its real-token rows, half of them real
  (:mod:`sebp_kernels.forward_rows`, the rule that keeps such few rows on cuBLAS set aside for the probe):
  ``F.linear`` on every row; the forward over rows called directly; ``sebp::linear_forward``, the operator a
  compiled SEBP linear calls.
- ``stack_step_us``: forward and backward of 16 linears (2048 x 2048) compiled (``torch.compile(dynamic=True)``),
  dense, and SEBP with the backward operator defined each way (the custom_op twin swapped in for the run).

``--triton-op OUT2.json`` times, instead, the same stack compiled with static shapes and half of its rows
without gradient (so that every SEBP layer takes its sparse path): dense; SEBP with the operator of
:mod:`sebp_kernels.library`; SEBP with the backward as a ``torch.library.triton_op`` whose kernels Inductor
launches from its own code (the switch SEBP_TRITON_OP=1 sets, :mod:`sebp_kernels._triton.traced`). Each
SEBP stack's gradients are checked against dense's first (``max_rel_diff``).

Each figure: the host seconds of ``--calls`` calls (no synchronisation between them) divided by their number,
the median of ``--rounds`` rounds, the variants interleaved and every other round in reverse order.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: the repository's packages

from sebp_kernels import SEBPConfig, registry  # noqa: E402
from sebp_kernels import functional  # noqa: E402
from sebp_kernels._triton import sebp_backward_triton  # noqa: E402
from sebp_kernels.modules import SEBPLinear  # noqa: E402
from sebp_probe.bench.bench import environment  # noqa: E402

M, D, LAYERS = 256, 2048, 16

# The same Python function as a custom_op, for the comparison (its own namespace: sebp:: has the real one).
_TWIN_CALLS = [0]  # how often the twin ran: the check that the compiled stack meant to call it did


@functools.wraps(functional._linear_backward)
def _twin(*args):
    _TWIN_CALLS[0] += 1
    return functional._linear_backward(*args)


custom_op_twin = torch.library.custom_op(
    "sebp_bench::linear_backward", mutates_args=(),
    schema=torch.library.infer_schema(functional._linear_backward, mutates_args=()))(_twin)
custom_op_twin.register_fake(functional._linear_backward_fake)


def host_us(fn, calls: int) -> float:
    """Host microseconds per call of ``calls`` calls, after the GPU caught up with the ones before."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) * 1e6 / calls
    torch.cuda.synchronize()
    return us


def interleaved(fns: dict, calls: int, rounds: int) -> dict[str, float]:
    """Median host us per call of each of ``fns``, the variants interleaved, every other round reversed."""
    for fn in fns.values():  # warm-up: compiles, Triton's first launches, the allocator
        for _ in range(20):
            fn()
    seen: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds):
        for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            seen[k].append(host_us(fns[k], calls))
    return {k: round(statistics.median(v), 1) for k, v in seen.items()}


def per_call(calls: int, rounds: int) -> dict[str, float]:
    g = torch.Generator(device="cuda").manual_seed(0)
    dy = torch.randn(M, D, device="cuda", generator=g).to(torch.bfloat16)
    dy[M // 2:] = 0  # half the rows inactive: the SEBP path, not the dense one
    x = torch.randn(M, D, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(D, D, device="cuda", generator=g).to(torch.bfloat16)
    cfg = SEBPConfig("exact")
    args = (dy, x, w, True, True, False, None, cfg.op_key, 0, 0)  # a functional call's keys: no density state
    with torch.no_grad():
        return interleaved({
            "dense_matmuls": lambda: (dy @ w, dy.t() @ x),
            "triton_backward": lambda: sebp_backward_triton(dy, x, w, cfg, True, True, False),
            "python_function": lambda: functional._linear_backward(*args),
            "library": lambda: functional.linear_backward(*args),
            "custom_op": lambda: custom_op_twin(*args),
        }, calls, rounds)


def forward_per_call(calls: int, rounds: int) -> dict[str, float]:
    from sebp_kernels import forward_rows
    from sebp_kernels.pad_rows import ON, PadRows

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, D, device="cuda", generator=g).to(torch.bfloat16)
    linear = SEBPLinear.from_linear(torch.nn.Linear(D, D, bias=False), SEBPConfig("exact")).to("cuda", torch.bfloat16)
    mask = torch.ones(2, M // 2, dtype=torch.long, device="cuda")
    mask[:, M // 4:] = 0  # right padding: half the rows real
    pad = PadRows()
    pad.set(mask)
    pad.state = ON  # as after the padding rows' check
    linear._sebp_pad_rows = pad
    perm, count, real = pad.traced()
    x3, w = x.view(2, M // 2, D), linear.weight.detach()
    saved = forward_rows.MIN_ROWS, forward_rows.MIN_SKIPPED
    forward_rows.MIN_ROWS = forward_rows.MIN_SKIPPED = 0  # these few rows would stay on cuBLAS
    try:
        with torch.no_grad():
            return interleaved({
                "f_linear": lambda: torch.nn.functional.linear(x3, w),
                "over_rows": lambda: forward_rows.linear_over_rows(x3, w, None, perm, count),
                "library": lambda: functional.linear_forward(x3, w, None, None, linear._sebp_key, perm, count, real),
            }, calls, rounds)
    finally:
        forward_rows.MIN_ROWS, forward_rows.MIN_SKIPPED = saved


class TwinStack(torch.nn.Sequential):
    """A stack whose forward is code of its own, so Dynamo compiles it apart from the other SEBP stack's."""

    def forward(self, x):
        return super().forward(x)


def stack(sebp: bool, cls=torch.nn.Sequential) -> torch.nn.Module:
    layers = cls(*[torch.nn.Linear(D, D, bias=False) for _ in range(LAYERS)])
    layers = layers.to("cuda", torch.bfloat16)
    if sebp:
        for i in range(LAYERS):
            layers[i] = SEBPLinear.from_linear(layers[i], SEBPConfig("exact"))
        registry.keys_as_inputs(layers)  # one graph for all layers, as the bench's regional compile
    return layers


def stacks(calls: int, rounds: int) -> dict[str, float]:
    torch._dynamo.reset()
    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    own = functional.linear_backward
    fns = {}
    for name, sebp in (("dense", False), ("sebp_library", True), ("sebp_custom_op", True)):
        twin = name == "sebp_custom_op"
        net = torch.compile(stack(sebp, TwinStack if twin else torch.nn.Sequential), dynamic=True)
        op = custom_op_twin if twin else own

        def step(net=net, op=op):
            functional.linear_backward = op  # what the compiled backward calls (read when it is traced)
            try:
                net(x).sum().backward()
            finally:
                functional.linear_backward = own
        fns[name] = step
    before = _TWIN_CALLS[0]
    out = interleaved(fns, calls, rounds)
    out["custom_op_twin_calls"] = _TWIN_CALLS[0] - before  # > 0: its stack ran the custom_op
    return out


def _masked_step(net, x, mask, triton_op: bool = False):
    """One forward + backward of ``net``; ``triton_op``: with the compiled SEBP linears' switch
    (``functional.TRITON_OP``, read when the graph is traced and guarded on) on, as SEBP_TRITON_OP=1 sets it."""
    def step():
        saved, functional.TRITON_OP = functional.TRITON_OP, triton_op
        try:
            (net(x) * mask).sum().backward()
        finally:
            functional.TRITON_OP = saved
    return step


class TritonOpStack(torch.nn.Sequential):
    """A third copy of the stack's code, so Dynamo compiles it apart from the other two SEBP stacks."""

    def forward(self, x):
        return super().forward(x)


def triton_op_stacks(calls: int, rounds: int) -> dict:
    """Host us per step of the static-shape stacks (see the module docstring), and each SEBP stack's largest
    gradient difference from dense relative to the gradient's largest magnitude."""
    torch._dynamo.reset()
    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mask = torch.zeros(M, 1, device="cuda", dtype=torch.bfloat16)
    mask[: M // 2] = 1  # half the rows carry no gradient: each SEBP layer's sparse path
    nets = {"dense": stack(False), "sebp_library": stack(True, TwinStack), "sebp_triton_op": stack(True, TritonOpStack)}
    for name in ("sebp_library", "sebp_triton_op"):  # the same weights in every stack
        for i in range(LAYERS):
            nets[name][i].weight.data.copy_(nets["dense"][i].weight)
    steps = {k: _masked_step(torch.compile(v, dynamic=False), x, mask, k == "sebp_triton_op")
             for k, v in nets.items()}
    grads = {}
    for k, step in steps.items():
        x.grad = None
        for p in nets[k].parameters():
            p.grad = None
        step()
        grads[k] = [x.grad.float()] + [p.grad.float() for p in nets[k].parameters()]
    diffs = {k: max(float((a - b).abs().max()) / max(float(a.abs().max()), 1e-30)
                    for a, b in zip(grads["dense"], grads[k])) for k in ("sebp_library", "sebp_triton_op")}
    out = interleaved(steps, calls, rounds)
    return {"stack_step_us": out, "max_rel_diff": diffs}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--triton-op", action="store_true", help="the static-shape comparison with a triton_op backward")
    opts = p.parse_args()
    if not torch.cuda.is_available():
        p.error("the probe needs a CUDA GPU")
    stack_calls = max(opts.calls // 10, 50)
    result = {"environment": environment(),
              "command": " ".join(["python3", "benchmarks/op_overhead.py", *sys.argv[1:]]),
              "rows": M, "width": D, "layers": LAYERS, "calls": opts.calls, "rounds": opts.rounds}
    if opts.triton_op:
        result.update(calls=stack_calls, **triton_op_stacks(stack_calls, opts.rounds))
    else:
        result.update(per_call_us=per_call(opts.calls, opts.rounds),
                      forward_per_call_us=forward_per_call(opts.calls, opts.rounds),
                      stack_step_us=stacks(stack_calls, opts.rounds))
    print(json.dumps(result, indent=1), flush=True)
    Path(opts.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
