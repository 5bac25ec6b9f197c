"""dX buffers that keep their zero rows between backwards (sebp_kernels.zero_rows).

The pool's bookkeeping runs on plain CPU tensors. The kernel side (only dirty rows zeroed) runs under the
Triton interpreter in a subprocess, as in test_triton_interp.py: a sequence of backwards with changing active
rows through one buffer must give, every time, exactly what the kernels give with a fresh dX.
"""
from __future__ import annotations

import os

import pytest
import torch

from sebp_kernels import zero_rows
from sebp_kernels.zero_rows import ZeroRowBuffer


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def pool_on(monkeypatch):
    """The pool enabled and usable on CPU tensors; off and empty afterwards."""
    monkeypatch.setattr(zero_rows, "_usable", lambda device: True)
    monkeypatch.setattr(zero_rows, "_POOL", {})  # this test's own (a captured buffer outlives enable(False))
    zero_rows.enable(True)
    yield
    zero_rows.enable(False)


def test_buffer_take_checks_shape_and_marks_in_place_changes():
    buf = ZeroRowBuffer(6, 4, torch.float32, "cpu")
    dx, dirty, tickets = buf.take(6, 4, torch.float32)
    assert tickets.tolist() == [0]
    assert dx is buf.dx and dirty.tolist() == [1] * 6  # a new buffer: every row may hold anything
    dirty.zero_()
    buf.take(6, 4, torch.float32)
    assert dirty.sum() == 0  # nothing changed dX through torch: the marks stand
    buf.dx[2].add_(1.0)  # an in-place change that torch records
    buf.take(6, 4, torch.float32)
    assert dirty.tolist() == [1] * 6
    with pytest.raises(ValueError, match=r"holds \(6, 4\).*needs \(6, 5\)"):
        buf.take(6, 5, torch.float32)
    with pytest.raises(ValueError, match="float16"):
        buf.take(6, 4, torch.float16)


def test_buffer_is_idle_only_when_nothing_else_refers_to_it():
    buf = ZeroRowBuffer(5, 3, torch.float32, "cpu")
    assert buf.idle()
    held = buf.dx
    assert not buf.idle()
    del held
    assert buf.idle()
    view = buf.dx.view(5, 1, 3)  # what the autograd Function hands on
    assert not buf.idle()
    del view
    part = buf.dx[1:]
    assert not buf.idle()
    del part
    assert buf.idle()


def test_pool_hands_out_idle_buffers_up_to_the_limit(pool_on, monkeypatch):
    monkeypatch.setattr(zero_rows, "MAX_PER_SHAPE", 2)
    dev = torch.device("cpu")
    a = zero_rows.pooled(8, 3, torch.float32, dev)
    assert zero_rows.pooled(8, 3, torch.float32, dev) is a  # nobody holds its dX: the same one again
    held = a.dx.view(2, 4, 3)
    b = zero_rows.pooled(8, 3, torch.float32, dev)
    assert b is not None and b is not a
    held_b = b.dx
    assert zero_rows.pooled(8, 3, torch.float32, dev) is None  # both in use, the limit reached
    assert zero_rows.pooled(8, 4, torch.float32, dev) is not None  # another shape has its own buffers
    del held
    assert zero_rows.pooled(8, 3, torch.float32, dev) is a
    del held_b
    zero_rows.enable(False)
    assert zero_rows.pooled(8, 3, torch.float32, dev) is None and not zero_rows._POOL


def test_capture_takes_existing_buffers_only_and_keeps_them(pool_on, monkeypatch):
    """Under capture: no new buffer, an idle existing one becomes the graph's (never handed out eagerly
    again, not freed when the pool is turned off); eager use goes on with buffers of its own."""
    dev = torch.device("cpu")
    capturing = [False]
    monkeypatch.setattr(zero_rows, "_capturing", lambda device: capturing[0])
    capturing[0] = True
    assert zero_rows.pooled(8, 3, torch.float32, dev) is None  # nothing made before: the plain path
    capturing[0] = False
    eager = zero_rows.pooled(8, 3, torch.float32, dev)
    capturing[0] = True
    taken = zero_rows.pooled(8, 3, torch.float32, dev)
    assert taken is eager and taken.captured
    assert zero_rows.pooled(8, 3, torch.float32, dev) is taken  # idle again: a later layer of the capture
    capturing[0] = False
    other = zero_rows.pooled(8, 3, torch.float32, dev)
    assert other is not None and other is not taken and not other.captured
    zero_rows.enable(False)
    assert zero_rows._POOL[(8, 3, torch.float32, dev)] == [taken]
    zero_rows.forget_captured()  # once the graphs are gone
    assert not zero_rows._POOL


def test_pool_is_off_by_default_and_off_on_cpu():
    assert not zero_rows.enabled()
    zero_rows.enable(True)
    try:
        assert zero_rows.pooled(4, 4, torch.float32, torch.device("cpu")) is None
    finally:
        zero_rows.enable(False)


if INTERPRET:
    import torch.nn.functional as F

    from sebp_kernels import RowHint, SEBPConfig, sebp_gelu, sebp_linear
    from sebp_kernels._triton import sebp_backward_triton
    from sebp_kernels._triton.select import select_rows_device

    M, N_OUT, N_IN = 70, 33, 50  # 5 row tiles of the interpreter's 16 (the last one ragged), 4 column tiles

    def _dy(active, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        dy = torch.randn(M, N_OUT, generator=g)
        mask = torch.zeros(M, dtype=torch.bool)
        mask[active] = True
        return (dy * mask.unsqueeze(1)).to(dtype)

    # Row sets one after the other: padding-like, shifted, disjoint, none, all, then scattered.
    ROW_SETS = [list(range(0, 20)), list(range(10, 45)), list(range(50, 70)), [], list(range(M)),
                [3, 17, 18, 40, 69], list(range(0, 20))]

    # A backward without a kept buffer, per (dtype, rows given, row set): the reference of every zeroing layout
    # (ZERO_PROGRAMS_PER_SM sets only the programs that zero a kept buffer's rows), computed once.
    _FRESH: dict = {}

    # every zeroing layout with the rows selected here; the rows given (the zeroing does not depend on where
    # they came from) with the layout of two programs a row tile
    @pytest.mark.parametrize("dtype,per_sm,known", [(torch.float32, 2, False), (torch.float16, 2, False),
                                                    (torch.float32, 6, False), (torch.float32, 64, False),
                                                    (torch.float32, 6, True)],
                             ids=["fp32-2-select", "fp16-2-select", "fp32-6-select", "fp32-64-select",
                                  "fp32-6-rows_known"])
    def test_reused_dx_equals_fresh_dx_over_changing_rows(dtype, per_sm, known, monkeypatch):
        """per_sm: zero programs per SM (the interpreter counts one SM): 2 gives each row tile past k one
        program for all 4 column tiles, 6 two programs of 2 column tiles (while 2-3 row tiles are past k), 64
        one program per tile."""
        from sebp_kernels._triton import dx as dx_module

        monkeypatch.setattr(dx_module, "ZERO_PROGRAMS_PER_SM", per_sm)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(M, N_IN, generator=g).to(dtype)
        w = (torch.randn(N_OUT, N_IN, generator=g) / N_IN**0.5).to(dtype)
        cfg = SEBPConfig("exact")
        buf = ZeroRowBuffer(M, N_IN, dtype, "cpu")
        buf.dx.fill_(float("nan"))  # whatever an unwritten row holds must never come out
        for i, active in enumerate(ROW_SETS):
            dy = _dy(active, dtype, seed=i)
            rows = select_rows_device(dy, "exact", interpret=True) if known else None
            if (dtype, known, i) not in _FRESH:
                _FRESH[dtype, known, i] = sebp_backward_triton(dy, x, w, cfg, rows=rows)
            fresh = _FRESH[dtype, known, i]
            got = sebp_backward_triton(dy, x, w, cfg, rows=rows, dx_buffer=buf)
            assert got[0] is buf.dx
            for name, a, b in zip(("dX", "dW", "db"), got, fresh):
                assert torch.equal(a, b), (i, name)
            marked = set(torch.nonzero(buf.dirty).squeeze(1).tolist())
            assert set(active) <= marked, i  # every row that may be non-zero is marked
            assert buf.tickets.sum() == 0  # the counters are back to zero for the next backward
            if i == 0:
                # the first backward of a new buffer zeroed all other rows and cleared their marks
                assert marked == set(active)

    def test_in_place_change_between_backwards_is_zeroed_again():
        x, w = torch.randn(M, N_IN), torch.randn(N_OUT, N_IN)
        cfg = SEBPConfig("exact")
        buf = ZeroRowBuffer(M, N_IN, torch.float32, "cpu")
        dy = _dy(list(range(5)), torch.float32, 0)
        sebp_backward_triton(dy, x, w, cfg, dx_buffer=buf)
        buf.dx[60:].add_(3.0)  # rows that stay inactive: their marks say clean, the version says otherwise
        got = sebp_backward_triton(dy, x, w, cfg, dx_buffer=buf)[0]
        assert torch.equal(got, sebp_backward_triton(dy, x, w, cfg)[0])
        assert got[60:].abs().sum() == 0

    def test_sebp_linear_with_the_pool_matches_dense_and_spares_held_grads(monkeypatch):
        """Two steps with different padding through SEBP linears and an SEBP GELU between them (with its row
        hint): the gradients match dense autograd, and a dX that autograd handed to the user (the input's
        .grad) is not overwritten by the next step."""
        monkeypatch.setattr(zero_rows, "_usable", lambda device: True)
        zero_rows.enable(True)
        try:
            g = torch.Generator().manual_seed(3)
            w1 = (torch.randn(N_OUT, N_IN, generator=g) / N_IN**0.5).requires_grad_()
            w2 = (torch.randn(N_IN, N_OUT, generator=g) / N_OUT**0.5).requires_grad_()
            cfg = SEBPConfig("exact", backend="triton")
            hint = RowHint()
            kept = []
            for step, length in enumerate((9, 4, 12)):
                x = torch.randn(2, 35, N_IN, generator=g).requires_grad_()
                mask = (torch.arange(35) < length).float().view(1, 35, 1)
                h = sebp_linear(x, w1, config=cfg, hint=hint)
                out = sebp_linear(sebp_gelu(h, hint=hint, backend="triton"), w2, config=cfg)
                (out * mask).square().sum().backward()
                want = torch.autograd.grad((F.gelu(x @ w1.t()) @ w2.t() * mask).square().sum(), (x, w1, w2))
                torch.testing.assert_close(x.grad, want[0], rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(w1.grad, want[1], rtol=1e-4, atol=1e-4)
                assert x.grad[:, length:].abs().sum() == 0
                kept.append((x.grad, x.grad.clone()))
                w1.grad = w2.grad = None
            for held, copy in kept:
                assert torch.equal(held, copy)
            # the pool was used: by the second linear's dX and the GELU's dA (70 x 33, two buffers at once),
            # and by the first linear's dX (70 x 50, cloned into x.grad while the pool holds it)
            shapes = {key[:2]: len(bufs) for key, bufs in zero_rows._POOL.items()}
            assert shapes[(70, N_OUT)] >= 2 and shapes[(70, N_IN)] >= 1
            assert hint.taken == 3  # the first linear took its rows from the GELU at every step
        finally:
            zero_rows.enable(False)

    @pytest.mark.parametrize("kind", ["swiglu", "gelu"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    def test_kept_activation_grads_equal_fresh_ones_over_changing_rows(kind, dtype):
        """The SEBP activation's backward into kept dA / dB buffers: bitwise its output into new tensors, a
        row whose input holds a NaN included (computed in full, so marked)."""
        from sebp_kernels._triton.act import act_backward_triton, act_forward_triton

        m, n = 37, 40
        g = torch.Generator().manual_seed(2)
        a = torch.randn(m, n, generator=g).to(dtype)
        a[29, 3] = float("nan")
        b = torch.randn(m, n, generator=g).to(dtype) if kind == "swiglu" else None
        bad = act_forward_triton(kind, a, b, True, True)[1]
        keep_a = ZeroRowBuffer(m, n, dtype, "cpu")
        keep_b = ZeroRowBuffer(m, n, dtype, "cpu") if b is not None else None
        for buf in (keep_a, keep_b):
            if buf is not None:
                buf.dx.fill_(7.0)
        for i, active in enumerate([list(range(0, 9)), list(range(20, 37)), [], list(range(m)), [0, 5, 36]]):
            mask = torch.zeros(m, dtype=torch.bool)
            mask[active] = True
            dh = (torch.randn(m, n, generator=g) * mask.unsqueeze(1)).to(dtype)
            fresh = act_backward_triton(kind, dh, a, b, bad, True, b is not None, True, True)
            got = act_backward_triton(kind, dh, a, b, bad, True, b is not None, True, True, keep_a=keep_a,
                                      keep_b=keep_b)
            assert got[0] is keep_a.dx and (keep_b is None or got[1] is keep_b.dx)
            for name, x, y in zip(("dA", "dB"), got[:2], fresh[:2]):
                assert (x is None and y is None) or torch.equal(x.nan_to_num(5.0), y.nan_to_num(5.0)), (i, name)
            assert torch.equal(got[2][1], fresh[2][1])  # the rows handed on
            want = set(active) | {29}
            for buf in (keep_a, keep_b):
                if buf is not None:
                    assert set(torch.nonzero(buf.dirty).squeeze(1).tolist()) == want, i

    @pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    def test_kept_norm_dx_equals_a_fresh_one_over_changing_rows(rms, dtype):
        """The SEBP norm's backward into a kept dX: bitwise its dX into a new tensor, dW and db alike, and
        exactly the active rows marked afterwards."""
        from sebp_kernels._triton.norm import norm_backward_triton

        m, n = 37, 24
        g = torch.Generator().manual_seed(4)
        x = torch.randn(m, n, generator=g).to(dtype)
        w = torch.randn(n, generator=g).to(dtype)
        xf = x.float()
        mean = None if rms else xf.mean(1)
        rstd = torch.rsqrt(xf.pow(2).mean(1) + 1e-6) if rms else torch.rsqrt(xf.var(1, unbiased=False) + 1e-5)
        keep = ZeroRowBuffer(m, n, dtype, "cpu")
        keep.dx.fill_(7.0)
        for i, active in enumerate([list(range(0, 9)), list(range(20, 37)), [], list(range(m)), [0, 5, 36]]):
            mask = torch.zeros(m, dtype=torch.bool)
            mask[active] = True
            dy = (torch.randn(m, n, generator=g) * mask.unsqueeze(1)).to(dtype)
            fresh = norm_backward_triton(dy, x, w, mean, rstd, True, True, not rms, 1, True)
            got = norm_backward_triton(dy, x, w, mean, rstd, True, True, not rms, 1, True, keep=keep)
            assert got[0] is keep.dx
            for name, a, b in zip(("dX", "dW", "db"), got, fresh):
                assert (a is None and b is None) or torch.equal(a, b), (i, name)
            assert set(torch.nonzero(keep.dirty).squeeze(1).tolist()) == set(active), i
