"""Sampled mode on the Triton kernels (sebp_kernels._triton.sampled) under the interpreter (TRITON_INTERPRET=1, CPU
tensors) against the torch reference: the device hash bit for bit, the keep decisions bit for bit, dX/dW/db to
fp tolerance, budget 1 exact, warm-up exact, NaN/Inf rows kept, unbiased over many draws, resume.

As in test_triton_interp.py, a normal run delegates to one pytest subprocess with the variable set (run this file
with TRITON_INTERPRET=1 to see the individual cases). The GPU cases are in test_sampled_gpu.py.
"""
from __future__ import annotations

import os
import random

import pytest
import torch


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

if INTERPRET:
    import triton
    import triton.language as tl

    from sebp_kernels import SEBPConfig, sebp_linear
    from sebp_kernels._triton import sample_select
    from sebp_kernels._triton.sample_select import _row_draws, select_sampled
    from sebp_kernels._triton.sampled import sampled_backward_triton
    from sebp_kernels.reference import sebp_backward_torch
    from sebp_kernels.sampling import (GRID, SampleState, _signed, keep_probabilities, mix64_int, row_draws,
                                       sampled_backward_torch, stream_base)
    from tests.helpers import dense_grads

    @triton.jit
    def _draws_kernel(hash_ptr, out_ptr, M, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + rows, _row_draws(hash_ptr, rows), mask=rows < M)

    def _device_draws(seed, key, step, m):
        h = torch.tensor([_signed(mix64_int(seed * 0x9E3779B97F4A7C15 + key)), _signed(step)], dtype=torch.int64)
        out = torch.empty(m, dtype=torch.int32)
        _draws_kernel[(triton.cdiv(m, 32),)](h, out, m, BLOCK=32)
        return out.long()

    def _skewed(m=70, n=13, k=19, zero_every=5, dtype=torch.float32, power=4, floor=0.0, seed=0):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(m, k, generator=g, dtype=torch.float64).to(dtype)
        w = torch.randn(n, k, generator=g, dtype=torch.float64).to(dtype)
        dy = torch.randn(m, n, generator=g, dtype=torch.float64) * (
            torch.rand(m, 1, generator=g, dtype=torch.float64) ** power + floor)
        dy[::zero_every] = 0
        return x, w, dy.to(dtype)

    def test_device_hash_is_row_draws_bit_for_bit():
        rng = random.Random(1)
        cases = [(0, 0, 0), (3, 7, 11), (2 ** 63 - 1, 2 ** 32 - 1, 2 ** 40 + 3)]
        cases += [(rng.getrandbits(62), rng.getrandbits(32), rng.getrandbits(30)) for _ in range(5)]
        for seed, key, step in cases:
            assert torch.equal(_device_draws(seed, key, step, 77), row_draws(seed, key, step, 77)), (seed, key, step)
        # the device's stream base: the host's (the draw of row 0 is a function of it alone)
        base = stream_base(5, 9, 4)
        assert row_draws(5, 9, 4, 1)[0] == mix64_int((0x9E3779B97F4A7C15 + base) & (2 ** 64 - 1)) >> 40

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    @pytest.mark.parametrize("m", [70, 5, 1, 130])
    def test_selection_keeps_the_reference_rows_and_orders_them(dtype, m):
        x, w, dy = _skewed(m=m, dtype=dtype)
        if m > 10:
            dy[3] = 0
            dy[3, 1] = float("nan")
            dy[7, 2] = float("inf")
        norms = torch.linalg.vector_norm(dy.float(), dim=1)
        tau = norms.nan_to_num(0, 0, 0).max() * 0.4
        seed, key, step = 7, 1234, 5
        h = torch.tensor([_signed(mix64_int(seed * 0x9E3779B97F4A7C15 + key)), step], dtype=torch.int64)
        stats = torch.zeros(3, dtype=torch.int64)
        perm, counts, wn, q, scale, wmax = select_sampled(dy, tau, h, stats, 0, interpret=True)
        torch.testing.assert_close(wn, norms, equal_nan=True)
        assert float(wmax.max()) == float(wn.nan_to_num(0, 0, 0).max())  # the largest finite norm
        q_ref = keep_probabilities(wn, tau)  # the reference's rule on the kernel's norms
        active = dy.any(1)
        kept = active & (row_draws(seed, key, step, m) < (q_ref * GRID).long())
        assert torch.equal(q, torch.where(active, q_ref, torch.ones_like(q_ref)) if m else q)
        assert torch.equal(scale, 1.0 / q)
        k, a = counts.tolist()
        assert k == int(kept.sum()) and a == int(active.sum())
        rows = torch.arange(m)
        assert torch.equal(perm[:k].long(), rows[kept])
        assert torch.equal(perm[k:a].long(), rows[active & ~kept])
        assert sorted(perm[a:].tolist()) == rows[~active].tolist()
        assert h[1] == step + 1 and stats.tolist() == [m, a, k]
        if m > 10:
            assert kept[3] and kept[7] and 0 < k < a  # NaN and Inf rows kept; the tail sampled

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    @pytest.mark.parametrize("budget, sample_dx", [(0.3, False), ("auto", False), (1.0, False), (0.3, True)])
    def test_backwards_match_the_torch_reference(dtype, budget, sample_dx):
        _match_the_reference(dtype, budget, sample_dx)

    @pytest.mark.parametrize("budget, sample_dx", [(0.3, False), ("auto", True)])
    def test_a_full_capacity_takes_the_reference_window(budget, sample_dx):
        """8 slots for about 17 kept rows: the kernel's window and scale are the reference's."""
        _match_the_reference(torch.float32, budget, sample_dx, cap=8)

    @pytest.mark.parametrize("need", [(True, False, False), (True, False, True), (False, True, True)])
    def test_frozen_weights_and_no_dx_take_the_reference_rows(need):
        """A frozen weight (dX and maybe db, no X gathered) and a layer whose input needs no gradient, with the
        window taken (a sampled dX: the gathered rows' GEMM scattered into zero rows)."""
        _match_the_reference(torch.float32, 0.3, True, cap=8, need=need)

    def _match_the_reference(dtype, budget, sample_dx, cap=None, need=(True, True, True)):
        x, w, dy = _skewed(dtype=dtype)
        cfg = SEBPConfig("sampled", budget=budget, seed=3, warmup=1, sample_dx=sample_dx)
        ref, tri = SampleState(5), SampleState(5)
        tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
        for t in range(4):
            d = dy * (1 + 0.5 * t)  # a new dY each backward
            if tri.tau is not None:  # the same cutoff (the two solvers may differ in its last candidate step)
                ref.tau = tri.tau.clone()
            want = sampled_backward_torch(d, x, w, cfg, ref, *need, cap=cap)
            got = sampled_backward_triton(d, x, w, cfg, tri, *need, cap=cap)
            for g, e, asked in zip(got, want, need):
                assert (g is None) == (e is None) == (not asked)
                if asked:
                    torch.testing.assert_close(g, e, **tol)
            assert ref.counts() == tri.counts() and ref.calls == tri.calls
            torch.testing.assert_close(tri.tau, ref.tau, rtol=1e-3, atol=0)
        c = tri.counts()
        assert c["rows"] == 3 * dy.shape[0] and (c["kept"] < c["nonzero"]) == (budget != 1.0)

    @pytest.mark.parametrize("zero_every, dense", [(100, True), (2, False)])
    def test_exact_dx_of_nearly_dense_rows_is_the_dense_gemm(zero_every, dense, monkeypatch):
        """Once a layer's rows were read back as nearly all non-zero, its exact dX is ``dY @ W``; with many zero
        rows (or before the first read) the fused kernel computes it over the non-zero rows (dW and db are GEMMs
        over the gathered kept rows either way). The gradients match the reference's either way."""
        from sebp_kernels._triton import sampled

        asked = []
        real = sampled.grads_rows
        monkeypatch.setattr(sampled, "grads_rows", lambda *a, **k: asked.append(a[5]) or real(*a, **k))
        x, w, dy = _skewed(zero_every=zero_every)
        cfg = SEBPConfig("sampled", budget=0.4, seed=4)
        tri, ref = SampleState(6), SampleState(6)
        for _ in range(3):
            ref.tau = None if tri.tau is None else tri.tau.clone()
            got = sampled_backward_triton(dy, x, w, cfg, tri)
            want = sampled_backward_torch(dy, x, w, cfg, ref)
            for g, e in zip(got, want):
                torch.testing.assert_close(g, e)
        assert asked == [True] + ([] if dense else [True])  # the first backward ran on the torch path

    def test_the_triton_path_runs_inside_sebp_linear(monkeypatch):
        """Through the autograd Function (backend triton on the interpreter), each backward after the first runs
        the kernels' selection; the gradients match the reference's."""
        calls = []
        real = sample_select.select_sampled
        monkeypatch.setattr("sebp_kernels._triton.sampled.select_sampled",
                            lambda *a, **k: calls.append(1) or real(*a, **k))
        x, w, dy = _skewed()
        b = torch.randn(w.shape[0])
        cfg = SEBPConfig("sampled", budget=0.4, seed=2, backend="triton")
        st, ref = SampleState(8), SampleState(8)
        for _ in range(3):
            xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
            ref.tau = None if st.tau is None else st.tau.clone()  # one cutoff (the solvers' last step may differ)
            sebp_linear(xs, ws, bs, cfg, state=st).backward(dy)
            want = sampled_backward_torch(dy, x, w, cfg, ref)
            for g, e in zip((xs.grad, ws.grad, bs.grad), want):
                torch.testing.assert_close(g, e)
        assert len(calls) == 2  # the first backward solves its cutoff in torch

    def test_budget_one_and_warmup_are_the_exact_gradient():
        x, w, dy = _skewed()
        exact = sebp_backward_torch(dy, x, w, SEBPConfig("exact"))
        for cfg in (SEBPConfig("sampled", budget=1.0), SEBPConfig("sampled", budget=0.1, warmup=4)):
            state = SampleState(1)
            for _ in range(4):
                for g, e in zip(sampled_backward_triton(dy, x, w, cfg, state), exact):
                    torch.testing.assert_close(g, e)
        assert state.counts()["rows"] == 0 and float(state.tau) > 0  # warm-up: nothing sampled, cutoff solved
        _, dw, _ = sampled_backward_triton(dy, x, w, cfg, state)
        assert not torch.allclose(dw, exact[1]) and 0 < state.counts()["kept"] < state.counts()["nonzero"]

    def test_resume_continues_the_draws_on_the_device():
        x, w, dy = _skewed()
        cfg = SEBPConfig("sampled", budget=0.3, seed=11)
        one, two = SampleState(4), SampleState(4)
        first = [sampled_backward_triton(dy * (1 + t), x, w, cfg, one)[1] for t in range(5)]
        for t in range(2):
            sampled_backward_triton(dy * (1 + t), x, w, cfg, two)
        three = SampleState(4)
        three.load_state_dict(two.state_dict())
        rest = [sampled_backward_triton(dy * (1 + t), x, w, cfg, three)[1] for t in range(2, 5)]
        for a, b in zip(first[2:], rest):
            assert torch.equal(a, b)
        assert three.counts() == one.counts()

    def test_mean_over_draws_is_the_dense_gradient():
        """100 draws of the Triton path (dW and db): their mean is the dense gradient within its standard error
        (rows independent: Var = sum_i g_i^2 (1 - q_i) / q_i)."""
        x, w, dy = _skewed(m=40, n=6, k=8, power=2, floor=0.05, dtype=torch.float64)
        x, w, dy = x.float(), w.float(), dy.float()
        _, dw_ref, db_ref = dense_grads(x.double(), w.double(), torch.zeros(w.shape[0], dtype=torch.float64),
                                        dy.double())
        cfg, state = SEBPConfig("sampled", budget=0.3, seed=5), SampleState(9)
        sampled_backward_triton(dy, x, w, cfg, state)  # the first backward: torch, solves the cutoff
        draws = 100  # the z-scores below are scaled by the draws: fewer draws, same test
        got = [sampled_backward_triton(dy, x, w, cfg, state, need_dx=False) for _ in range(draws)]
        c = state.counts()
        assert 0.2 < c["kept"] / c["nonzero"] < 0.45, c
        q = keep_probabilities(torch.linalg.vector_norm(dy, dim=1), state.tau).double()
        odds = torch.where(dy.any(1), (1 - q) / q, torch.zeros_like(q))
        var = {"dw": (dy.double() ** 2).t() @ (x.double() ** 2 * odds[:, None]),
               "db": (dy.double() ** 2 * odds[:, None]).sum(0)}
        zs = []
        for i, name, ref in ((1, "dw", dw_ref), (2, "db", db_ref)):
            s = torch.stack([g[i].double() for g in got])
            zs.append(((s.mean(0) - ref) / (var[name] / draws).sqrt()).flatten())
        z = torch.cat(zs)
        assert z.abs().max() < 4.5, z.abs().max().item()
        assert 0.4 < (z ** 2).mean() < 2.0, (z ** 2).mean().item()

    def test_a_compiled_layer_runs_the_kernels_through_the_operator(monkeypatch):
        """Compiled, a sampled SEBPLinear's backward is the operator sebp::linear_backward, which runs this path
        each call (the host's count advancing); the gradients match the reference's draw for draw."""
        from torch._functorch.aot_autograd import aot_module_simplified

        from sebp_kernels import SEBPLinear, registry

        calls = []
        real = sample_select.select_sampled
        monkeypatch.setattr("sebp_kernels._triton.sampled.select_sampled",
                            lambda *a, **k: calls.append(1) or real(*a, **k))
        graphs = []

        def backend(gm, example):
            return aot_module_simplified(gm, example, fw_compiler=lambda g, _: g,
                                         bw_compiler=lambda g, _: graphs.append(g) or g)

        torch.manual_seed(0)
        cfg = SEBPConfig("sampled", budget=0.4, seed=6, backend="triton")
        lin = SEBPLinear(19, 13, config=cfg, sample_key=7)
        registry.keys_as_inputs(lin)
        x, w, dy = _skewed()
        ref = SampleState(7)
        step = torch.compile(lin, backend=backend)
        for _ in range(3):
            lin.weight.grad = lin.bias.grad = None
            tau = lin._sebp_sampler.tau
            ref.tau = None if tau is None else tau.clone()  # one cutoff (the solvers' last step may differ)
            step(x).backward(dy)
            want = sampled_backward_torch(dy, x, lin.weight.detach(), cfg, ref)
            torch.testing.assert_close(lin.weight.grad, want[1])
            torch.testing.assert_close(lin.bias.grad, want[2])
        assert len(calls) == 2 and "sebp.linear_backward" in graphs[-1].code

    @pytest.mark.parametrize("m", [1, 70, 600])
    def test_the_cutoff_kernel_solves_as_the_torch_rules(m):
        """One launch gives the cutoff that solve_tau / solve_cutoff_for_variance give (the same buckets, sums in
        another order), for a fixed share and for the variance rule, zero and non-finite norms included, from
        the norms themselves or from per-block maxima."""
        from sebp_kernels._triton.sample_cutoff import update_cutoff_device
        from sebp_kernels._triton.select import row_sumsq
        from sebp_kernels.sample_variance import sampling_variance, sgd_variance, solve_cutoff_for_variance
        from sebp_kernels.sampling import solve_tau

        g = torch.Generator().manual_seed(m)
        w = torch.rand(m, generator=g) ** 4
        w[::6] = 0
        if m > 10:
            w[3], w[5] = float("nan"), float("inf")
        x = torch.randn(m, 9, generator=g)
        xn2 = (x ** 2).sum(1)
        torch.testing.assert_close(row_sumsq(x, True), xn2)
        tau = torch.zeros(())
        fin = w.nan_to_num(0, 0, 0)
        blocks = torch.stack([fin[i:i + 8].max() for i in range(0, m, 8)])

        def close(got, want):  # the same bucket; sums in another order
            torch.testing.assert_close(got, want, rtol=1e-4, atol=0.0)

        for share in (0.05, 0.3, 0.9, 1.0):
            update_cutoff_device(tau, w, torch.ones(m), None, None, share, 0.0, True)
            close(tau, solve_tau(w, share))
            if share < 1 and m > 1:
                assert float(tau) > 0
        update_cutoff_device(tau, w, torch.ones(m), None, None, 0.3, 0.0, True, blocks)
        close(tau, solve_tau(w, 0.3))
        q = torch.where(w > 0, torch.rand(m, generator=g) * 0.9 + 0.1, torch.ones(m))
        dw = torch.randn(5, 9, generator=g)
        for var_tau in (0.01, 0.1, 1.0):
            for d in (dw, None):
                g_sq = (dw ** 2).sum() - sampling_variance(w, xn2, q) if d is not None else torch.zeros(())
                target = var_tau * sgd_variance(w, xn2, g_sq)
                update_cutoff_device(tau, w, q, xn2, d, 1.0, var_tau, True)
                close(tau, solve_cutoff_for_variance(w, xn2, target))

    @pytest.mark.parametrize("budget", [0.3, "auto"])
    def test_no_value_is_read_on_the_host_after_the_first_backward(budget, monkeypatch):
        """The CPU stand-in of the GPU's sync check: a backward on the Triton path calls none of the tensor
        methods that read a value on the host."""
        x, w, dy = _skewed()
        cfg, state = SEBPConfig("sampled", budget=budget, seed=1), SampleState(2)
        for _ in range(2):
            sampled_backward_triton(dy, x, w, cfg, state)

        def host_read(*args, **kwargs):
            raise AssertionError("a value read on the host")

        for name in ("item", "__bool__", "nonzero", "tolist", "__int__", "__float__"):
            monkeypatch.setattr(torch.Tensor, name, host_read)
        sampled_backward_triton(dy, x, w, cfg, state)

    def test_a_torch_backward_between_advances_the_device_count(monkeypatch):
        """A guard's backward (torch path) advances the device's backward count too: the Triton path goes on from
        it without a copy to the device, and its draws are the uninterrupted run's."""
        x, w, dy = _skewed()
        cfg = SEBPConfig("sampled", budget=0.3, seed=2)
        one, two = SampleState(3), SampleState(3)
        for t in range(5):
            two.tau = None if one.tau is None else one.tau.clone()  # one cutoff (the solvers' last step may differ)
            a = sampled_backward_triton(dy * (1 + t), x, w, cfg, one)[1]
            if t == 2:
                b = sampled_backward_torch(dy * (1 + t), x, w, cfg, two)[1]
                built = two._hash
            else:
                b = sampled_backward_triton(dy * (1 + t), x, w, cfg, two)[1]
            assert torch.equal(a, b) if t != 2 else torch.allclose(a, b, rtol=1e-4, atol=1e-6)  # sums in another order
        assert two._hash is built and two.state_dict()["calls"] == one.state_dict()["calls"] == 5
