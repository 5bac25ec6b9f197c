"""Sampled mode's Triton path on a GPU: the torch reference's keep decisions and gradients at model shapes, no
host sync after a layer's first backward, CUDA-graph replays that draw anew, and a compiled layer on the path.
(The interpreter cases, bit for bit on the CPU, are in test_sampled_triton.py.)"""
from __future__ import annotations

import pytest
import torch

from sebp_kernels import SEBPConfig, SEBPLinear, sebp_linear
from sebp_kernels.sampling import SampleState, sampled_backward_torch

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(4096, 768, 768), (4096, 3072, 768), (2048, 512, 2048), (777, 320, 96)]


def _inputs(m, n_out, n_in, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, n_in, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n_out, n_in, device="cuda", generator=g) / n_in ** 0.5).to(dtype)
    scale = torch.rand(m, 1, device="cuda", generator=g) ** 4  # row norms over decades
    dy = (torch.randn(m, n_out, device="cuda", generator=g) * scale).to(dtype)
    dy[::7] = 0
    return x, w, dy


def _triton():
    from sebp_kernels._triton.sampled import sampled_backward_triton

    return sampled_backward_triton


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("budget, sample_dx", [(0.3, False), ("auto", False), (0.3, True)])
def test_triton_path_matches_the_reference(shape, dtype, budget, sample_dx):
    x, w, dy = _inputs(*shape, dtype)
    cfg = SEBPConfig("sampled", budget=budget, seed=1, sample_dx=sample_dx)
    ref, tri = SampleState(3), SampleState(3)
    for t in range(3):
        d = dy * (1 + t)
        if tri.tau is not None:  # one cutoff (the two solvers may differ in its last candidate step)
            ref.tau = tri.tau.clone()
        want = sampled_backward_torch(d, x, w, cfg, ref)
        got = _triton()(d, x, w, cfg, tri)
        for g, e, name in zip(got, want, ("dx", "dw", "db")):
            err = (g.float() - e.float()).norm() / e.float().norm().clamp(min=1e-30)
            assert err < (1e-5 if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32 else 2e-2), \
                (name, t, err.item())
        # the same rows kept: a row whose draw lands exactly on its threshold could differ (2^-24 a row)
        assert abs(ref.counts()["kept"] - tri.counts()["kept"]) <= 1, (ref.counts(), tri.counts())
        assert ref.counts()["nonzero"] == tri.counts()["nonzero"]
    if budget == 0.3:
        c = tri.counts()
        assert 0.2 < c["kept"] / c["nonzero"] < 0.45, c


def test_no_host_sync_after_the_first_backward():
    x, w, dy = _inputs(4096, 1024, 1024, torch.bfloat16)
    for budget in (0.3, "auto"):
        cfg, state = SEBPConfig("sampled", budget=budget, seed=0), SampleState(1)
        _triton()(dy, x, w, cfg, state)
        _triton()(dy, x, w, cfg, state)  # the device counters made
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            _triton()(dy, x, w, cfg, state)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_cuda_graph_replays_draw_anew_and_advance_the_state():
    """Captured after warm-up, each replay reads the layer's backward count and cutoff on the device and
    advances them: the replays' dW differ, and equal an eager run's from the same state."""
    x, w, dy = _inputs(2048, 512, 512, torch.float16)
    cfg = SEBPConfig("sampled", budget=0.3, seed=4)
    graphed, eager = SampleState(2), SampleState(2)
    for s in (graphed, eager):
        for _ in range(2):
            _triton()(dy, x, w, cfg, s)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _triton()(dy, x, w, cfg, graphed)
        _triton()(dy, x, w, cfg, eager)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = _triton()(dy, x, w, cfg, graphed)
    seen = []
    for _ in range(3):
        g.replay()
        want = _triton()(dy, x, w, cfg, eager)
        torch.testing.assert_close(out[1], want[1])
        seen.append(out[1].clone())
    assert not torch.equal(seen[0], seen[1])
    assert graphed.state_dict()["calls"] == eager.state_dict()["calls"] == 6
    assert graphed.counts() == eager.counts()


def test_a_compiled_layer_takes_the_triton_path(monkeypatch):
    import sebp_kernels._triton.sampled as sampled

    calls = []
    real = sampled.select_sampled
    monkeypatch.setattr(sampled, "select_sampled", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    lin = SEBPLinear(256, 128, config=SEBPConfig("sampled", budget=0.5, seed=3)).cuda()
    step = torch.compile(lambda x: lin(x).square().sum())
    for _ in range(3):
        step(torch.randn(8, 64, 256, device="cuda")).backward()
    assert len(calls) == 2 and lin.weight.grad is not None and torch.isfinite(lin.weight.grad).all()


def test_functional_call_on_cuda_uses_the_kernels(monkeypatch):
    import sebp_kernels._triton.sampled as sampled

    calls = []
    real = sampled.select_sampled
    monkeypatch.setattr(sampled, "select_sampled", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, w, dy = _inputs(512, 64, 32, torch.float32)
    state = SampleState(0)
    for _ in range(2):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        sebp_linear(xs, ws, None, SEBPConfig("sampled", budget=0.5), state=state).backward(dy)
    assert len(calls) == 1
