"""ReSprop's GPU path (the kept rows handed to the Triton SEBP backward as a permutation and a device-side
count) under the Triton interpreter, against the direct reference of the approximation.

TRITON_INTERPRET must be set before the kernels are decorated, so a normal run delegates to one pytest
subprocess that has it set (as tests/kernels/test_triton_interp.py does). Small awkward shapes, fp32.
"""
from __future__ import annotations

import os

import pytest
import torch


if os.environ.get("TRITON_INTERPRET") == "1":
    from sebp_kernels import resprop_grads
    from tests.helpers import assert_close_report
    from tests.kernels.test_resprop import _inputs, reference

    @pytest.mark.parametrize("b,t,n_in,n_out", [(3, 7, 19, 23), (2, 20, 33, 17)])
    @pytest.mark.parametrize("reuse", [0.5, 0.9, 1.0])
    def test_triton_path_matches_reference(b, t, n_in, n_out, reuse, monkeypatch):
        x, w, _, dy = _inputs(b, t, n_in, n_out)
        dy[b - 1, 0, 2] = float("nan")
        p = torch.randn(t - 2, n_out, generator=torch.Generator().manual_seed(1))

        def refuse(*args, **kw):
            raise AssertionError("the torch row-gather ran instead of the Triton kernels")

        monkeypatch.setattr("sebp_kernels.resprop.backward_over_rows", refuse)
        dx, dw, db, _ = resprop_grads(dy, x, w, p, reuse, backend="triton")
        want_dx, want_dw, _ = reference(dy, x, w, p, reuse)
        finite = torch.isfinite(dy).all(-1)
        assert not torch.isfinite(dx[~finite]).any() and not torch.isfinite(dw).all()
        assert_close_report(dx[finite], want_dx[finite], atol=1e-4, name="dX")
        ok = torch.isfinite(want_dw)
        assert_close_report(dw[ok], want_dw[ok], atol=1e-4, name="dW")
