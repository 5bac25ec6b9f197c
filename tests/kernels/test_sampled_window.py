"""Sampled mode's capacity (sebp_kernels.sampling.window, SampleState.capacity): the Triton path gathers the kept
rows into ``cap`` slots; a backward that keeps more takes a random window of them, scaled by kept / cap. The
gradient stays unbiased (tested here on the torch reference; the kernel's window is the reference's bit for bit,
tests/kernels/test_sampled_triton.py)."""
from __future__ import annotations

import pytest
import torch

from sebp_kernels import SEBPConfig
from sebp_kernels.sampling import CAP_ROUND, SampleState, sampled_backward_torch, window, window_offset
from tests.helpers import dense_grads


def _skewed(m=96, n=8, k=12):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(m, k, generator=g, dtype=torch.float64)
    w = torch.randn(n, k, generator=g, dtype=torch.float64)
    dy = torch.randn(m, n, generator=g, dtype=torch.float64) * (torch.rand(m, 1, generator=g,
                                                                            dtype=torch.float64) ** 2 + 0.05)
    dy[::5] = 0
    return x, w, dy


def test_rows_that_fit_are_all_kept_unscaled():
    rows = torch.tensor([1, 4, 9])
    got, factor = window(rows, 3, 0, 1, 2)
    assert got is rows and factor is None


def test_a_window_is_cap_consecutive_kept_rows_from_a_spread_offset():
    rows = torch.arange(0, 40, 2)  # 20 kept rows
    got, factor = window(rows, 6, 1, 2, 3)
    off = window_offset(1, 2, 3, 20)
    assert got.tolist() == [int(rows[(off + i) % 20]) for i in range(6)] and float(factor) == float(torch.tensor(20.0) / 6)  # fp32, as the kernel
    offs = torch.tensor([window_offset(0, 5, s, 7) for s in range(7000)])
    assert offs.min() == 0 and offs.max() == 6
    assert (torch.bincount(offs, minlength=7).double() / 1000 - 1).abs().max() < 0.12  # about 1000 each


@pytest.mark.parametrize("sample_dx", [False, True])
def test_mean_over_draws_with_a_small_capacity_is_the_dense_gradient(sample_dx, monkeypatch):
    """Every backward keeps about 23 rows into 10 slots: over 1500 draws the mean sampled dW, db (and dX) is the
    dense gradient within the draws' standard error; the same windows without the kept / cap factor are not."""
    x, w, dy = _skewed()
    dx_ref, dw_ref, db_ref = dense_grads(x, w, torch.zeros(w.shape[0], dtype=torch.float64), dy)
    refs = {"dx": dx_ref, "dw": dw_ref, "db": db_ref}

    def draws(n=1500):
        cfg = SEBPConfig("sampled", budget=0.3, sample_dx=sample_dx, seed=1)
        state = SampleState(layer_key=4)
        out = [sampled_backward_torch(dy, x, w, cfg, state, cap=10) for _ in range(n)]
        c = state.counts()
        assert c["kept"] / c["rows"] > 0.2, c  # far more kept than the 10 slots
        return {name: torch.stack([o[i] for o in out]) for i, name in enumerate(("dx", "dw", "db"))}

    def worst_z(s):
        zs = []
        for name in ("dx", "dw", "db") if sample_dx else ("dw", "db"):
            sd = s[name].std(0)
            noisy = sd > 1e-12
            zs.append(((s[name].mean(0) - refs[name]) / (sd / s[name].shape[0] ** 0.5))[noisy])
        return torch.cat(zs)

    z = worst_z(draws())
    assert z.abs().max() < 4.5, z.abs().max().item()
    assert 0.5 < (z ** 2).mean() < 1.8, (z ** 2).mean().item()
    import sebp_kernels.sampling as sampling
    monkeypatch.setattr(sampling, "window", lambda rows, cap, *a: (window(rows, cap, *a)[0], None))
    assert worst_z(draws(400)).abs().max() > 10  # a window without its factor misses the gradient


def test_capacity_follows_the_budget_then_the_kept_share_read_back():
    state, fixed, auto = SampleState(1), SEBPConfig("sampled", budget=0.3), SEBPConfig("sampled", budget="auto")
    cap = state.capacity(1000, fixed)
    assert cap % CAP_ROUND == 0 and 1000 * 0.3 * 1.1 + CAP_ROUND <= cap < 1000 * 0.3 * 1.1 + 2 * CAP_ROUND
    assert state.capacity(100, fixed) == 100  # never more than the rows
    assert state.capacity(1000, auto) is None  # auto: the fused kernel until a share was read
    state.kept.observe(torch.tensor([50], dtype=torch.int32), 1000)  # a CPU count is read at once
    assert state.kept.share == 0.05 and state.capacity(1000, auto) == 2 * CAP_ROUND
    state.kept.observe(torch.tensor([900], dtype=torch.int32), 1000)  # not every backward is read
    assert state.kept.share == 0.05
