"""The fused cross-entropy chunk kernel (sebp_kernels._triton.ce) under the interpreter (TRITON_INTERPRET=1,
CPU tensors): linear_cross_entropy's kernel path gives the torch path's loss and gradients, and both equal
fp64 dense. A normal run delegates to one pytest subprocess with the variable set (it must be set before the
kernel is decorated). fp32 and fp16 (bf16 is broken in the interpreter; the GPU tests cover it)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

if INTERPRET:
    from sebp_kernels import linear_ce
    from sebp_kernels._triton import ce

    def _case(n, d, vocab, ignored, dtype, seed=0):
        g = torch.Generator().manual_seed(seed)
        h = torch.randn(n, d, generator=g, dtype=dtype)
        w = (torch.randn(vocab, d, generator=g) * 0.3).to(dtype)
        y = torch.randint(0, vocab, (n,), generator=g)
        y[torch.rand(n, generator=g) < ignored] = -100
        return h, w, y

    def _grads(fn, h, w, b, y):
        h_, w_ = h.clone().requires_grad_(), w.clone().requires_grad_()
        b_ = b.clone().requires_grad_() if b is not None else None
        loss = fn(h_, w_, b_, y)
        loss.backward()
        return loss.detach(), h_.grad, w_.grad, (b_.grad if b_ is not None else None)

    @pytest.mark.parametrize("n,vocab,chunk,ignored,smoothing,bias", [
        (37, 301, 16, 0.5, 0.0, False), (64, 257, 64, 0.0, 0.1, True), (9, 5000, 4, 0.8, 0.0, False),
        (20, 130, None, 1.0, 0.0, False), (33, 4099, 7, 0.3, 0.2, True)])
    def test_kernel_path_equals_torch_path_and_fp64_dense(n, vocab, chunk, ignored, smoothing, bias):
        h, w, y = _case(n, 24, vocab, ignored, torch.float32)
        b = torch.randn(vocab) * 0.1 if bias else None
        assert linear_ce._fused_ce(h, torch.float32) is ce.ce_grad_inplace  # the kernel runs here
        fused = _grads(lambda h_, w_, b_, y_: linear_ce.linear_cross_entropy(
            h_, w_, y_, b_, label_smoothing=smoothing, chunk_rows=chunk), h, w, b, y)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(linear_ce, "_fused_ce", lambda h_, c: None)
            ref = _grads(lambda h_, w_, b_, y_: linear_ce.linear_cross_entropy(
                h_, w_, y_, b_, label_smoothing=smoothing, chunk_rows=chunk), h, w, b, y)
        b64 = b.double() if bias else None
        dense = _grads(lambda h_, w_, b_, y_: F.cross_entropy(F.linear(h_, w_, b_), y_, label_smoothing=smoothing)
                       if (y_ != -100).any() else (F.linear(h_, w_, b_) * 0).sum(),
                       h.double(), w.double(), b64, y)
        for got, want, exp in zip(fused, ref, dense):
            if want is None:
                assert got is None
                continue
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(got.double(), exp, atol=1e-6, rtol=1e-5)

    def test_fp16_logits_kernel_within_the_torch_paths_error():
        h, w, y = _case(40, 16, 777, 0.4, torch.float16, seed=3)
        z = (h @ w.t())
        y = y.clamp(min=0)
        want = F.cross_entropy(z.double(), y, reduction="none")
        got = ce.ce_grad_inplace(z, y, scale=1.0)
        torch.testing.assert_close(got.double(), want, atol=2e-3, rtol=2e-3)
        g = torch.softmax((h @ w.t()).double(), 1) - F.one_hot(y, 777).double()
        torch.testing.assert_close(z.double(), g, atol=2e-3, rtol=0)
