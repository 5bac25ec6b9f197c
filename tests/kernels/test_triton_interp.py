"""Triton SEBP kernels under the interpreter (TRITON_INTERPRET=1, CPU tensors) against the torch reference.

TRITON_INTERPRET must be set before the kernels are decorated, and other tests may have imported them
already, so a normal run delegates to one pytest subprocess that has the variable set (run this file with
TRITON_INTERPRET=1 yourself to see the individual cases). Small awkward shapes, fp32 and fp16.
"""
from __future__ import annotations

import os

import pytest
import torch


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

if INTERPRET:
    from sebp_kernels import SEBPConfig, sebp_linear
    from sebp_kernels._triton import sebp_backward_triton
    from sebp_kernels._triton.backward import supported
    from sebp_kernels._triton.dw import dw_db_rows
    from sebp_kernels._triton.select import select_rows_device
    from sebp_kernels.reference import sebp_backward_torch, select_rows
    from tests.helpers import assert_close_report, assert_within_torch_error, fail_launches

    DTYPES = [torch.float32, torch.float16]
    # (M rows, out, in): none a multiple of the 16-wide interpreter tiles, plus tiny and one-row cases.
    SHAPES = [(37, 23, 19), (70, 33, 50), (5, 3, 8), (1, 17, 9), (130, 40, 24)]
    CONFIGS = {
        "exact": SEBPConfig("exact"),
        "threshold": SEBPConfig("threshold", eps=0.05),
        "topk": SEBPConfig("topk", top_n=11),
    }

    def _inputs(m, n_out, n_in, dtype, density=0.35, seed=0):
        g = torch.Generator().manual_seed(seed)
        dy = torch.randn(m, n_out, generator=g)
        dy = dy * (torch.rand(m, generator=g) < density).unsqueeze(1)
        # a spread of row scales so that threshold mode keeps some rows and drops others
        dy = dy * torch.logspace(-3, 0, m)[torch.randperm(m, generator=g)].unsqueeze(1)
        x = torch.randn(m, n_in, generator=g)
        w = torch.randn(n_out, n_in, generator=g) / n_in**0.5
        return dy.to(dtype), x.to(dtype), w.to(dtype)

    def _check_against_reference(got, dy, x, w, cfg, dtype):
        """Each product within 2x torch's own error (same dtype, same rows) against fp64 + per-dtype atol."""
        want = sebp_backward_torch(dy, x, w, cfg)
        ref = sebp_backward_torch(dy.double(), x.double(), w.double(), cfg)
        for name, g, t, r in zip(("dX", "dW", "db"), got, want, ref):
            assert g is not None and g.dtype == dtype and g.shape == t.shape, name
            assert_within_torch_error(g, r, t, dtype, name)
        return want

    @pytest.mark.parametrize("mode", ["exact", "threshold", "topk"])
    @pytest.mark.parametrize("shape", SHAPES)
    def test_select_is_a_permutation_with_reference_prefix(mode, shape):
        dy, _, _ = _inputs(*shape, torch.float32)
        cfg = CONFIGS[mode]
        perm, count = select_rows_device(dy, cfg.mode, cfg.eps, cfg.top_n, interpret=True)
        assert perm.dtype == torch.int32 and count.shape == (1,)
        k = int(count.item())
        assert sorted(perm.tolist()) == list(range(shape[0]))
        assert perm[:k].long().tolist() == select_rows(dy, cfg).tolist()

    # exact: fp32 on every shape, fp16 (its own GEMM path, ieee off) on the two with tails in every dimension
    # and the most row tiles: the masks and tails do not depend on the dtype. The mode changes only which rows
    # the selection hands the kernels (every mode on every shape: test_select_is_a_permutation_...), so
    # threshold and topk run once per dtype, on a shape with tails in every dimension.
    BACKWARD_CASES = [(torch.float32, s, "exact") for s in SHAPES] + [
        (torch.float16, s, "exact") for s in SHAPES if s in ((37, 23, 19), (130, 40, 24))] + [
        (dtype, shape, mode) for mode in ("threshold", "topk")
        for dtype, shape in ((torch.float32, (37, 23, 19)), (torch.float16, (130, 40, 24)))]

    @pytest.mark.parametrize("dtype,shape,mode", BACKWARD_CASES)
    def test_backward_matches_reference(dtype, mode, shape):
        dy, x, w = _inputs(*shape, dtype, seed=shape[0])
        cfg = CONFIGS[mode]
        got = sebp_backward_triton(dy, x, w, cfg)
        _check_against_reference(got, dy, x, w, cfg, dtype)
        inactive = torch.ones(shape[0], dtype=torch.bool)
        inactive[select_rows(dy, cfg)] = False
        assert (got[0][inactive] == 0).all(), "dX must be exactly zero on inactive rows"

    # fp32 on the shape with the most K pieces (13); fp16 on the one whose K (97) ends in a one-column tail (the
    # masks of the tail do not depend on the dtype)
    @pytest.mark.parametrize("dtype,shape", [(torch.float32, (70, 200, 33)), (torch.float16, (130, 97, 40))])
    def test_dx_k_splits_match_reference_and_are_deterministic(shape, dtype):
        """With many SMs to fill and few active row tiles, dX splits over K (here up to 12 pieces of 16)."""
        from sebp_kernels._triton.dx import dx_rows
        from sebp_kernels._triton.grads import grads_rows

        dy, x, w = _inputs(*shape, dtype, density=0.2, seed=3)
        cfg = CONFIGS["exact"]
        perm, count = select_rows_device(dy, "exact", interpret=True)
        ieee = dtype == torch.float32
        split = dx_rows(dy, w, perm, count, interpret=True, ieee=ieee, n_sm=64)
        want = sebp_backward_torch(dy, x, w, cfg)[0]
        ref = sebp_backward_torch(dy.double(), x.double(), w.double(), cfg)[0]
        assert_within_torch_error(split, ref, want, dtype, "dX split")
        assert torch.equal(split, dx_rows(dy, w, perm, count, interpret=True, ieee=ieee, n_sm=64))
        fused = grads_rows(dy, x, w, perm, count, True, True, True, ieee, 64, interpret=True, dw_split=1)
        dw_tiles = -(-shape[1] // 16) * -(-shape[2] // 16)  # the fused launch leaves dX the SMs dW does not use
        assert torch.equal(fused[0], dx_rows(dy, w, perm, count, interpret=True, ieee=ieee, n_sm=64, busy=dw_tiles))

    @pytest.mark.parametrize("split", [1, 2, 3, 5])
    def test_dw_row_splits_agree_and_are_deterministic(split):
        from sebp_kernels._triton.dw import _TICKETS

        dy, x, _ = _inputs(150, 21, 18, torch.float32, density=0.8, seed=3)
        perm, count = select_rows_device(dy, "exact", interpret=True)
        dw1, db1 = dw_db_rows(dy, x, perm, count, True, 1, interpret=True)
        dw, db = dw_db_rows(dy, x, perm, count, True, split, interpret=True)
        assert_close_report(dw, dw1, atol=1e-5, rtol=1e-5, name="dW")
        assert_close_report(db, db1, atol=1e-5, rtol=1e-5, name="db")
        # the last split to arrive resets its tile's counter, so the next launch starts from zero
        assert all(int(t.abs().sum()) == 0 for t in _TICKETS.values())
        again = dw_db_rows(dy, x, perm, count, True, split, interpret=True)
        assert torch.equal(again[0], dw) and torch.equal(again[1], db)
        # fewer active rows than one split's minimum: a single split writes dW directly
        few = dy.clone()
        few[8:] = 0
        perm, count = select_rows_device(few, "exact", interpret=True)
        got = dw_db_rows(few, x, perm, count, True, split, interpret=True)
        want = dw_db_rows(few, x, perm, count, True, 1, interpret=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    @pytest.mark.parametrize("split", [1, 3])
    @pytest.mark.parametrize("runs", [[(7, 68)], [(3, 40), (90, 141)], [(0, 150)], [(149, 150)]])
    def test_dw_over_runs_of_consecutive_rows(runs, split):
        # fp16 takes the loop where a split's range of consecutive rows needs no index loads (with split 3
        # and two runs one range straddles them and gathers); 16-row blocks plus tails
        dy, x, _ = _inputs(150, 24, 40, torch.float16, density=1.1, seed=4)
        mask = torch.zeros(150, dtype=torch.bool)
        for a, b in runs:
            mask[a:b] = True
        dy = dy * mask.unsqueeze(1).to(dy.dtype)
        perm, count = select_rows_device(dy, "exact", interpret=True)
        dw, _ = dw_db_rows(dy, x, perm, count, False, split, interpret=True, ieee=False)
        rows = mask.nonzero().squeeze(1)
        ref = dy[rows].double().t() @ x[rows].double()
        want = (dy[rows].float().t() @ x[rows].float()).to(torch.float16)
        assert_within_torch_error(dw, ref, want, torch.float16, "dW")

    @pytest.mark.parametrize("mode", ["exact", "threshold"])
    def test_one_run_of_rows_with_noise_after_it(mode):
        # fp16: the active rows are one run, which the dW loop over consecutive rows must stop at: the rows
        # after it hold noise below eps (threshold) and NaN in X
        dy, x, w = _inputs(90, 32, 40, torch.float16, density=1.1, seed=8)
        dy[61:] = 1e-4 if mode == "threshold" else 0.0
        dy[:11] = 0.0 if mode == "exact" else 1e-4
        x[61:] = float("nan")
        cfg = CONFIGS[mode]
        got = sebp_backward_triton(dy, x, w, cfg)
        want = sebp_backward_torch(dy, x, w, cfg)
        ref = sebp_backward_torch(dy.double(), x.double(), w.double(), cfg)
        for name, g, t, r in zip(("dX", "dW", "db"), got, want, ref):
            assert torch.isfinite(g).all(), name
            assert_within_torch_error(g, r, t, torch.float16, name)

    @pytest.mark.parametrize("fill", ["zeros", "all_active"])
    @pytest.mark.parametrize("mode", ["exact", "threshold"])
    def test_no_active_rows_and_all_active(fill, mode):
        _, x, w = _inputs(45, 20, 17, torch.float32)
        dy = torch.zeros(45, 20) if fill == "zeros" else torch.randn(45, 20) + 3.0
        cfg = CONFIGS[mode]
        got = sebp_backward_triton(dy, x, w, cfg)
        want = sebp_backward_torch(dy, x, w, cfg)
        for name, g, t in zip(("dX", "dW", "db"), got, want):
            assert_close_report(g, t, atol=1e-5, rtol=1e-5, name=name)

    @pytest.mark.parametrize("density,shape", [(0.0, (70, 33, 50)), (0.05, (300, 20, 40)), (1.1, (70, 33, 50))])
    def test_every_row_of_dx_is_written(monkeypatch, density, shape):
        """dX starts as torch.empty: a row the kernels skipped would keep the allocator's contents, made NaN
        here. A low density gives each computing program many zero tiles to write (and row tiles that mix
        active and inactive rows: the shape with the most row tiles), zero density none, every row active no
        zero tile (a shape with tails in every dimension)."""
        from sebp_kernels._triton.dx import dx_rows

        real = torch.empty

        def nan_empty(*args, **kwargs):
            t = real(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t

        monkeypatch.setattr(torch, "empty", nan_empty)
        cfg = CONFIGS["exact"]
        dy, x, w = _inputs(*shape, torch.float32, density=density)
        want = sebp_backward_torch(dy, x, w, cfg)[0]
        fused = sebp_backward_triton(dy, x, w, cfg)[0]
        alone = sebp_backward_triton(dy, None, w, cfg, need_dw=False, need_db=False)[0]
        perm, count = select_rows_device(dy, "exact", interpret=True)
        kernel = dx_rows(dy, w, perm, count, interpret=True)
        for name, got in (("fused", fused), ("dX only", alone), ("dx_rows", kernel)):
            assert not torch.isnan(got).any(), (shape, name)
            assert_close_report(got, want, atol=1e-5, rtol=1e-5, name=name)

    @pytest.mark.parametrize("mode", ["exact", "threshold", "topk"])
    @pytest.mark.parametrize("bad", [float("nan"), float("inf")])
    def test_nonfinite_rows_are_active(mode, bad):
        dy, x, w = _inputs(40, 12, 10, torch.float32, density=0.2)
        dy[7] = 0
        dy[7, 4] = bad
        cfg = {"topk": SEBPConfig("topk", top_n=2), "threshold": SEBPConfig("threshold", eps=10.0)}.get(
            mode, CONFIGS["exact"])
        perm, count = select_rows_device(dy, cfg.mode, cfg.eps, cfg.top_n, interpret=True)
        assert 7 in perm[: int(count.item())].tolist()
        dx, dw, db = sebp_backward_triton(dy, x, w, cfg)
        assert not torch.isfinite(dx[7]).all() and not torch.isfinite(dw).all()

    @pytest.mark.parametrize("mode", ["exact", "threshold"])
    def test_rows_active_only_past_the_first_column_block(mode):
        """The flags pass reads one column block of every row first, then the rest of the rows still inactive
        (16 columns a block under the interpreter): a value in a later block, a NaN there, and a row next to
        active ones in the same block of rows must all count."""
        dy = torch.zeros(70, 53)
        dy[::3] = torch.randn(24, 53)  # active from the first columns
        dy[1, 40] = 2.0  # the only non-zero of row 1, third column block, beside active row 0
        dy[5, 52] = float("nan")  # last column
        dy[8, 17] = 0.5  # second block; below eps in threshold mode
        dy[31, 35] = -3.0
        cfg = SEBPConfig("threshold", eps=1.0) if mode == "threshold" else CONFIGS["exact"]
        perm, count = select_rows_device(dy, cfg.mode, cfg.eps, interpret=True)
        want = select_rows(dy, cfg).tolist()
        assert {1, 5, 31} <= set(want) and (8 in want) == (mode == "exact")
        assert perm[: int(count.item())].tolist() == want
        assert sorted(perm.tolist()) == list(range(70))

    def test_fused_kernel_moves_to_smaller_tiles_when_a_launch_lacks_resources(monkeypatch):
        """A GPU with less shared memory than the tiles need fails the first launch with OutOfResources: the
        backward retries with the next setting, keeps it for the device and warns once; past the last it
        raises. (Under the interpreter every setting is the same small one, so the results are equal.)"""
        from triton.runtime.errors import OutOfResources

        from sebp_kernels._triton import grads

        dy, x, w = _inputs(70, 33, 50, torch.float32, seed=5)
        want = sebp_backward_triton(dy, x, w, CONFIGS["exact"])
        failing = {0}
        calls = fail_launches(monkeypatch, grads._grads, failing)
        monkeypatch.setattr(grads, "_LEVEL", {})
        with pytest.warns(UserWarning, match="smaller GEMM tiles"):
            got = sebp_backward_triton(dy, x, w, CONFIGS["exact"])
        assert grads._LEVEL == {None: 1} and len(calls) == 2 and calls[0][0] != calls[1][0]
        assert all(torch.equal(g, t) for g, t in zip(got, want))
        sebp_backward_triton(dy, x, w, CONFIGS["exact"])  # starts at the setting that fitted
        assert len(calls) == 3 and calls[2][0] == calls[1][0]
        monkeypatch.setattr(grads, "_LEVEL", {})
        failing.update(range(100))
        with pytest.raises(OutOfResources), pytest.warns(UserWarning):
            sebp_backward_triton(dy, x, w, CONFIGS["exact"])

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_inf_row_active_when_eps_is_beyond_the_dtype_range(dtype):
        dy = torch.zeros(9, 5, dtype=dtype)
        dy[3, 2] = float("inf")
        dy[6, 0] = 1.0
        cfg = SEBPConfig("threshold", eps=1e39)
        perm, count = select_rows_device(dy, cfg.mode, cfg.eps, interpret=True)
        assert perm[: int(count.item())].tolist() == select_rows(dy, cfg).tolist() == [3]

    def test_db_only_ignores_inactive_inf_rows():
        dy, _, w = _inputs(20, 6, 5, torch.float32)
        dy[2], dy[5], dy[11] = float("inf"), float("inf"), float("inf")  # three Inf rows, N = 2: one is inactive
        cfg = SEBPConfig("topk", top_n=2)
        perm, count = select_rows_device(dy, cfg.mode, cfg.eps, cfg.top_n, interpret=True)
        active = perm[: int(count.item())]
        assert sorted(active.tolist()) != [2, 5, 11] and set(active.tolist()) <= {2, 5, 11}
        _, _, db = sebp_backward_triton(dy, None, w, cfg, need_dx=False, need_dw=False, need_db=True)
        want = dy[active].sum(0)  # by the definition: active rows only, no 0 * Inf from the inactive one
        assert torch.equal(db, want), (db, want)

    def test_threshold_compares_in_the_input_dtype():
        # 0.10002 rounds up to fp16 0.1000366: a row whose max is exactly that value is not above eps in fp16
        # (how torch and the reference compare), though it is above the fp32 number 0.10002.
        eps = 0.10002
        at_eps = torch.tensor(eps, dtype=torch.float16)
        assert float(at_eps) > eps
        dy = torch.full((6, 5), 0.01, dtype=torch.float16)
        dy[2, 3] = at_eps
        dy[4, 1] = -0.5
        cfg = SEBPConfig("threshold", eps=eps)
        perm, count = select_rows_device(dy, cfg.mode, cfg.eps, interpret=True)
        assert perm[: int(count.item())].tolist() == select_rows(dy, cfg).tolist() == [4]

    @pytest.mark.parametrize("layout", ["transposed", "expanded"])
    def test_non_contiguous_dy(layout):
        _, x, w = _inputs(33, 14, 11, torch.float32)
        if layout == "transposed":
            dy = torch.randn(14, 33).t()
            dy[::3] = 0
        else:  # what y.sum().backward() hands over: one value broadcast with zero strides
            dy = torch.ones(1, 1).expand(33, 14)
        assert not dy.is_contiguous()
        got = sebp_backward_triton(dy, x, w, CONFIGS["exact"])
        _check_against_reference(got, dy.contiguous(), x, w, CONFIGS["exact"], torch.float32)

    @pytest.mark.parametrize("need", [(True, False, False), (False, True, False), (False, False, True),
                                      (False, True, True), (True, False, True)])
    def test_only_the_needed_products(need):
        dy, x, w = _inputs(29, 13, 9, torch.float32)
        cfg = CONFIGS["exact"]
        got = sebp_backward_triton(dy, x if need[1] else None, w, cfg, *need)
        want = sebp_backward_torch(dy, x, w, cfg)
        for name, g, t, n in zip(("dX", "dW", "db"), got, want, need):
            if not n:
                assert g is None, name
            else:
                assert_close_report(g, t, atol=1e-5, rtol=1e-5, name=name)

    def test_unsupported_inputs_fall_back_to_torch():
        dy, x, w = _inputs(12, 5, 4, torch.float64)
        assert not supported(dy, x, w)
        got = sebp_backward_triton(dy, x, w, CONFIGS["exact"])
        want = sebp_backward_torch(dy, x, w, CONFIGS["exact"])
        for g, t in zip(got, want):
            assert torch.equal(g, t)

    @pytest.mark.parametrize("mode", ["exact", "topk"])
    def test_autograd_through_backend_triton(mode):
        dy, x, w = _inputs(24, 10, 7, torch.float32)
        b = torch.randn(10)
        cfg = SEBPConfig(mode, top_n=5 if mode == "topk" else None, backend="triton")
        leaves = [t.clone().requires_grad_() for t in (x.view(4, 6, 7), w, b)]
        sebp_linear(*leaves, config=cfg).backward(dy.view(4, 6, 10))
        want = sebp_backward_torch(dy, x, w, SEBPConfig(mode, top_n=cfg.top_n))
        assert_close_report(leaves[0].grad.view(24, 7), want[0], atol=1e-5, rtol=1e-5, name="dX")
        assert_close_report(leaves[1].grad, want[1], atol=1e-5, rtol=1e-5, name="dW")
        assert_close_report(leaves[2].grad, want[2], atol=1e-5, rtol=1e-5, name="db")

    def _spy_select(monkeypatch):
        """Count the selection passes of the Triton backward (each SEBP or probe backward makes one)."""
        import sebp_kernels._triton.backward as backward

        calls = []
        real = backward.select_rows_device

        def spy(*a, **k):
            calls.append(a[1])
            return real(*a, **k)

        monkeypatch.setattr(backward, "select_rows_device", spy)
        return calls

    def test_adaptive_takes_dense_path_once_rows_are_dense(monkeypatch):
        """Exact mode with a RowDensity: the first backward measures (SEBP path), later ones with all rows
        active take the dense GEMMs, every PROBE_EVERY-th re-measures; the gradients match the reference
        throughout, and dX stays exactly zero on zero rows when density drops again."""
        from sebp_kernels import density
        from sebp_kernels.density import RowDensity

        calls = _spy_select(monkeypatch)
        state, cfg = RowDensity(), CONFIGS["exact"]
        dy, x, w = _inputs(40, 12, 9, torch.float32, density=1.1)  # every row active
        for _ in range(density.PROBE_EVERY + 2):
            got = sebp_backward_triton(dy, x, w, cfg, state=state)
            _check_against_reference(got, dy, x, w, cfg, torch.float32)
        assert state.density == 1.0
        # the first call measured; then dense, with one probe after PROBE_EVERY - 1 dense calls
        assert len(calls) == 2, calls
        # rows go sparse: the next probe sees it, and the SEBP path comes back
        sparse = dy.clone()
        sparse[::2] = 0
        for _ in range(density.PROBE_EVERY):
            got = sebp_backward_triton(sparse, x, w, cfg, state=state)
            _check_against_reference(got, sparse, x, w, cfg, torch.float32)
            assert (got[0][::2] == 0).all()
        assert state.density == 0.5
        n = len(calls)
        sebp_backward_triton(sparse, x, w, cfg, state=state)
        assert len(calls) == n + 1, "back on the SEBP path, every backward selects rows"

    @pytest.mark.parametrize("mode", ["threshold", "topk"])
    def test_adaptive_never_dense_outside_exact_mode(monkeypatch, mode):
        """Threshold and topk skip rows that are not zero: only the SEBP path computes their gradients."""
        from sebp_kernels.density import RowDensity

        calls = _spy_select(monkeypatch)
        state, cfg = RowDensity(), CONFIGS[mode]
        dy, x, w = _inputs(40, 12, 9, torch.float32, density=1.1)
        for _ in range(5):
            got = sebp_backward_triton(dy, x, w, cfg, state=state)
            _check_against_reference(got, dy, x, w, cfg, torch.float32)
        assert len(calls) == 5 and state.density is None

    def test_sebp_linear_module_keeps_its_density(monkeypatch):
        """SEBPLinear carries a RowDensity across steps (dense after a dense step); copies start afresh."""
        import copy

        from sebp_kernels import SEBPLinear

        calls = _spy_select(monkeypatch)
        torch.manual_seed(0)
        lin = SEBPLinear(9, 12, config=SEBPConfig("exact", backend="triton"))
        x = torch.randn(5, 8, 9)
        for _ in range(3):
            lin.zero_grad()
            lin(x).square().sum().backward()
        ref = torch.nn.Linear(9, 12)
        ref.load_state_dict(lin.state_dict())
        ref(x).square().sum().backward()
        assert len(calls) == 1 and lin._sebp_density.density == 1.0
        for a, b in ((lin.weight.grad, ref.weight.grad), (lin.bias.grad, ref.bias.grad)):
            assert_close_report(a, b, atol=1e-5, rtol=1e-5, name="grad")
        twin = copy.deepcopy(lin)
        assert twin._sebp_density.density is None and twin._sebp_density is not lin._sebp_density

    def test_compiled_model_runs_the_kernels_through_the_ops_with_dynamic_shapes():
        """torch.compile (aot_eager) of a tiny Llama with SEBP linears, norms and activations on the Triton path
        (interpreter): batches of two shapes (the second recompiled with dynamic shapes: the ops' fake shapes hold
        symbols), each with eager SEBP's loss and gradients, 0 graph breaks, and the activations' rows taken. (One
        dynamic graph run at several shapes: test_pad_rows's compiled layers, three, and whole model, two.)"""
        import torch._dynamo as dynamo

        from sebp_probe import patch_activations, patch_model, patch_norms
        from tests.tiny_models import padded_batch, tiny_model

        model = tiny_model("llama").eval()
        patch_model(model, SEBPConfig("exact", backend="triton"))  # "auto" takes the torch path on a CPU
        patch_norms(model, SEBPConfig("exact", backend="triton"))
        patch_activations(model)
        hints = [m._sebp_act_hint for m in model.modules() if "_sebp_act_hint" in vars(m)]

        def grads(fn, batch):
            model.zero_grad(set_to_none=True)
            loss = fn(**batch).loss
            loss.backward()
            return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

        dynamo.reset()
        dynamo.utils.counters.clear()
        try:
            compiled = torch.compile(model, backend="aot_eager")
            for lengths in ((11, 4, 7), (9, 3, 5, 6)):
                batch = padded_batch("llama", lengths=lengths)
                taken = sum(h.taken for h in hints)
                loss_c, g_c = grads(compiled, batch)
                assert sum(h.taken for h in hints) - taken == 2 * len(hints)
                loss_e, g_e = grads(model, batch)
                assert_close_report(loss_c, loss_e, atol=1e-6, name="loss")
                for k in g_e:
                    assert_close_report(g_c[k], g_e[k], atol=1e-6, rtol=1e-5, name=k)
            assert sum(dynamo.utils.counters["graph_break"].values()) == 0
            assert dynamo.utils.counters["stats"]["unique_graphs"] >= 2
        finally:
            dynamo.reset()
