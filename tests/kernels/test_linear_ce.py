"""linear_cross_entropy against F.cross_entropy(F.linear(...)): loss and gradients in fp32 (fp64 reference), bf16
under autocast within twice the dense path's own error, edge cases, and the size of its largest intermediate."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from sebp_kernels import linear_cross_entropy
from sebp_kernels.linear_ce import balanced_chunk_rows, default_chunk_rows, labelled_rows
from tests.helpers import assert_within_torch_error

RTOL = 1e-6


def _inputs(n, d, vocab, ignored, bias=True, seed=0):
    """fp64 leaves: hidden (n, d), weight (V, d) scaled to logits of unit size, bias, labels with a share of
    ``ignored`` rows set to -100 (``"none"``, ``"some"``, ``"all"``)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, d, generator=g, dtype=torch.float64) / d ** 0.5
    b = torch.randn(vocab, generator=g, dtype=torch.float64) if bias else None
    y = torch.randint(0, vocab, (n,), generator=g)
    if ignored == "some":
        y[torch.rand(n, generator=g) < 0.6] = -100
        y[0] = 3  # at least one row labelled
    elif ignored == "all":
        y[:] = -100
    return h, w, b, y


def _grads(fn, tensors, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() if t is not None else None for t in tensors]
    loss = fn(*leaves)
    grads = torch.autograd.grad(loss, [t for t in leaves if t is not None])
    return loss.detach(), list(grads)


def _dense(h, w, b, y, **kw):
    return F.cross_entropy(F.linear(h, w, b), y, **kw)


def _assert_rel(actual, want, name):
    err = (actual.double() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= RTOL * scale + 1e-12, f"{name}: max error {err:.3g} > {RTOL} x {scale:.3g}"


@pytest.mark.parametrize("n,vocab,chunk", [(37, 101, 8), (64, 1000, 64), (5, 33, 2), (50, 257, None)])
@pytest.mark.parametrize("ignored", ["none", "some"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fp32_matches_fp64_dense(n, vocab, chunk, ignored, smoothing, reduction):
    h, w, b, y = _inputs(n, 24, vocab, ignored, bias=vocab != 1000)
    kw = dict(label_smoothing=smoothing, reduction=reduction)
    want, want_g = _grads(lambda *t: _dense(*t, y, **kw), (h, w, b), torch.float64)
    got, got_g = _grads(lambda *t: linear_cross_entropy(t[0], t[1], y, *t[2:], chunk_rows=chunk, **kw),
                        (h, w, b), torch.float32)
    assert got.dtype == torch.float32
    _assert_rel(got, want, "loss")
    for name, a, e in zip(("hidden", "weight", "bias"), got_g, want_g):
        _assert_rel(a, e, name)


def test_leading_dims_grad_output_and_other_ignore_index():
    h, w, b, y = _inputs(24, 16, 50, "some")
    y3 = y.masked_fill(y == -100, 7_777).view(2, 12)
    want, want_g = _grads(lambda *t: 3.0 * _dense(*t, y3.view(-1), ignore_index=7_777, label_smoothing=0.2),
                          (h, w, b), torch.float64)
    got, got_g = _grads(lambda x, w_, b_: 3.0 * linear_cross_entropy(x.view(2, 12, 16), w_, y3, b_, chunk_rows=3,
                                                                    ignore_index=7_777, label_smoothing=0.2),
                        (h, w, b), torch.float32)
    _assert_rel(got, want, "loss")
    for name, a, e in zip(("hidden", "weight", "bias"), got_g, want_g):
        _assert_rel(a, e, name)


def test_all_ignored_gives_zero_loss_and_zero_grads():
    h, w, b, y = _inputs(9, 8, 20, "all")
    leaves = [t.float().requires_grad_() for t in (h, w, b)]
    loss = linear_cross_entropy(leaves[0], leaves[1], y, leaves[2], chunk_rows=4)
    loss.backward()
    assert loss.item() == 0.0 and loss.requires_grad
    for t in leaves:
        assert t.grad is not None and torch.equal(t.grad, torch.zeros_like(t))


@pytest.mark.parametrize("bad", [-1, 20, 10**6])
def test_label_out_of_range_raises_one_line(bad):
    h, w, _, y = _inputs(6, 8, 20, "none")
    y[2] = -100
    y[4] = bad
    with pytest.raises(ValueError, match=rf"^label {bad} is outside \[0, 20\)[^\n]*$"):
        linear_cross_entropy(h.float(), w.float(), y)


@pytest.mark.parametrize("ignored", ["none", "some", "all"])
def test_a_given_labelled_count_selects_the_same_rows(ignored):
    """``labelled`` (the caller's count, as a packed batch carries it): same rows, loss and gradients; a wrong
    count raises (eagerly) instead of dropping or inventing rows."""
    h, w, b, y = _inputs(23, 8, 20, ignored)
    n = int((y != -100).sum())
    assert torch.equal(labelled_rows(y, 20, count=n), labelled_rows(y, 20))
    want = _grads(lambda *t: linear_cross_entropy(t[0], t[1], y, t[2]), (h, w, b), torch.float32)
    got = _grads(lambda *t: linear_cross_entropy(t[0], t[1], y, t[2], labelled=n), (h, w, b), torch.float32)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match=rf"^{n} labels are not ignore_index -100, not the {n + 1} given$"):
        linear_cross_entropy(h.float(), w.float(), y, labelled=n + 1)


def test_bad_arguments_raise():
    h, w, _, y = _inputs(6, 8, 20, "none")
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, y, reduction="none")
    with pytest.raises(ValueError, match="differ in dtype"):
        linear_cross_entropy(h.float(), w, y)
    with pytest.raises(ValueError, match="does not match"):
        linear_cross_entropy(h, w[:, :4], y)
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(h, w, y[:4])


def test_frozen_weight_computes_no_weight_grad():
    h, w, b, y = _inputs(30, 16, 64, "some")
    want, (want_dh,) = _grads(lambda x: _dense(x, w, None, y), (h,), torch.float64)
    x = h.float().requires_grad_()
    wf = w.float()  # requires no grad: LoRA's frozen head
    loss = linear_cross_entropy(x, wf, y, chunk_rows=7)
    loss.backward()
    _assert_rel(loss.detach(), want, "loss")
    _assert_rel(x.grad, want_dh, "hidden")
    assert wf.grad is None


def test_tied_weight_sums_both_gradients():
    """The weight is also the input embedding table (tied): both uses reach its gradient."""
    _, w, _, y = _inputs(20, 16, 40, "some")
    ids = torch.randint(0, 40, (20,), generator=torch.Generator().manual_seed(1))

    def run(fn, dtype):
        wl = w.detach().to(dtype).requires_grad_()
        h = torch.tanh(F.embedding(ids, wl))
        loss = fn(h, wl)
        loss.backward()
        return loss.detach(), wl.grad

    want, want_g = run(lambda h, wl: _dense(h, wl, None, y), torch.float64)
    got, got_g = run(lambda h, wl: linear_cross_entropy(h, wl, y, chunk_rows=6), torch.float32)
    _assert_rel(got, want, "loss")
    _assert_rel(got_g, want_g, "weight")


def test_backward_twice_raises_one_line():
    h, w, _, y = _inputs(6, 8, 20, "none")
    x = h.float().requires_grad_()
    loss = linear_cross_entropy(x, w.float(), y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="ran twice"):
        loss.backward()


@pytest.mark.parametrize("chunk", [None, 16])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_bf16_autocast_within_dense_error(chunk, smoothing):
    """fp32 master weights under autocast(bf16): within 2x the autocast dense path's error against fp64."""
    h, w, b, y = _inputs(80, 64, 300, "some")
    ref, ref_g = _grads(lambda *t: _dense(*t, y, label_smoothing=smoothing), (h, w, b), torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dense, dense_g = _grads(lambda *t: _dense(*t, y, label_smoothing=smoothing).float(), (h, w, b),
                                torch.float32)
        got, got_g = _grads(lambda *t: linear_cross_entropy(t[0], t[1], y, t[2], label_smoothing=smoothing,
                                                            chunk_rows=chunk), (h, w, b), torch.float32)
    assert got.dtype == torch.float32 and all(g.dtype == torch.float32 for g in got_g)
    assert_within_torch_error(got, ref, dense, torch.bfloat16, "loss")
    for name, a, e, t in zip(("hidden", "weight", "bias"), got_g, ref_g, dense_g):
        assert_within_torch_error(a, e, t, torch.bfloat16, name)


def test_bf16_weights_without_autocast():
    """bf16 tensors throughout, several chunks: dW summed in fp32, returned in bf16."""
    h, w, _, y = _inputs(90, 64, 300, "none")
    ref, ref_g = _grads(lambda *t: _dense(*t, None, y), (h, w), torch.float64)
    dense, dense_g = _grads(lambda *t: _dense(*t, None, y).float(), (h, w), torch.bfloat16)
    got, got_g = _grads(lambda *t: linear_cross_entropy(*t, y, chunk_rows=16), (h, w), torch.bfloat16)
    assert got.dtype == torch.float32 and all(g.dtype == torch.bfloat16 for g in got_g)
    assert_within_torch_error(got, ref, dense, torch.bfloat16, "loss")
    for name, a, e, t in zip(("hidden", "weight"), got_g, ref_g, dense_g):
        assert_within_torch_error(a, e, t, torch.bfloat16, name)


class _LargestOutput(TorchDispatchMode):
    """Records the element count of the largest tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_largest_intermediate_is_one_chunk_of_logits():
    n, d, vocab, chunk = 512, 16, 2000, 32
    h, w, _, y = _inputs(n, d, vocab, "none")
    x, wf = h.float().requires_grad_(), w.float().requires_grad_()
    with _LargestOutput() as seen:
        linear_cross_entropy(x, wf, y, chunk_rows=chunk).backward()
    assert seen.largest == chunk * vocab  # one chunk's logits; far below n x V
    assert seen.largest * 8 <= n * vocab


def test_default_chunk_rows():
    assert default_chunk_rows(128256, torch.bfloat16) == 384  # ~320 MiB: fp32 + bf16 logits of the chunk
    assert default_chunk_rows(151936, torch.float32) == 512
    assert default_chunk_rows(128256, torch.bfloat16, fused=True) == 1280  # the kernel's path: bf16 logits only
    assert balanced_chunk_rows(4096, default_chunk_rows(151936, torch.bfloat16, fused=True)) == 1024
    assert default_chunk_rows(120, torch.float32) > 5 * 10**5  # one chunk for a small vocabulary


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_autocast_and_peak_memory(dtype):
    """On a GPU: several chunks (the fp32 dW accumulation under autocast), error within the dense path's, and a
    peak memory far below the dense path's."""
    h, w, b, y = _inputs(4096, 512, 32000, "some")
    h, w, b, y = (t.cuda() for t in (h, w, b, y))
    ref, ref_g = _grads(lambda *t: _dense(*t, y), (h, w, b), torch.float64)
    peaks = {}
    for name, fn in (("dense", lambda *t: _dense(*t, y).float()),
                     ("chunked", lambda *t: linear_cross_entropy(t[0], t[1], y, t[2], chunk_rows=256))):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            peaks[name] = _grads(fn, (h, w, b), torch.float32), torch.cuda.max_memory_allocated() - base
    (dense, dense_g), _ = peaks["dense"]
    (got, got_g), _ = peaks["chunked"]
    for a, e, t in zip([got, *got_g], [ref, *ref_g], [dense, *dense_g]):
        if dtype == torch.bfloat16:
            assert_within_torch_error(a, e, t, torch.bfloat16)
        else:  # cuBLAS's fp32 sums over d = 512 differ from fp64 by more than 1e-6 on their own
            err, own = ((x.double() - e).abs().max().item() for x in (a, t))
            assert err <= 2 * own + RTOL * e.abs().max().item(), f"fp32: {err:.3g} vs the dense path's {own:.3g}"
    assert peaks["chunked"][1] * 2 < peaks["dense"][1]


@pytest.mark.parametrize("n,most", [(4096, 1728), (4096, 4096), (10, 1728), (1000, 7), (0, 64), (4097, 2048)])
def test_balanced_chunks_cover_the_rows_evenly(n, most):
    per = balanced_chunk_rows(n, most)
    chunks = -(-n // per) if n else 1
    assert 1 <= per <= max(most, 1) and chunks == max(1, -(-n // most))  # no more chunks than the cap needs
    assert n - (chunks - 1) * per <= per and (chunks == 1 or n - (chunks - 1) * per > per - 128 * chunks)


def test_compiled_loss_and_gradients_equal_eager_without_a_recompile_per_row_count():
    """Under torch.compile the head is one opaque op: the loss and gradients are eager's, and batches with other
    numbers of labelled rows (every packed batch) reuse the one graph."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    w = torch.randn(50, 16, requires_grad=True)
    b = torch.randn(50, requires_grad=True)

    def loss_of(h, y, n):
        return linear_cross_entropy(h, w, y, bias=b, labelled=n, chunk_rows=8, label_smoothing=0.1)

    compiled = torch.compile(loss_of, dynamic=True, backend="aot_eager", fullgraph=True)
    for rows in (33, 35, 40, 47, 50):
        h = torch.randn(rows, 16, requires_grad=True)
        y = torch.randint(0, 50, (rows,))
        y[::3] = -100
        n = int((y != -100).sum())
        got = []
        for fn in (compiled, loss_of):
            loss = fn(h, y, n)
            loss.backward()
            got.append((loss.detach(), h.grad, w.grad, b.grad))
            h.grad = w.grad = b.grad = None
        for a, e in zip(*got):
            torch.testing.assert_close(a, e, rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 1
    dynamo.reset()
