"""The row-statistics kernel under the interpreter (TRITON_INTERPRET=1, CPU tensors): the collector's Triton
path gives exactly the statistics of its torch path, and both equal a numpy brute force.

As in test_triton_interp.py, a normal run delegates to one pytest subprocess with the variable set (it must
be set before the kernel is decorated). fp32 and fp16 only (bf16 is broken in the interpreter; the GPU test
in tests/probe/test_hooks.py covers it). Shapes are small and awkward against the interpreter's 4 x 16 tiles.
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

if INTERPRET:
    import numpy as np

    from sebp_probe.analysis import grad_reduce, hooks
    from sebp_probe.analysis.knee import fine_histogram
    from tests.helpers import LinearStack, assert_same_stats, collect_with_grads, special_rows_grad
    from tests.tiny_models import padded_batch, tiny_model

    DTYPES = [torch.float32, torch.float16]

    @contextlib.contextmanager
    def torch_path():
        """Inside this block the collector and reduce_grad take the torch path (the oracle)."""
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(grad_reduce, "kernel_for", lambda g: None)
            yield

    def _brute_force(g: torch.Tensor, step: int):
        """(zero rows, non-finite rows, zero elements, max bits, element hist, row hist) with numpy."""
        a = g.reshape(-1, g.shape[-1]).float().numpy()
        bits = np.abs(a).view(np.int32)
        bits = np.where(bits > 0x7F800000, 0x7FC00000, bits)  # every NaN is the canonical one
        row_max = bits.max(axis=1)
        row_hist = np.bincount(((row_max.astype(np.int64) - 1) >> 20) + 1, minlength=hooks.N_FINE)
        return (int((row_max == 0).sum()), int((row_max >= 0x7F800000).sum()), int((a == 0).sum()),
                int(row_max.max()), fine_histogram(a[::step]), row_hist)

    def _uses_kernel(g: torch.Tensor) -> bool:
        return grad_reduce.kernel_for(g.reshape(-1, g.shape[-1])) is not None

    def _check_reduce_grad(g):
        assert _uses_kernel(g)  # else the comparison below would be torch against torch
        got = hooks.reduce_grad(g)
        with torch_path():
            want = hooks.reduce_grad(g)
        assert got[:2] == want[:2]
        for name, x, y in zip(("scalars", "element_hist", "row_hist"), got[2:], want[2:]):
            assert x.dtype == y.dtype == torch.int64 and torch.equal(x, y), \
                f"{name}: first mismatches at {(x != y).nonzero()[:6].flatten().tolist()}"
        step = -(-g.numel() // grad_reduce.ELEMENT_SAMPLE)
        zr, nf, ze, mb, eh, rh = _brute_force(g, step)
        assert got[2].tolist() == [zr, nf, ze, mb]
        np.testing.assert_array_equal(got[3].numpy(), eh)
        np.testing.assert_array_equal(got[4].numpy(), rh)

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("shape", [(37, 19), (1, 17), (5, 3), (130, 40), (8, 32), (3, 7, 23)])
    @pytest.mark.parametrize("sample", [1 << 14, 100])
    def test_reduce_grad_equals_torch_path_and_brute_force(shape, dtype, sample, monkeypatch):
        monkeypatch.setattr(grad_reduce, "ELEMENT_SAMPLE", sample)  # 100: every 2nd..53rd row is sampled
        g = special_rows_grad(shape, dtype, seed=sum(shape))
        _check_reduce_grad(g)

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_strided_and_single_column_gradients(dtype):
        base = special_rows_grad((41, 32), dtype, seed=3)
        for g in (base[:, 5:24], base.t()[:19], base[::3], base[:, :1]):  # row stride != cols; column stride
            _check_reduce_grad(g)

    def test_all_zero_all_nan_and_extreme_magnitudes():
        finfo = torch.finfo(torch.float32)
        for g in (torch.zeros(9, 5), torch.full((6, 18), float("nan")),
                  torch.tensor([[finfo.tiny / 2**23, -finfo.max], [finfo.max, -0.0], [0.0, finfo.tiny]])):
            assert _uses_kernel(g)
            _, _, scalars, eh, rh = hooks.reduce_grad(g)
            zr, nf, ze, mb, want_eh, want_rh = _brute_force(g, 1)
            assert scalars.tolist() == [zr, nf, ze, mb]
            np.testing.assert_array_equal(eh.numpy(), want_eh)
            np.testing.assert_array_equal(rh.numpy(), want_rh)

    # (in, out) of five linears; a batch calls some of them, one twice, with 2-D and 3-D outputs
    SHAPES = [(8, 19), (5, 33), (6, 7), (4, 16), (3, 40)]

    def _steps(dtype, seed):
        rng = np.random.default_rng(seed)
        steps = []
        for b in range(3):
            calls = []
            for i, (_, out) in enumerate(SHAPES):
                if i == 2 and b == 1:
                    continue  # layer 2 gets no gradient in batch 1
                for _ in range(2 if i == 1 else 1):
                    lead = (int(rng.integers(1, 4)), int(rng.integers(1, 15))) if i % 2 else (int(rng.integers(1, 40)),)
                    calls.append((i, lead, special_rows_grad((*lead, out), dtype, seed=int(rng.integers(1 << 30)))))
            steps.append(calls)
        return steps

    def _groups(steps, seed: int):
        """Per step, random row groups (0, 1, 2) as long as the step's first call has rows."""
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(0, hooks.N_GROUPS + 1, (calls[0][2].numel() // calls[0][2].shape[-1],), generator=g,
                              dtype=torch.int8) for calls in steps]

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("sample", [1 << 14, 64])
    def test_collector_triton_path_equals_torch_path(dtype, sample, monkeypatch):
        monkeypatch.setattr(grad_reduce, "ELEMENT_SAMPLE", sample)
        model = LinearStack(SHAPES, dtype)
        steps = _steps(dtype, seed=int(sample))
        groups = _groups(steps, seed=int(sample))
        col = collect_with_grads(model, steps, groups)
        assert len(col._buffers) == 1 and col._element_acc is None  # the kernel did all the work
        got = col.stats()
        assert got.layers["proj.0"].group_octaves_seen().sum() == sum(len(g[g > 0]) for g in groups)
        with torch_path():
            want_col = collect_with_grads(model, steps, groups)
        assert not want_col._buffers
        want = want_col.stats()
        assert_same_stats(got, want)
        assert want.layers["proj.2"].rows[1] == 0 and want.layers["proj.2"].rows[0] > 0
        layers = want.layers.values()
        assert sum(sum(lay.nonfinite_rows) for lay in layers) > 10 and sum(sum(lay.zero_rows) for lay in layers) > 10
        assert any(np.isnan(lay.max_abs).any() for lay in layers)

    def test_failed_batch_is_discarded_and_paths_merge():
        """A batch that raises leaves nothing behind; float64 gradients (torch path) and float32 ones
        (kernel) of the same layers and batch add up, the largest magnitude winning across paths."""
        model = LinearStack([(4, 9), (4, 6)])
        g32 = torch.randn(11, 9) * (torch.arange(11) % 3 > 0).unsqueeze(1)  # finite, so 1e30 is the max
        g64 = special_rows_grad((7, 6), torch.float32, seed=2).double()
        big = torch.zeros(3, 9, dtype=torch.float64)
        big[1, 4] = 1e30

        def run():
            with hooks.GradientStatsCollector(model, target_modules="all-linear") as col:
                with pytest.raises(RuntimeError, match="boom"):
                    with col.batch():
                        col._on_grad(0, g32)
                        raise RuntimeError("boom")
                for _ in range(2):
                    with col.batch():
                        col._on_grad(0, g32)
                        col._on_grad(0, big)
                        col._on_grad(1, g64)
                        col._on_grad(1, special_rows_grad((5, 6), torch.float32, seed=3))
            return col

        col = run()
        assert len(col._buffers) == 1 and col._element_acc is not None  # both paths were used
        got = col.stats()
        with torch_path():
            want = run().stats()
        assert_same_stats(got, want)
        assert got.layers["proj.0"].max_abs == [np.float32(1e30)] * 2 and got.batches == 2

    def test_many_gradients_in_one_launch_equal_one_launch_each():
        """row_stats_many_ (fp32 and fp16 together, a slot twice, grouped and not, a sampled element histogram)
        adds exactly what row_stats_ adds gradient by gradient; odd shapes and unaligned views are not batchable."""
        from sebp_kernels._triton import rowstats

        from sebp_probe.analysis.knee import FINE_SHIFT, N_OCTAVE, OCTAVE_SHIFT

        grads = [(special_rows_grad((37, 32), torch.float32, seed=1), 0, 1, True),
                 (special_rows_grad((37, 48), torch.float16, seed=2), 1, 3, True),
                 (special_rows_grad((5, 16), torch.float32, seed=3), 2, 1, False),
                 (special_rows_grad((37, 32), torch.float32, seed=4), 0, 7, True)]
        groups = torch.randint(0, hooks.N_GROUPS + 1, (37,), generator=torch.Generator().manual_seed(0),
                               dtype=torch.int8)

        def buffers():
            return (torch.zeros(3, rowstats.N_SCALARS + hooks.N_FINE, dtype=torch.int64),
                    torch.zeros(3, hooks.N_FINE, dtype=torch.int64),
                    torch.zeros(3, hooks.N_GROUPS * N_OCTAVE, dtype=torch.int64))

        assert all(rowstats.batchable(g) for g, *_ in grads)
        many = buffers()
        rowstats.row_stats_many_(grads, many[0], many[1], FINE_SHIFT, groups, many[2], hooks.N_GROUPS, OCTAVE_SHIFT)
        one = buffers()
        for g, slot, step, grouped in grads:
            rowstats.row_stats_(g, one[0], one[1], slot, step, FINE_SHIFT, groups if grouped else None,
                                one[2] if grouped else None, hooks.N_GROUPS if grouped else 0, OCTAVE_SHIFT)
        for got, want in zip(many, one):
            assert torch.equal(got, want)
        assert one[2][:2].sum() > 0 and one[1][1].sum() > 0  # the groups and the sample were counted
        wide = torch.zeros(8, 40)
        assert not any(rowstats.batchable(g) for g in (torch.zeros(8, 19), wide, wide[:, 1:17], wide.t()))

    @pytest.mark.parametrize("arch, side, hold", [("bert", "right", None), ("llama", "left", None),
                                                  ("bert", "right", 3)])
    def test_tiny_models_triton_path_equals_torch_path(arch, side, hold, monkeypatch):
        """Real backward passes: pad rows, CLS-only rows, left-padding noise rows; ``hold`` 3: every output
        gets a hook, and the collector launches for every three gradients held, inside the backward."""
        from sebp_probe.analysis.causes import grouper

        if hold:
            monkeypatch.setattr(hooks, "HOLD_GRADS", hold)
        model = tiny_model(arch)
        batches = [padded_batch(arch, (11, 4, 7, 9, 2), side=side, seed=s) for s in range(2)]
        groups = grouper(model, None)

        def collect():
            with hooks.GradientStatsCollector(model, retain_bytes=0 if hold else None) as col:
                for b in batches:
                    model.zero_grad(set_to_none=True)
                    with col.batch(b["attention_mask"], groups(b)):
                        model(**b).loss.backward()
            return col

        col = collect()
        assert len(col._buffers) == 1 and col._element_acc is None
        got = col.stats()
        with torch_path():
            want = collect().stats()
        assert_same_stats(got, want)
        assert got.lengths and all(np.array_equal(a, b) for a, b in zip(got.lengths, want.lengths))
        assert all(lay.group_octaves_seen()[:, 0].sum() > 0 for lay in got.layers.values())  # pad rows counted
