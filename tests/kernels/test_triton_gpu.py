"""Triton SEBP backward on a CUDA GPU: bf16/fp16/fp32 at real shapes against dense backward, the row modes
against the torch reference, determinism, no host sync, and CUDA-graph capture of the whole backward."""
from __future__ import annotations

import pytest
import torch

from sebp_kernels import SEBPConfig, SEBPLinear
from sebp_kernels.reference import sebp_backward_torch, select_rows
from tests.helpers import assert_close_report, assert_within_torch_error, dense_grads

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (M, out, in): BERT-base and Llama-3.2-3B projections at test-sized M, plus shapes no tile divides.
SHAPES = [(2048, 3072, 768), (1024, 1024, 3072), (1000, 1027, 515), (333, 768, 768)]


def _triton():
    from sebp_kernels._triton import sebp_backward_triton

    return sebp_backward_triton


def _inputs(m, n_out, n_in, dtype, density, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dy = torch.randn(m, n_out, device="cuda", generator=g)
    dy *= (torch.rand(m, device="cuda", generator=g) < density).unsqueeze(1)
    x = torch.randn(m, n_in, device="cuda", generator=g)
    w = torch.randn(n_out, n_in, device="cuda", generator=g) / n_in**0.5
    return dy.to(dtype), x.to(dtype), w.to(dtype)


def _captured(fn, *args):
    """(a CUDA graph of ``fn(*args)``, its outputs), after two eager warm-up calls (compile, allocate)."""
    for _ in range(2):
        fn(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    return graph, out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("density", [0.05, 0.5, 1.0])
@pytest.mark.parametrize("shape", SHAPES)
def test_exact_matches_dense_backward(shape, density, dtype):
    dy, x, w = _inputs(*shape, dtype, density, seed=shape[0])
    b = torch.zeros(shape[1], device="cuda", dtype=dtype)
    got = _triton()(dy, x, w, SEBPConfig("exact"))
    want = dense_grads(x, w, b, dy)
    ref = dense_grads(x, w, b, dy, torch.float64)
    for name, g, t, r in zip(("dX", "dW", "db"), got, want, ref):
        assert g.dtype == dtype and g.shape == t.shape
        assert_within_torch_error(g, r, t, dtype, name)
    inactive = (dy == 0).all(1)
    assert (got[0][inactive] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["threshold", "topk"])
def test_row_modes_match_reference(mode, dtype):
    m, n_out, n_in = 1537, 896, 640
    dy, x, w = _inputs(m, n_out, n_in, dtype, 0.7, seed=5)
    dy *= torch.logspace(-4, 0, m, device="cuda")[torch.randperm(m, device="cuda")].unsqueeze(1).to(dtype)
    cfg = SEBPConfig("threshold", eps=0.02) if mode == "threshold" else SEBPConfig("topk", top_n=300)
    got = _triton()(dy, x, w, cfg)
    want = sebp_backward_torch(dy, x, w, cfg)
    ref = sebp_backward_torch(dy.double(), x.double(), w.double(), cfg)
    for name, g, t, r in zip(("dX", "dW", "db"), got, want, ref):
        assert_within_torch_error(g, r, t, dtype, name)
    active = torch.zeros(m, dtype=torch.bool, device="cuda")
    active[select_rows(dy, cfg)] = True
    assert (got[0][~active] == 0).all() and (got[0][active] != 0).any(1).all()


@pytest.mark.parametrize("split", [2, 3, 8])
def test_dw_splits_agree_and_are_deterministic(split):
    from sebp_kernels._triton.dw import dw_db_rows
    from sebp_kernels._triton.select import select_rows_device

    dy, x, _ = _inputs(8192, 768, 768, torch.bfloat16, 0.6)
    perm, count = select_rows_device(dy, "exact")
    one = dw_db_rows(dy, x, perm, count, True, 1)
    many = dw_db_rows(dy, x, perm, count, True, split)
    assert_close_report(many[0].float(), one[0].float(), atol=0.1, rtol=2e-2, name="dW")
    assert_close_report(many[1].float(), one[1].float(), atol=0.1, rtol=2e-2, name="db")
    again = dw_db_rows(dy, x, perm, count, True, split)
    assert torch.equal(again[0], many[0]) and torch.equal(again[1], many[1])


@pytest.mark.parametrize("layout", ["right", "left", "two_runs"])
def test_exact_over_runs_of_consecutive_rows(layout):
    """Padded sequences: a dW range of consecutive rows skips the index loads (the gathering loop takes the
    rest). Against the dense backward, the whole backward and dW alone with forced splits."""
    from sebp_kernels._triton.dw import dw_db_rows
    from sebp_kernels._triton.select import select_rows_device

    m, n_out, n_in = 4096, 2048, 4096
    dy, x, w = _inputs(m, n_out, n_in, torch.bfloat16, 1.1, seed=7)
    mask = torch.zeros(m, dtype=torch.bool, device="cuda")
    if layout == "right":
        mask[:1500] = True
    elif layout == "left":
        mask[-2500:] = True
    else:  # 3300 rows: with 3 splits, [0, 2048) lies in the first run, [2048, 3300) spans the gap
        mask[100:2300] = True
        mask[2900:4000] = True
    dy *= mask.unsqueeze(1).to(dy.dtype)
    b = torch.zeros(n_out, device="cuda", dtype=dy.dtype)
    want = dense_grads(x, w, b, dy)
    ref = dense_grads(x, w, b, dy, torch.float64)
    got = _triton()(dy, x, w, SEBPConfig("exact"))
    for name, g, t, r in zip(("dX", "dW", "db"), got, want, ref):
        assert_within_torch_error(g, r, t, torch.bfloat16, name)
    perm, count = select_rows_device(dy, "exact")
    for split in (1, 3):
        dw, _ = dw_db_rows(dy, x, perm, count, False, split, ieee=False)
        assert_within_torch_error(dw, ref[1], want[1], torch.bfloat16, f"dW, {split} splits")


def test_one_run_with_noise_after_it_in_a_cuda_graph():
    """Threshold mode, one run of active rows followed by rows of noise below eps and NaN in X: the dW loop
    over consecutive rows stops at the run's end. Captured once, replayed on layouts that switch between one
    run, two runs and all rows (each replay decides on the device), bit for bit as the eager backward."""
    fn = _triton()
    cfg = SEBPConfig("threshold", eps=0.01)
    m, n_out, n_in = 4096, 2048, 4096
    dy, x, w = _inputs(m, n_out, n_in, torch.bfloat16, 1.1, seed=9)
    base_dy, base_x = dy.clone(), x.clone()

    def layout(kind):
        d, xx = base_dy.clone(), base_x.clone()
        if kind == "one_run":
            d[:300] = 1e-3
            d[2300:] = 1e-3
            xx[2300:] = float("nan")
        elif kind == "two_runs":
            d[1000:1500] = 1e-3
        return d, xx

    graph, out = _captured(fn, dy, x, w, cfg)
    for kind in ("one_run", "two_runs", "all", "one_run"):
        new_dy, new_x = layout(kind)
        dy.copy_(new_dy)
        x.copy_(new_x)
        graph.replay()
        eager = fn(dy, x, w, cfg)
        want = sebp_backward_torch(dy, x, w, cfg)
        ref = sebp_backward_torch(dy.double(), x.double(), w.double(), cfg)
        for name, g, e, t, r in zip(("dX", "dW", "db"), out, eager, want, ref):
            assert torch.isfinite(g).all(), f"{name} ({kind})"
            assert torch.equal(g, e), f"{name} ({kind}): replay differs from eager"
            assert_within_torch_error(g, r, t, torch.bfloat16, f"{name} ({kind})")


def test_backward_is_bitwise_reproducible():
    """Same inputs, same bits, whatever ran before (tile shapes and splits depend only on shapes and the
    device-side row count)."""
    fn = _triton()
    dy, x, w = _inputs(6000, 768, 768, torch.bfloat16, 0.7, seed=5)
    first = fn(dy, x, w, SEBPConfig("exact"))
    other = _inputs(6000, 768, 768, torch.bfloat16, 0.05, seed=6)
    fn(*other, SEBPConfig("exact"))
    again = fn(dy, x, w, SEBPConfig("exact"))
    for name, a, b in zip(("dX", "dW", "db"), first, again):
        assert torch.equal(a, b), name


def test_non_contiguous_and_edge_inputs():
    fn = _triton()
    dy, x, w = _inputs(700, 300, 260, torch.bfloat16, 0.3)
    for cfg_dy in (dy.t().contiguous().t(), torch.zeros_like(dy), torch.ones(1, 1, device="cuda",
                                                                            dtype=torch.bfloat16).expand(700, 300)):
        got = fn(cfg_dy, x, w, SEBPConfig("exact"))
        want = sebp_backward_torch(cfg_dy.contiguous(), x, w, SEBPConfig("exact"))
        ref = sebp_backward_torch(cfg_dy.double(), x.double(), w.double(), SEBPConfig("exact"))
        for name, g, t, r in zip(("dX", "dW", "db"), got, want, ref):
            assert_within_torch_error(g, r, t, torch.bfloat16, name)


def test_backward_makes_no_host_sync():
    fn = _triton()
    dy, x, w = _inputs(4096, 1024, 768, torch.bfloat16, 0.3)
    for cfg in (SEBPConfig("exact"), SEBPConfig("threshold", eps=0.5), SEBPConfig("topk", top_n=999)):
        fn(dy, x, w, cfg)  # warm-up: compile and autotune outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn(dy, x, w, cfg)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("mode", ["exact", "threshold", "topk"])
def test_whole_backward_is_cuda_graph_capturable(mode):
    fn = _triton()
    cfg = {"exact": SEBPConfig("exact"), "threshold": SEBPConfig("threshold", eps=0.3),
           "topk": SEBPConfig("topk", top_n=500)}[mode]
    # 6000 rows: enough for two dW row splits at full density (the last-arriver path replays too)
    dy, x, w = _inputs(6000, 1024, 640, torch.bfloat16, 0.2, seed=1)
    graph, out = _captured(fn, dy, x, w, cfg)
    for density, seed in ((0.05, 2), (0.6, 3), (1.0, 4)):  # a different k on every replay
        new_dy, new_x, _ = _inputs(6000, 1024, 640, torch.bfloat16, density, seed=seed)
        dy.copy_(new_dy)
        x.copy_(new_x)
        graph.replay()
        want = sebp_backward_torch(dy, x, w, cfg)
        ref = sebp_backward_torch(dy.double(), x.double(), w.double(), cfg)
        for name, g, t, r in zip(("dX", "dW", "db"), out, want, ref):
            assert_within_torch_error(g, r, t, torch.bfloat16, f"{name} (density {density})")


def test_training_step_with_sebp_linear_is_graph_capturable():
    torch.manual_seed(0)
    dense = torch.nn.Linear(768, 1536, device="cuda", dtype=torch.bfloat16)
    sebp = SEBPLinear.from_linear(torch.nn.Linear(768, 1536, device="cuda", dtype=torch.bfloat16))
    sebp.load_state_dict(dense.state_dict())
    x = torch.randn(8, 256, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mask = torch.zeros(8, 256, 1, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            (sebp(x) * mask).float().sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    sebp.zero_grad(set_to_none=False)
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (sebp(x) * mask).float().sum().backward()
    lengths = torch.tensor([256, 3, 40, 0, 128, 77, 1, 200], device="cuda")
    mask.copy_((torch.arange(256, device="cuda") < lengths[:, None]).unsqueeze(-1).to(mask.dtype))
    sebp.weight.grad.zero_()
    sebp.bias.grad.zero_()
    x.grad.zero_()
    graph.replay()
    xd = x.detach().clone().requires_grad_()
    (dense(xd) * mask).float().sum().backward()
    assert_close_report(sebp.weight.grad.float(), dense.weight.grad.float(), atol=0.25, rtol=2e-2, name="dW")
    assert_close_report(sebp.bias.grad.float(), dense.bias.grad.float(), atol=0.1, rtol=2e-2, name="db")
    assert_close_report(x.grad.float(), xd.grad.float(), atol=2e-2, rtol=2e-2, name="dX")


def test_fused_grads_equal_the_separate_kernels():
    """One launch for dX, dW and db runs the same device code as the three kernels: same bits for dX and
    dW (same tiles, same order), db within fp32 summation-order noise (its own launch uses fewer warps)."""
    from sebp_kernels._triton.dw import dw_db_rows
    from sebp_kernels._triton.dx import dx_rows
    from sebp_kernels._triton.grads import grads_rows
    from sebp_kernels._triton.select import _sm_count, select_rows_device

    for m, n_out, n_in, density in ((6000, 1024, 640, 0.6), (1000, 1027, 515, 0.2), (333, 768, 768, 1.0)):
        dy, x, w = _inputs(m, n_out, n_in, torch.bfloat16, density, seed=m)
        perm, count = select_rows_device(dy, "exact")
        n_sm = _sm_count(dy.device)
        dx, dw, db = grads_rows(dy, x, w, perm, count, True, True, True, False, n_sm)
        dw_tiles = -(-n_out // 128) * -(-n_in // 256)  # the fused launch leaves dX the SMs dW does not use
        assert torch.equal(dx, dx_rows(dy, w, perm, count, ieee=False, n_sm=n_sm, busy=dw_tiles))
        dw2, db2 = dw_db_rows(dy, x, perm, count, True, ieee=False, w_dtype=w.dtype, n_sm=n_sm)
        assert torch.equal(dw, dw2)
        assert_close_report(db.float(), db2.float(), atol=1e-2, rtol=1e-2, name="db")
        # Without dW in the launch, dX has every SM to itself and splits K by the dX-alone rule: the same bits
        # as the dX kernel launched alone.
        dx_alone = dx_rows(dy, w, perm, count, ieee=False, n_sm=n_sm, busy=0)
        for need in ((True, False, False), (False, True, False), (False, False, True), (True, True, False)):
            part = grads_rows(dy, x, w, perm, count, *need, False, n_sm)
            for name, wanted, got, full in zip(("dX", "dW", "db"), need, part, (dx if need[1] else dx_alone, dw, db)):
                assert (got is not None) == wanted, name
                if wanted and name != "db":
                    assert torch.equal(got, full), name


@pytest.mark.parametrize("m", [1, 31, 4096, 65537])
@pytest.mark.parametrize("mode", ["exact", "threshold"])
def test_select_matches_reference_from_one_row_to_many_blocks(m, mode):
    """Row selection (flags, then compaction over the blocks' counts) against the reference, from one row
    to 65537 rows (thousands of blocks), all-zero, all-active and sparse, called repeatedly."""
    from sebp_kernels._triton import select as sel

    cfg = SEBPConfig(mode, eps=0.5 if mode == "threshold" else 0.0)
    for seed, density in ((0, 0.3), (1, 0.0), (2, 1.0), (3, 0.01)):
        dy, _, _ = _inputs(m, 96, 8, torch.bfloat16, density, seed=seed)
        for _ in range(3):
            perm, count = sel.select_rows_device(dy, mode, cfg.eps)
            want = select_rows(dy, cfg)
            k = int(count.item())
            assert k == want.numel()
            assert torch.equal(perm[:k].long(), want)
            assert torch.equal(torch.sort(perm.long()).values, torch.arange(m, device="cuda"))


def test_fast_launch_respects_alignment_and_integer_specialisation():
    """After a launch with 16-byte-aligned tensors and multiple-of-16 sizes, a launch with a misaligned view
    and odd sizes must not reuse that compiled kernel: results equal a fresh torch computation."""
    fn = _triton()
    base = torch.randn(4097 * 769 + 8, device="cuda", dtype=torch.bfloat16)
    for offset, (m, n) in ((0, (4096, 768)), (1, (4097, 769)), (8, (4096, 768)), (3, (4096, 768))):
        dy = base[offset: offset + m * n].view(m, n)
        dy[::3] = 0
        x = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, 256, device="cuda", dtype=torch.bfloat16) / 16
        got = fn(dy, x, w, SEBPConfig("exact"))
        want = sebp_backward_torch(dy, x, w, SEBPConfig("exact"))
        ref = sebp_backward_torch(dy.double(), x.double(), w.double(), SEBPConfig("exact"))
        for name, g, t, r in zip(("dX", "dW", "db"), got, want, ref):
            assert_within_torch_error(g, r, t, torch.bfloat16, f"{name} offset {offset}")


@pytest.mark.parametrize("density", [0.005, 0.05, 0.3])
def test_dx_k_splits_agree_with_one_split_and_are_deterministic(density):
    """Few active row tiles: dX is split over K (pieces added by the last to finish, in piece order)."""
    from sebp_kernels._triton.dx import dx_rows
    from sebp_kernels._triton.select import _sm_count, select_rows_device

    dy, _, w = _inputs(4096, 8192, 3072, torch.bfloat16, density, seed=11)
    perm, count = select_rows_device(dy, "exact")
    one = dx_rows(dy, w, perm, count, ieee=False, n_sm=1)
    split = dx_rows(dy, w, perm, count, ieee=False, n_sm=_sm_count(dy.device))
    assert_close_report(split.float(), one.float(), atol=0.05, rtol=2e-2, name="dX")
    assert torch.equal(split, dx_rows(dy, w, perm, count, ieee=False, n_sm=_sm_count(dy.device)))


def test_adaptive_dense_path_eager_graph_and_no_sync():
    """With a RowDensity in exact mode: after a backward with every row active the dense GEMMs run (no host
    sync on any path), a CUDA graph captured then records the dense path, and the results match dense
    autograd; when rows go sparse the probe notices and the SEBP path comes back."""
    from sebp_kernels import density as D
    from sebp_kernels.density import RowDensity

    fn, state, cfg = _triton(), RowDensity(), SEBPConfig("exact")
    dy, x, w = _inputs(3000, 1024, 768, torch.bfloat16, 1.1, seed=5)
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn(dy, x, w, cfg, state=state)  # SEBP path, starts the read-back
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert state.choose() == "dense" and state.density == 1.0
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = fn(dy, x, w, cfg, state=state)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name, g, t in zip(("dX", "dW", "db"), got, dense_grads(x, w, torch.zeros(1024, device='cuda'), dy, torch.float32)):
        assert_close_report(g.float(), t.float(), atol=2e-2, rtol=2e-2, name=name)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(dy, x, w, cfg, state=state)
    new_dy, new_x, _ = _inputs(3000, 1024, 768, torch.bfloat16, 0.3, seed=6)
    dy.copy_(new_dy)
    x.copy_(new_x)
    graph.replay()  # the dense path on sparse rows: still exact (zero rows give zero dX rows)
    for name, g, t in zip(("dX", "dW", "db"), out, dense_grads(x, w, torch.zeros(1024, device='cuda'), dy, torch.float32)):
        assert_close_report(g.float(), t.float(), atol=2e-2, rtol=2e-2, name=name)
    zero = (dy == 0).all(1)
    assert zero.any() and (out[0][zero] == 0).all()
    for _ in range(D.PROBE_EVERY + 1):
        fn(dy, x, w, cfg, state=state)
        torch.cuda.synchronize()
    assert state.density is not None and state.density < 0.5
    got = fn(dy, x, w, cfg, state=state)
    want = sebp_backward_torch(dy, x, w, cfg)
    for name, g, t in zip(("dX", "dW", "db"), got, want):
        assert_close_report(g.float(), t.float(), atol=2e-2, rtol=2e-2, name=name)


# ------------------------------------------------------------------------------------ LayerNorm / RMSNorm

NORM_SHAPES = [(32, 512, 768), (1, 4096, 3072), (3, 100, 1000)]  # BERT-base, Llama-3.2-3B, awkward


def _norm_case(shape, dtype, rms, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, s, n = shape
    lengths = torch.randint(1, s + 1, (b,), device="cuda", generator=g)
    keep = (torch.arange(s, device="cuda") < lengths[:, None]).unsqueeze(-1)
    gy = (torch.randn(shape, device="cuda", generator=g) * keep).to(dtype)
    leafs = [(torch.randn(shape, device="cuda", generator=g) * 3 + 1).to(dtype),
             torch.randn(n, device="cuda", generator=g).to(dtype)]
    if not rms:
        leafs.append(torch.randn(n, device="cuda", generator=g).to(dtype))
    return gy, [t.requires_grad_() for t in leafs]


def _norm_fns(n, rms, eps=1e-5):
    import torch.nn.functional as F

    from sebp_kernels import sebp_layer_norm, sebp_rms_norm

    if rms:
        dense = lambda x, w: w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)  # noqa: E731
        return (lambda x, w: sebp_rms_norm(x, w, eps)), dense
    return (lambda x, w, b: sebp_layer_norm(x, (n,), w, b, eps)), (lambda x, w, b: F.layer_norm(x, (n,), w, b, eps))


def _norm_grads(fn, leafs, gy):
    for t in leafs:
        t.grad = None
    out = fn(*leafs)
    out.backward(gy)
    return out.detach(), [t.grad.clone() for t in leafs]


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_norm_backward_matches_dense(shape, dtype, rms):
    gy, leafs = _norm_case(shape, dtype, rms, seed=shape[1])
    sebp, dense = _norm_fns(shape[-1], rms)
    out, got = _norm_grads(sebp, leafs, gy)
    out_d, want = _norm_grads(dense, leafs, gy)
    assert torch.equal(out, out_d)
    leafs64 = [t.detach().double().requires_grad_() for t in leafs]
    _, ref = _norm_grads(dense, leafs64, gy.double())
    for name, g, w_, r in zip(("dX", "dW", "db"), got, want, ref):
        assert g.dtype == dtype, name
        assert_within_torch_error(g, r, w_, dtype, name)
    assert (got[0][(gy == 0).all(-1)] == 0).all()


def test_norm_backward_no_sync_and_cuda_graph():
    from sebp_kernels import sebp_layer_norm, sebp_rms_norm

    gy, (x, w, b) = _norm_case((8, 256, 768), torch.bfloat16, rms=False, seed=3)
    for fn in (lambda: sebp_layer_norm(x, (768,), w, b).backward(gy), lambda: sebp_rms_norm(x, w).backward(gy)):
        fn()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # capture forward + backward, then replay with other padding
    static = gy.clone()
    for t in (x, w, b):
        t.grad = None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sebp_layer_norm(x, (768,), w, b).backward(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for t in (x, w, b):
        t.grad = None
    with torch.cuda.graph(graph):
        sebp_layer_norm(x, (768,), w, b).backward(static)
    gy2, _ = _norm_case((8, 256, 768), torch.bfloat16, rms=False, seed=4)
    static.copy_(gy2)
    graph.replay()
    got = [t.grad.clone() for t in (x, w, b)]
    import torch.nn.functional as F

    _, want = _norm_grads(lambda x_, w_, b_: F.layer_norm(x_, (768,), w_, b_), [x, w, b], gy2)
    for name, g, w_ in zip(("dX", "dW", "db"), got, want):
        assert_close_report(g.float(), w_.float(), atol=0.1, rtol=2e-2, name=name)


# ---------------------------------------------------------------------------------------- SEBP activations

def _act_case(kind, m, n, dtype, density, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = (torch.randn(m, n, device="cuda", generator=g) * 3).to(dtype)
    b = torch.randn(m, n, device="cuda", generator=g).to(dtype) if kind == "swiglu" else None
    a[3, 5] = float("nan")
    a[m - 1, 0] = float("inf")  # a zero row of dL/dH below
    a[m - 2, 1] = -float("inf")
    if b is not None:
        b[m - 3, 2] = float("inf")
    dh = torch.randn(m, n, device="cuda", generator=g)
    dh *= (torch.rand(m, 1, device="cuda", generator=g) < density)
    dh[m - 3:] = 0
    return a, b, dh.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("density", [0.06, 1.0])
@pytest.mark.parametrize("kind,n", [("swiglu", 8192), ("gelu", 3072), ("swiglu", 1000)])
def test_activation_equals_torch_bitwise(kind, n, density, dtype):
    """The forward values are torch's, bit for bit (NaN where NaN), and so are SwiGLU's input gradients. GELU's
    differ from torch's gelu_backward in the last bits of some elements (other erf/exp roundings)."""
    import torch.nn.functional as F

    from sebp_kernels.activations import RowHint, sebp_gelu, sebp_swiglu

    a, b, dh = _act_case(kind, 1024, n, dtype, density)
    outs = []
    for fn in ((lambda x, y: F.silu(x) * y) if kind == "swiglu" else (lambda x, y: F.gelu(x)),
               (lambda x, y: sebp_swiglu(x, y, RowHint())) if kind == "swiglu" else (lambda x, y: sebp_gelu(x))):
        leaves = [t.clone().requires_grad_() for t in (a, b) if t is not None]
        h = fn(*leaves, *([None] if b is None else []))
        h.backward(dh)
        outs.append([h.detach()] + [t.grad for t in leaves])
    for name, want, got in zip(("h", "da", "db"), *outs):
        if kind == "gelu" and name == "da":
            assert torch.equal(torch.isfinite(want), torch.isfinite(got))
            rtol = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 2e-6}[dtype]
            assert_close_report(got.float().nan_to_num(0.0, 0.0, 0.0), want.float().nan_to_num(0.0, 0.0, 0.0),
                                atol=1e-5, rtol=rtol, name=name)
            continue
        same = (want == got) | (torch.isnan(want) & torch.isnan(got))
        assert bool(same.all()), f"{name}: {int((~same).sum())} elements differ"


def test_sebp_mlp_with_row_hints_in_a_cuda_graph():
    """A SwiGLU MLP of SEBPLinears with the SEBP activation: gate/up take the activation's rows (no select
    pass), the whole backward is capturable, and the gradients equal the dense ones."""
    from sebp_kernels.activations import RowHint, sebp_swiglu

    torch.manual_seed(0)
    m, d, f = 512, 256, 768
    lins = [torch.nn.Linear(d, f, bias=False), torch.nn.Linear(d, f, bias=False), torch.nn.Linear(f, d, bias=False)]
    lins = [lin.cuda().to(torch.bfloat16) for lin in lins]
    hint = RowHint()
    sebp = [SEBPLinear.from_linear(lin) for lin in lins]
    sebp[0]._sebp_hint = sebp[1]._sebp_hint = hint
    x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    gy = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    gy[m // 3:] = 0

    def step(gate, up, down, act):
        for lin in (gate, up, down):
            lin.weight.grad = None
        xx = x.clone().requires_grad_()
        down(act(gate(xx), up(xx))).backward(gy)
        return [xx.grad] + [lin.weight.grad for lin in (gate, up, down)]

    import torch.nn.functional as F
    want = step(*lins, lambda g, u: F.silu(g) * u)
    eager = step(*sebp, lambda g, u: sebp_swiglu(g, u, hint))
    assert hint.taken == 2
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(*sebp, lambda g, u: sebp_swiglu(g, u, hint))
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step(*sebp, lambda g, u: sebp_swiglu(g, u, hint))
    graph.replay()
    torch.cuda.synchronize()
    for w, e, g in zip(want, eager, static):
        assert_close_report(e.float(), w.float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(e, g)


def test_lora_model_with_sebp_norms_and_acts_on_the_gpu():
    """PEFT LoRA on attention and MLP projections of a tiny Llama on the GPU, with SEBP on every linear, norm
    and MLP activation: loss and gradients equal the dense model's (fp32), the activation hands its rows to
    gate/up's base layers, and the same holds with transformers' gradient checkpointing."""
    import copy

    peft = pytest.importorskip("peft")
    from sebp_probe.model.patch import patch_activations, patch_model, patch_norms
    from tests.tiny_models import padded_batch, tiny_model

    batch = {k: v.cuda() for k, v in padded_batch("llama").items()}
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
                           init_lora_weights=False)

    def loss_and_grads(model):
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    for checkpointing in (False, True):
        dense = peft.get_peft_model(tiny_model("llama").cuda(), lora)
        if checkpointing:
            dense.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        sebp = copy.deepcopy(dense)
        patch_model(sebp, SEBPConfig("exact"))
        patch_norms(sebp)
        patch_activations(sebp)
        mlp = sebp.base_model.model.model.layers[-1].mlp
        assert mlp.gate_proj.base_layer._sebp_hint is mlp._sebp_act_hint
        (l0, g0), (l1, g1) = loss_and_grads(dense), loss_and_grads(sebp)
        torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-6)
        assert g0.keys() == g1.keys() and g0
        for n in g0:
            torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-5, msg=n)
        if not checkpointing:
            assert mlp._sebp_act_hint.taken == 2


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_torch_compile_runs_the_sebp_kernels_with_the_eager_gradients(mode):
    """torch.compile (Inductor) of a tiny Llama with SEBP linears, norms and activations on the GPU: one graph
    (the SEBP layers are sebp:: custom ops), the gradients of eager SEBP, the SEBP gradient kernels run, and the
    activations hand their rows to the linears before them as in eager runs. ``reduce-overhead`` replays the
    compiled graphs as CUDA graphs (which needs every allocation of the SEBP ops to end with the backward)."""
    import torch._dynamo as dynamo

    from sebp_probe.model.patch import patch_activations, patch_model, patch_norms
    from tests.tiny_models import padded_batch, tiny_model

    batch = {k: v.cuda() for k, v in padded_batch("llama").items()}
    sebp = tiny_model("llama").cuda().eval()
    patch_model(sebp, SEBPConfig("exact"))
    patch_norms(sebp)
    patch_activations(sebp)
    hints = [m._sebp_act_hint for m in sebp.modules() if "_sebp_act_hint" in vars(m)]

    def grads(model):
        sebp.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        return {n: p.grad.clone() for n, p in sebp.named_parameters() if p.grad is not None}

    want = grads(sebp)
    eager_taken = sum(h.taken for h in hints)
    if mode == "reduce-overhead":  # as in a fresh process: the kernels' counters are first made in the warm-up
        from sebp_kernels._triton import dw

        dw._TICKETS.clear()  # made again by the first compiled run
    dynamo.reset()
    dynamo.utils.counters.clear()
    compiled = torch.compile(sebp, mode=mode)
    for _ in range(3):
        grads(compiled)
    taken = sum(h.taken for h in hints)
    assert taken > eager_taken  # the compiled backward's ops took the activations' rows (recorded, if graphed)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        got = grads(compiled)
        torch.cuda.synchronize()
    breaks = sum(dynamo.utils.counters["graph_break"].values())
    dynamo.reset()
    assert breaks == 0
    if mode == "default":  # a CUDA-graph replay runs no Python: the rows recorded are used, not taken again
        assert sum(h.taken for h in hints) - taken == 2 * len(hints)  # gate and up of every MLP
    assert sum(e.count for e in prof.key_averages() if "_grads_kernel" in e.key) > 0
    assert got.keys() == want.keys() and want
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_tiles_too_large_for_the_gpu_fall_back_to_smaller_ones(monkeypatch):
    """Level-0 tiles that no GPU's shared memory holds (256 x 256 x 128, 4 stages: 512 KB) stand in for the
    H100 tiles on a smaller GPU: the first launch fails for lack of resources, the backward takes the next
    setting (the one sized for an A100) and gives the dense gradients."""
    from sebp_kernels._triton import grads, tuning

    big = {"BLOCK_M": 256, "BLOCK_N": 256, "BLOCK_K": 128, "num_stages": 4}
    for cfg in (tuning.DW_CONFIG, tuning.DX_CONFIG, tuning.SMALL_CONFIG):
        for k, v in big.items():
            monkeypatch.setitem(cfg, k, v)
    monkeypatch.setattr(tuning, "SMALL_STAGES", {"dw": 4, "dx": 4})
    monkeypatch.setattr(grads, "_LEVEL", {})
    dy, x, w = _inputs(2048, 1024, 768, torch.bfloat16, 0.3, seed=4)
    try:
        with pytest.warns(UserWarning, match="smaller GEMM tiles"):
            got = _triton()(dy, x, w, SEBPConfig("exact"))
        assert grads._LEVEL == {torch.cuda.current_device(): 1}
    finally:
        grads._PLANS._plans.clear()  # the plans made with the stand-in tiles
    want = sebp_backward_torch(dy.double(), x.double(), w.double(), SEBPConfig("exact"))
    same = sebp_backward_torch(dy, x, w, SEBPConfig("exact"))
    for g, r, t, name in zip(got, want, same, ("dX", "dW")):
        assert_within_torch_error(g, r, t, torch.bfloat16, name)


def test_bf16_takes_the_torch_path_where_tensor_cores_lack_it(monkeypatch):
    """A GPU before compute capability 8.0 has no bf16 tensor-core dots: supported() says no, and the SEBP
    backward runs the torch reference (its results bit for bit) instead of failing to compile."""
    from sebp_kernels._triton import backward

    dy, x, w = _inputs(333, 768, 768, torch.bfloat16, 0.3, seed=6)
    assert backward.supported(dy, x, w)
    monkeypatch.setattr(backward, "_bf16_dots", lambda index: False)
    assert not backward.supported(dy, x, w)
    assert backward.supported(dy.half(), x.half(), w.half())
    got = _triton()(dy, x, w, SEBPConfig("exact"))
    want = sebp_backward_torch(dy, x, w, SEBPConfig("exact"))
    assert all(torch.equal(g, t) for g, t in zip(got, want))


@pytest.mark.parametrize("n_out,n_in", [(768, 768), (3072, 768), (768, 3072)])
def test_few_rows_tiles_give_the_dense_gradients(n_out, n_in):
    """A trimmed batch of short sequences (2112 rows, about half active: BERT-base `longest`) takes the
    few-rows tiles where :func:`~sebp_kernels._triton.tuning.few_rows` says so; either way the gradients are
    the dense ones within torch's own bf16 error."""
    from sebp_kernels._triton.tuning import few_rows

    dy, x, w = _inputs(2112, n_out, n_in, torch.bfloat16, 0.45, seed=11)
    assert few_rows(2112, n_in, 132) == (n_in == 768)
    got = _triton()(dy, x, w, SEBPConfig("exact"))
    want = sebp_backward_torch(dy.double(), x.double(), w.double(), SEBPConfig("exact"))
    same = sebp_backward_torch(dy, x, w, SEBPConfig("exact"))
    for g, r, t, name in zip(got, want, same, ("dX", "dW", "db")):
        assert_within_torch_error(g, r, t, torch.bfloat16, name)
