"""The Triton kernels on a Conv1D's transposed weight (the (out, in) view of a contiguous (in, out) weight, read
through its strides, no copy), under the interpreter (TRITON_INTERPRET=1, CPU tensors) against the torch
reference: the backward and the forward over the real rows (see tests/kernels/test_triton_interp.py for why a
normal run delegates to one subprocess)."""
from __future__ import annotations

import os

import pytest
import torch


if os.environ.get("TRITON_INTERPRET") == "1":
    from sebp_kernels import SEBPConfig, SEBPConv1D, SEBPLinear
    from sebp_kernels._triton import sebp_backward_triton
    from sebp_kernels.forward_rows import linear_over_rows
    from sebp_kernels.reference import linear_rows_torch, sebp_backward_torch
    from tests.helpers import assert_within_torch_error

    def _inputs(m, n_out, n_in, dtype, seed=0):
        g = torch.Generator().manual_seed(seed)
        dy = torch.randn(m, n_out, generator=g) * (torch.rand(m, 1, generator=g) < 0.4)
        x = torch.randn(m, n_in, generator=g)
        w_t = torch.randn(n_in, n_out, generator=g) / n_in ** 0.5  # stored (in, out), as Conv1D keeps it
        return dy.to(dtype), x.to(dtype), w_t.to(dtype).t()

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    @pytest.mark.parametrize("shape", [(37, 23, 19), (70, 48, 32)])
    def test_backward_reads_the_transposed_weight(shape, dtype):
        dy, x, w = _inputs(*shape, dtype)
        assert w.stride(0) == 1 and not w.is_contiguous()
        cfg = SEBPConfig("exact")
        got = sebp_backward_triton(dy, x, w, cfg)
        want = sebp_backward_torch(dy, x, w, cfg)
        ref = sebp_backward_torch(dy.double(), x.double(), w.double(), cfg)
        for name, g, t, r in zip(("dX", "dW", "db"), got, want, ref):
            assert g.shape == t.shape, name
            assert_within_torch_error(g, r, t, dtype, name)

    @pytest.mark.parametrize("with_bias", [True, False])
    def test_forward_over_rows_reads_the_transposed_weight(with_bias):
        _, x, w = _inputs(45, 24, 20, torch.float32)
        bias = torch.randn(24) if with_bias else None
        perm = torch.randperm(45).to(torch.int32)
        count = torch.tensor([29], dtype=torch.int32)
        got = linear_over_rows(x, w, bias, perm, count)
        want = linear_rows_torch(x, w.contiguous(), perm, count, bias)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    def test_sebp_conv1d_module_on_the_triton_backend_equals_the_sebp_linear():
        torch.manual_seed(0)
        lin = torch.nn.Linear(20, 28)
        conv = torch.nn.Module()
        conv.weight = torch.nn.Parameter(lin.weight.detach().t().contiguous())
        conv.bias = torch.nn.Parameter(lin.bias.detach().clone())
        cfg = SEBPConfig("exact", backend="triton")
        a, b = SEBPLinear.from_linear(lin, cfg), SEBPConv1D.from_conv1d(conv, cfg)
        x = torch.randn(3, 9, 20)
        dy = torch.randn(3, 9, 28) * (torch.rand(3, 9, 1) < 0.5)
        grads = []
        for m in (a, b):
            xi = x.clone().requires_grad_()
            m(xi).backward(dy)
            grads.append((xi.grad, m.weight.grad, m.bias.grad))
        (dx_a, dw_a, db_a), (dx_b, dw_b, db_b) = grads
        torch.testing.assert_close(dx_b, dx_a, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dw_b, dw_a.t(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(db_b, db_a, rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize("model_type,task", [("gpt2", "causal-lm"), ("albert", "classification")])
    def test_a_patched_model_takes_its_padding_rows_and_trains_as_dense(model_type, task):
        """GPT-2's Conv1D layers and ALBERT's shared ones (each called 3 times a forward) on the Triton backward
        with the padding rows' check: it passes, the linears take the rows, the gradients are dense's."""
        import copy

        from sebp_probe.model.patch import pad_rows_summary, patch_sebp
        from tests.tiny_models import family_model

        dense = family_model(model_type, task)
        sebp = copy.deepcopy(dense)
        patch_sebp(sebp, SEBPConfig("exact", backend="triton"), norms=True)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 120, (4, 12), generator=g)
        mask = torch.ones_like(ids)
        mask[1, 7:] = mask[3, 4:] = 0
        labels = torch.tensor([0, 2, 1, 1]) if task == "classification" else ids.masked_fill(mask == 0, -100)
        batch = dict(input_ids=ids, attention_mask=mask, labels=labels)
        out = []
        for model, steps in ((dense, 1), (sebp, 2)):  # SEBP: the check, then a step that takes the rows
            for _ in range(steps):  # (no update between: each step has the same loss and gradients)
                model.zero_grad(set_to_none=True)
                loss = model(**batch).loss
                loss.backward()
            out.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
        summary = pad_rows_summary(sebp)
        assert summary["state"] == "on" and summary["taken"] > 0
        (l_d, g_d), (l_s, g_s) = out
        torch.testing.assert_close(l_s, l_d, rtol=1e-6, atol=0)
        assert g_d.keys() == g_s.keys()
        for k in g_d:
            torch.testing.assert_close(g_s[k], g_d[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
