"""SEBP linear (torch path) against dense backward and against the definitions of the row modes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from sebp_kernels import SEBPConfig, SEBPLinear, sebp_linear
from sebp_kernels.reference import select_rows
from tests.helpers import assert_close_report, assert_within_torch_error, dense_grads

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Awkward shapes: (leading dims, in, out), none a multiple of a block size.
SHAPES = [((37,), 19, 23), ((3, 29), 33, 17), ((2, 5, 7), 65, 131), ((1,), 8, 3)]


def _sparse_dy(lead, out, dtype, density=0.3, gen=None):
    dy = torch.randn(*lead, out, generator=gen)
    mask = torch.rand(*lead, generator=gen) < density
    return (dy * mask.unsqueeze(-1)).to(dtype)


def _sebp_grads(x, w, b, dy, config):
    x_ = x.detach().clone().requires_grad_()
    w_ = w.detach().clone().requires_grad_()
    b_ = b.detach().clone().requires_grad_() if b is not None else None
    y = sebp_linear(x_, w_, b_, config)
    assert torch.equal(y, F.linear(x.detach(), w.detach(), b.detach() if b is not None else None))
    y.backward(dy)
    return x_.grad, w_.grad, (b_.grad if b_ is not None else None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,n_in,n_out", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_exact_equals_dense(dtype, lead, n_in, n_out, bias):
    x = torch.randn(*lead, n_in).to(dtype)
    w = (torch.randn(n_out, n_in) / n_in**0.5).to(dtype)
    b = torch.randn(n_out).to(dtype) if bias else None
    dy = _sparse_dy(lead, n_out, dtype)
    got = _sebp_grads(x, w, b, dy, SEBPConfig("exact"))
    want = dense_grads(x, w, b, dy)
    ref = dense_grads(x, w, b, dy, torch.float64)
    for name, g, t, r in zip(("dX", "dW", "db"), got, want, ref):
        if r is None:
            assert g is None
            continue
        assert g.dtype == dtype and g.shape == t.shape
        assert_within_torch_error(g, r, t, dtype, name)
    # inactive rows of dX are exactly zero
    inactive = (dy == 0).all(-1)
    assert (got[0][inactive] == 0).all()


@pytest.mark.parametrize("fill", ["zeros", "all_active"])
def test_edge_all_zero_and_all_active(fill):
    x, w, b = torch.randn(4, 6, 10), torch.randn(7, 10), torch.randn(7)
    dy = torch.zeros(4, 6, 7) if fill == "zeros" else torch.randn(4, 6, 7)
    got = _sebp_grads(x, w, b, dy, SEBPConfig("exact"))
    want = dense_grads(x, w, b, dy)
    for name, g, t in zip(("dX", "dW", "db"), got, want):
        assert_close_report(g, t, atol=1e-5, rtol=1e-5, name=name)


@pytest.mark.parametrize("mode", ["exact", "threshold", "topk"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_row_is_never_hidden(mode, bad):
    x, w = torch.randn(20, 8), torch.randn(5, 8)
    dy = torch.randn(20, 5) * 1e-6
    dy[3] = 0
    dy[3, 2] = bad
    cfg = {"exact": SEBPConfig("exact"), "threshold": SEBPConfig("threshold", eps=1.0),
           "topk": SEBPConfig("topk", top_n=2)}[mode]
    assert 3 in select_rows(dy, cfg).tolist()
    dx, dw, db = _sebp_grads(x, w, None, dy, cfg)
    assert not torch.isfinite(dw).all()
    assert not torch.isfinite(dx[3]).all()


def test_threshold_matches_definition():
    x, w, b = torch.randn(50, 12), torch.randn(9, 12), torch.randn(9)
    dy = torch.randn(50, 9) * torch.logspace(-6, 0, 50).unsqueeze(1)
    eps = 1e-3
    active = dy.abs().amax(1) > eps
    assert 0 < active.sum() < 50
    dx, dw, db = _sebp_grads(x, w, b, dy, SEBPConfig("threshold", eps=eps))
    dy_kept = dy * active.unsqueeze(1)
    assert_close_report(dx, dy_kept @ w, atol=1e-5, name="dX")
    assert_close_report(dw, dy[active].t() @ x[active], atol=1e-5, name="dW")
    assert_close_report(db, dy[active].sum(0), atol=1e-5, name="db")


@pytest.mark.parametrize("n", [1, 7, 50, 1000])
def test_topk_matches_definition(n):
    x, w, b = torch.randn(50, 12), torch.randn(9, 12), torch.randn(9)
    dy = torch.randn(50, 9)
    keep = torch.argsort(dy.norm(dim=1), descending=True)[:n]
    mask = torch.zeros(50, dtype=torch.bool)
    mask[keep] = True
    dx, dw, db = _sebp_grads(x, w, b, dy, SEBPConfig("topk", top_n=n))
    assert_close_report(dx, (dy * mask.unsqueeze(1)) @ w, atol=1e-5, name="dX")
    assert_close_report(dw, dy[mask].t() @ x[mask], atol=1e-5, name="dW")
    assert_close_report(db, dy[mask].sum(0), atol=1e-5, name="db")


def test_frozen_weight_costs_no_dw_and_saves_no_input():
    x = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(3, 4)  # frozen
    y = sebp_linear(x, w, None, SEBPConfig())
    saved = y.grad_fn.saved_tensors
    assert not any(t is not None and t.shape == x.shape for t in saved)
    y.sum().backward()
    assert x.grad is not None and w.grad is None


def test_autocast_bf16_cpu_matches_dense_autocast():
    lin = torch.nn.Linear(16, 8)
    sebp = SEBPLinear.from_linear(torch.nn.Linear(16, 8), SEBPConfig())
    sebp.load_state_dict(lin.state_dict())
    x = torch.randn(3, 5, 16)
    dy = _sparse_dy((3, 5), 8, torch.float32)
    grads = []
    for m in (lin, sebp):
        m.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x)
        assert y.dtype == torch.bfloat16
        y.float().backward(dy)
        assert m.weight.grad.dtype == torch.float32
        grads.append((m.weight.grad.clone(), m.bias.grad.clone()))
    assert_close_report(grads[1][0], grads[0][0], atol=2e-2, rtol=2e-2, name="dW")
    assert_close_report(grads[1][1], grads[0][1], atol=2e-2, rtol=2e-2, name="db")


def test_checkpoint_and_grad_accumulation():
    torch.manual_seed(1)
    dense = torch.nn.Linear(10, 6)
    sebp = SEBPLinear.from_linear(torch.nn.Linear(10, 6))
    sebp.load_state_dict(dense.state_dict())
    for m in (dense, sebp):
        for step in range(3):  # three micro-batches accumulate into .grad
            g = torch.Generator().manual_seed(step)
            x = torch.randn(4, 7, 10, generator=g)
            dy = _sparse_dy((4, 7), 6, torch.float32, gen=g)
            y = checkpoint(m, x, use_reentrant=False)
            y.backward(dy)
    assert_close_report(sebp.weight.grad, dense.weight.grad, atol=1e-5, rtol=1e-5, name="dW")
    assert_close_report(sebp.bias.grad, dense.bias.grad, atol=1e-5, rtol=1e-5, name="db")


def test_module_shares_parameters_and_roundtrips():
    lin = torch.nn.Linear(5, 3)
    sebp = SEBPLinear.from_linear(lin, SEBPConfig("threshold", eps=0.1))
    assert sebp.weight is lin.weight and sebp.bias is lin.bias
    assert "threshold" in repr(sebp) and sebp.weight.device.type == "cpu"
    back = sebp.to_linear()
    assert type(back) is torch.nn.Linear and back.weight is lin.weight
    with pytest.raises(TypeError):
        SEBPLinear.from_linear(torch.nn.Conv1d(3, 3, 1))


@pytest.mark.parametrize(
    "kwargs,err",
    [({"mode": "fast"}, "unknown SEBP mode"), ({"eps": -1.0}, "eps must be"), ({"eps": float("nan")}, "eps"),
     ({"mode": "topk", "top_n": 0}, "N"), ({"mode": "topk"}, "needs top_n"), ({"top_n": -3}, "N"),
     ({"backend": "cuda"}, "backend")],
)
def test_config_rejects_bad_values(kwargs, err):
    with pytest.raises(ValueError, match=err):
        SEBPConfig(**kwargs)


def test_the_triton_op_setting_travels_with_the_config():
    import copy
    import pickle

    on = SEBPConfig("threshold", eps=0.5, triton_op=True)
    assert on.to_dict()["triton_op"] is True and "triton_op" not in SEBPConfig().to_dict()  # old records unchanged
    assert SEBPConfig.from_dict(on.to_dict()) == on and pickle.loads(pickle.dumps(on)) == copy.copy(on) == on
    assert on.op_key != SEBPConfig("threshold", eps=0.5).op_key  # a compiled graph tells them apart
    with pytest.raises(TypeError, match="triton_op"):
        SEBPConfig(triton_op=1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_inf_row_stays_active_when_eps_exceeds_the_dtype_range(dtype):
    dy = torch.zeros(4, 3, dtype=dtype)
    dy[1, 0] = float("inf")
    dy[2, 1] = 1.0
    assert select_rows(dy, SEBPConfig("threshold", eps=1e39)).tolist() == [1]


def test_fp64_under_autocast_stays_fp64():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = sebp_linear(x, w)
        ref = F.linear(x, w)
    assert y.dtype == ref.dtype == torch.float64


def test_only_fp32_takes_the_full_precision_kernel_loops():
    """fp16/bf16 must take the tensor-core loops (a slip here once halved the Triton path's speed)."""
    pytest.importorskip("triton")
    from sebp_kernels._triton.backward import _ieee

    assert not _ieee(torch.bfloat16) and not _ieee(torch.float16)
    prev = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert _ieee(torch.float32)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


@pytest.mark.slow
def test_tf32_setting_is_read_when_both_apis_set_it():
    """torch >= 2.9 raises on reading the legacy TF32 flag once the new API (fp32_precision) set it too (an HF
    Trainer run on a GPU did this). The SEBP backward then follows the new setting instead of failing. In a
    subprocess: the mix cannot be undone within a process."""
    pytest.importorskip("triton")
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("this torch has no fp32_precision API")
    code = (
        "import torch\n"
        "from sebp_kernels._triton.backward import _ieee, tf32_matmul_allowed\n"
        "torch.backends.cuda.matmul.allow_tf32 = False\n"
        "for p, want in (('tf32', True), ('ieee', False)):\n"
        "    torch.backends.cuda.matmul.fp32_precision = p\n"
        "    assert tf32_matmul_allowed() is want, p\n"
        "    assert _ieee(torch.float32) is (not want)\n"
        "print('ok')\n")
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter always says fp32
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
