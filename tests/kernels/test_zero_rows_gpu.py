"""dX kept between backwards (sebp_kernels.zero_rows) on a CUDA GPU: bit-identical to a fresh dX at real
shapes over changing rows (K splits included), inside a CUDA graph, and through SEBPLinear with the pool."""
from __future__ import annotations

import pytest
import torch

from sebp_kernels import SEBPConfig, SEBPLinear, zero_rows
from sebp_kernels.zero_rows import ZeroRowBuffer

pytestmark = pytest.mark.gpu


def _triton():
    from sebp_kernels._triton import sebp_backward_triton

    return sebp_backward_triton


def _row_sets(m, seq):
    """Right padding, left padding, nothing, everything, scattered, right padding again."""
    pos = torch.arange(m, device="cuda") % seq
    g = torch.Generator(device="cuda").manual_seed(0)
    return [pos < seq // 8, pos >= seq - seq // 4, torch.zeros(m, dtype=torch.bool, device="cuda"),
            torch.ones(m, dtype=torch.bool, device="cuda"), torch.rand(m, device="cuda", generator=g) < 0.1,
            pos < seq // 8]


@pytest.mark.parametrize("shape,dtype", [((2048, 3072, 768), torch.bfloat16), ((1024, 1024, 3072), torch.bfloat16),
                                         ((1000, 1027, 515), torch.bfloat16), ((16384, 3072, 768), torch.bfloat16),
                                         ((1000, 1027, 515), torch.float32)])
@pytest.mark.parametrize("known", [False, True], ids=["select", "rows_known"])
def test_kept_dx_is_bitwise_a_fresh_dx(shape, dtype, known):
    from sebp_kernels._triton.select import select_rows_device

    m, n_out, n_in = shape
    g = torch.Generator(device="cuda").manual_seed(m)
    dy_full = torch.randn(m, n_out, device="cuda", generator=g).to(dtype)
    x = torch.randn(m, n_in, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n_out, n_in, device="cuda", generator=g) / n_in**0.5).to(dtype)
    buf = ZeroRowBuffer(m, n_in, dtype, "cuda")
    buf.dx.fill_(float("nan"))
    cfg = SEBPConfig("exact")
    for i, mask in enumerate(_row_sets(m, 512 if m >= 512 else m)):
        dy = dy_full * mask.unsqueeze(1).to(dtype)
        rows = select_rows_device(dy, "exact") if known else None
        fresh = _triton()(dy, x, w, cfg, rows=rows)
        got = _triton()(dy, x, w, cfg, rows=rows, dx_buffer=buf)
        assert got[0] is buf.dx
        for name, a, b in zip(("dX", "dW", "db"), got, fresh):
            assert torch.equal(a, b), (i, name)
        assert bool((buf.dirty[mask] == 1).all()), i


def test_kept_dx_in_a_cuda_graph_follows_the_rows_of_each_replay():
    m, n_out, n_in = 4096, 1024, 768
    g = torch.Generator(device="cuda").manual_seed(7)
    dy_full = torch.randn(m, n_out, device="cuda", generator=g).to(torch.bfloat16)
    x = torch.randn(m, n_in, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n_out, n_in, device="cuda", generator=g) / n_in**0.5).to(torch.bfloat16)
    static_dy = torch.zeros_like(dy_full)
    buf = ZeroRowBuffer(m, n_in, torch.bfloat16, "cuda")
    cfg = SEBPConfig("exact")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _triton()(static_dy, x, w, cfg, dx_buffer=buf)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _triton()(static_dy, x, w, cfg, dx_buffer=buf)
    for i, mask in enumerate(_row_sets(m, 512)):
        static_dy.copy_(dy_full * mask.unsqueeze(1).to(torch.bfloat16))
        graph.replay()
        fresh = _triton()(static_dy, x, w, cfg)
        for name, a, b in zip(("dX", "dW", "db"), out, fresh):
            assert torch.equal(a, b), (i, name)


def test_sebp_linear_with_the_pool_is_bitwise_the_same_and_syncs_nothing():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(768, 3072), torch.nn.Linear(3072, 768), torch.nn.Linear(768, 768)]
    batch = [torch.randn(8, 256, 768, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    lengths = [200, 31, 256, 90]

    def run(pool: bool):
        zero_rows.enable(pool)
        try:
            mods = [SEBPLinear.from_linear(l).to("cuda", torch.bfloat16) for l in layers]
            grads = []
            for x, n in zip(batch, lengths):
                x = x.clone().requires_grad_()
                h = mods[2](torch.nn.functional.gelu(mods[1](torch.nn.functional.gelu(mods[0](x)))))
                mask = (torch.arange(256, device="cuda") < n).view(1, 256, 1)
                loss = (h * mask).float().square().sum()
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    loss.backward()
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                grads.append([x.grad] + [p.grad.clone() for mod in mods for p in mod.parameters()])
                for mod in mods:
                    mod.zero_grad(set_to_none=True)
            used = sum(len(v) for v in zero_rows._POOL.values())
            return grads, used
        finally:
            zero_rows.enable(False)

    plain, none_used = run(False)
    kept, used = run(True)
    assert none_used == 0 and used >= 2
    for step, (a, b) in enumerate(zip(plain, kept)):
        for i, (ga, gb) in enumerate(zip(a, b)):
            assert torch.equal(ga, gb), (step, i)


def test_captured_training_step_keeps_dx_zero_rows_across_replays():
    """Eager warm-up with the pool on, then the forward and backward captured as CUDA graphs: the capture takes
    the warm-up's buffers, and replays on batches of other padding give bitwise the gradients of eager steps
    without the pool (to round-off)."""
    torch.manual_seed(0)
    base = [torch.nn.Linear(768, 3072), torch.nn.Linear(3072, 768)]
    xs = [torch.randn(4, 512, 768, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    lengths = [300, 40, 512, 120]
    pos = torch.arange(512, device="cuda").view(1, 512, 1)

    def loss_of(mods, x, n):
        return (mods[1](torch.nn.functional.gelu(mods[0](x))) * (pos < n)).float().square().sum()

    zero_rows.enable(False)
    mods = [SEBPLinear.from_linear(l).to("cuda", torch.bfloat16) for l in base]
    want = []
    for x, n in zip(xs, lengths):
        loss_of(mods, x, n).backward()
        want.append([p.grad.clone() for m in mods for p in m.parameters()])
        for m in mods:
            m.zero_grad(set_to_none=True)

    pool_before = {k: list(v) for k, v in zero_rows._POOL.items()}
    zero_rows.enable(True)
    try:
        mods = [SEBPLinear.from_linear(l).to("cuda", torch.bfloat16) for l in base]
        static_x = xs[0].clone()
        static_n = torch.tensor(lengths[0], device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                loss_of(mods, static_x, static_n).backward()
        torch.cuda.current_stream().wait_stream(side)
        for m in mods:
            for p in m.parameters():
                p.grad = torch.zeros_like(p)
        fwd, bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(fwd):
            loss = loss_of(mods, static_x, static_n)
        with torch.cuda.graph(bwd, pool=fwd.pool()):
            loss.backward()
        taken = [b for bufs in zero_rows._POOL.values() for b in bufs if b.captured]
        assert taken, "the capture took none of the warm-up's buffers"
        for step, (x, n) in enumerate(zip(xs, lengths)):
            static_x.copy_(x)
            static_n.fill_(n)
            for m in mods:
                for p in m.parameters():
                    p.grad.zero_()
            fwd.replay()
            bwd.replay()
            got = [p.grad for m in mods for p in m.parameters()]
            for i, (a, b) in enumerate(zip(got, want[step])):
                # (the captured forward's GEMMs need not pick eager's cuBLAS kernels: a stale dX row would
                # move dW by far more than this)
                torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-3 * b.float().abs().max().item(),
                                           msg=f"step {step}, gradient {i}")
        eager = zero_rows.pooled(2048, 3072, torch.bfloat16, torch.device("cuda"))
        assert eager is not None and not eager.captured  # eager use gets buffers of its own
    finally:
        zero_rows.enable(False)
        zero_rows._POOL.clear()
        zero_rows._POOL.update(pool_before)


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_blocks_with_sebp_norms_and_acts_and_the_pool_are_bitwise_the_same(arch):
    """A BERT-like (LayerNorm, GELU) and a Llama-like (RMSNorm, SwiGLU) block with SEBP linears, norms and
    activations, four eager steps of other padding with the pool off and on: the same gradients bit for bit,
    and the pool served the norms' and activations' input gradients too."""
    from sebp_kernels import RowHint, sebp_gelu, sebp_layer_norm, sebp_rms_norm, sebp_swiglu, sebp_linear

    torch.manual_seed(0)
    d, f = 768, 2048
    dt = torch.bfloat16
    ws = {k: (torch.randn(*s, device="cuda") / s[1] ** 0.5).to(dt) for k, s in
          {"up": (f, d), "gate": (f, d), "down": (d, f)}.items()}
    nw = torch.ones(d, device="cuda", dtype=dt) + 0.1 * torch.randn(d, device="cuda").to(dt)
    nb = (0.1 * torch.randn(d, device="cuda")).to(dt)
    xs = [torch.randn(4, 256, d, device="cuda", dtype=dt) for _ in range(4)]
    lengths = [200, 31, 256, 90]
    pos = torch.arange(256, device="cuda").view(1, 256, 1)

    def step(x, n):
        params = {k: v.clone().requires_grad_() for k, v in ws.items()}
        w_n, b_n = nw.clone().requires_grad_(), nb.clone().requires_grad_()
        x = x.clone().requires_grad_()
        hint = RowHint()
        if arch == "bert":
            h = sebp_layer_norm(x, (d,), w_n, b_n)
            a = sebp_gelu(sebp_linear(h, params["up"], hint=hint), hint=hint)
        else:
            h = sebp_rms_norm(x, w_n)
            a = sebp_swiglu(sebp_linear(h, params["gate"], hint=hint), sebp_linear(h, params["up"], hint=hint),
                            hint=hint)
        out = sebp_linear(a, params["down"])
        (out * (pos < n)).float().square().sum().backward()
        return [x.grad, w_n.grad, b_n.grad] + [p.grad for p in params.values()]

    zero_rows.enable(False)
    want = [step(x, n) for x, n in zip(xs, lengths)]
    zero_rows.enable(True)
    try:
        got = [step(x, n) for x, n in zip(xs, lengths)]
        shapes = {key[1] for key in zero_rows._POOL}
    finally:
        zero_rows.enable(False)
    assert {d, f} <= shapes  # the norm's and the down projection's dX (d wide), the activation's (f wide)
    for s, (a, b) in enumerate(zip(got, want)):
        for i, (ga, gb) in enumerate(zip(a, b)):
            assert (ga is None and gb is None) or torch.equal(ga, gb), (arch, s, i)
