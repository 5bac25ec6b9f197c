"""Sampled mode's variance rule (``budget="auto"``, sebp_kernels.sample_variance) and its exact-gradient guard
(sebp_probe.train.sample_guard): the cutoff meets its variance target, auto is unbiased, the guard logs cosine 1
at budget 1 and gives a starved layer more rows."""
from __future__ import annotations

import pytest
import torch

from sebp_kernels import SEBPConfig, SEBPLinear
from sebp_kernels.sample_variance import sampling_variance, sgd_variance, solve_cutoff_for_variance
from sebp_kernels.sampling import SampleState, keep_probabilities, sampled_backward_torch
from sebp_probe.train.sample_guard import SampleGuard, guard_summary
from tests.helpers import dense_grads
from tests.kernels.test_sampled import _skewed


def test_cutoff_meets_the_variance_target():
    gen = torch.Generator().manual_seed(0)
    w = torch.rand(800, generator=gen) ** 4
    w[:80] = 0
    xn2 = torch.rand(800, generator=gen) + 0.5
    total = (w * w * xn2).sum()
    for share in (0.01, 0.025, 0.3):
        target = share * total
        c = solve_cutoff_for_variance(w, xn2, target)
        q = keep_probabilities(w, c)
        v = sampling_variance(w, xn2, q)
        assert v <= target and v > 0.95 * target, (share, float(v), float(target))
        # a larger target keeps fewer rows: the smallest keep ratio under the target
    shares = [float(keep_probabilities(w, solve_cutoff_for_variance(w, xn2, s * total))[80:].mean())
              for s in (0.01, 0.1, 1.0)]
    assert shares[0] > shares[1] > shares[2]
    assert float(solve_cutoff_for_variance(w, xn2, torch.tensor(0.0))) == 0.0


def test_sgd_variance_is_the_rows_spread():
    """sum ||g_i||² - ||G||² / n: for n equal rows (no spread) it is 0; for the rows' own variance it is the
    variance of a sum of n independent draws estimated from them."""
    w, xn2 = torch.ones(10), torch.full((10,), 4.0)
    assert float(sgd_variance(w, xn2, torch.tensor(10.0 ** 2 * 4))) == 0.0
    assert float(sgd_variance(w, xn2, torch.tensor(0.0))) == 40.0


@pytest.mark.slow
def test_auto_budget_is_unbiased():
    """Mean of dW and db over 2000 backwards of one dY under budget auto (the cutoff moves with each sampled dW)
    against the dense gradient: the mean's error is a martingale, its variance the sum of each draw's own
    (q fixed before each draw), so z-scores stay within their normal range."""
    x, w, b, dy = _skewed()
    _, dw_ref, db_ref = dense_grads(x, w, b, dy)
    cfg, state = SEBPConfig("sampled", budget="auto", variance_tau=0.5, seed=3), SampleState(9)
    norms, active = torch.linalg.vector_norm(dy.float(), dim=1), dy.any(1)
    sums = {"dw": torch.zeros_like(dw_ref), "db": torch.zeros_like(db_ref)}
    var = {"dw": torch.zeros_like(dw_ref), "db": torch.zeros_like(db_ref)}
    draws = 2000
    for _ in range(draws):
        q = keep_probabilities(norms, state.tau) if state.tau is not None else torch.ones_like(norms)
        odds = torch.where(active, (1 - q.double()) / q.double(), torch.zeros_like(q.double()))
        var["dw"] += (dy ** 2).t() @ (x ** 2 * odds[:, None])
        var["db"] += (dy ** 2 * odds[:, None]).sum(0)
        _, dw, db = sampled_backward_torch(dy, x, w, cfg, state)
        sums["dw"] += dw
        sums["db"] += db
    c = state.counts()
    assert c["kept"] < 0.8 * c["nonzero"], c  # it did sample
    zs = []
    for name, ref in (("dw", dw_ref), ("db", db_ref)):
        noisy = var[name] > 0
        assert torch.allclose((sums[name] / draws)[~noisy], ref[~noisy], atol=1e-12)
        zs.append(((sums[name] - draws * ref) / var[name].sqrt())[noisy])
    z = torch.cat(zs)
    assert z.abs().max() < 4.5 and 0.5 < (z ** 2).mean() < 1.8, (z.abs().max().item(), (z ** 2).mean().item())


def test_auto_keeps_the_variance_under_its_budget_and_skips_rows():
    """On a fixed heavy-tailed distribution of dY, after the first backwards: the measured relative variance of
    dW (the guard's numbers) averages at most the budget, and most rows are skipped."""
    m, n, k = 1024, 16, 24
    gen = torch.Generator().manual_seed(2)
    x, wt = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    cfg, state = SEBPConfig("sampled", budget="auto"), SampleState(1)
    ratios = []
    for t in range(40):
        dy = torch.randn(m, n, generator=gen) * torch.rand(m, 1, generator=gen) ** 6
        state.armed = t >= 10
        sampled_backward_torch(dy, x, wt, cfg, state)
        if state.guard is not None:
            _, _, rel_var, rel_budget, _, _ = state.guard.tolist()
            ratios.append(rel_var / rel_budget)
            state.guard = None
    assert 0.3 < sum(ratios) / len(ratios) < 1.3, ratios
    c = state.counts()
    assert c["kept"] < 0.6 * c["nonzero"], c


class _Two(torch.nn.Module):
    def __init__(self, starved: SEBPConfig, fed: SEBPConfig):
        super().__init__()
        torch.manual_seed(0)
        self.starved = SEBPLinear.from_linear(torch.nn.Linear(16, 12), starved, sample_key=1)
        self.fed = SEBPLinear.from_linear(torch.nn.Linear(16, 12), fed, sample_key=2)

    def forward(self, x):
        return self.starved(x).pow(2).sum() + self.fed(x).pow(2).sum()


def _steps(model, guard, steps):
    gen = torch.Generator().manual_seed(1)
    recs = []
    for step in range(1, steps + 1):
        x = torch.randn(256, 16, generator=gen)  # rows of similar norms: sampling them is costly in variance
        with guard.step(step):
            model(x).backward()
        rec = guard.take(step)
        if rec is not None:
            recs.append(rec)
    return recs


def test_guard_logs_cosine_one_at_budget_one():
    model = _Two(SEBPConfig("sampled", budget=1.0), SEBPConfig("sampled", budget=1.0))
    recs = _steps(model, SampleGuard(2, 1, model), 6)
    assert [r["step"] for r in recs] == [2, 4, 6]
    for r in recs:
        assert set(r["layers"]) == {"starved", "fed"}
        for v in r["layers"].values():
            assert v["cosine"] == pytest.approx(1.0, abs=1e-6) and v["rel_error"] == 0.0 and not v["over"]
    s = guard_summary(recs, 2)
    assert s["checks"] == 3 and s["raised"] == {} and s["min_cosine"] == pytest.approx(1.0, abs=1e-6)


def test_guard_gives_a_starved_layer_more_rows():
    """A layer starved on purpose (2% of its rows) is over its variance budget at the guard's checks and its
    share is raised, check after check; a layer at budget 1 is never raised."""
    model = _Two(SEBPConfig("sampled", budget=0.02), SEBPConfig("sampled", budget=1.0))
    recs = _steps(model, SampleGuard(1, 0, model), 4)
    assert all(r["layers"]["starved"]["over"] for r in recs[:2])
    assert not any(r["layers"]["fed"]["over"] for r in recs)
    raised = [r["layers"]["starved"]["raised_to"]["share"] for r in recs if r["layers"]["starved"]["over"]]
    assert raised[:2] == pytest.approx([0.03, 0.045])
    state = model.starved._sebp_sampler
    assert state.share == pytest.approx(raised[-1])
    assert state.state_dict()["share"] == pytest.approx(raised[-1])  # a resumed run keeps the raise
    assert recs[-1]["layers"]["starved"]["kept_share"] > recs[0]["layers"]["starved"]["kept_share"]
    assert guard_summary(recs, 1)["raised"] == {"starved": len(raised)}


def test_guard_halves_the_variance_budget_of_a_starved_auto_layer():
    """Under budget auto a layer is starved when its cutoff, solved from the backward before, no longer fits
    its gradient (here: set far too high before the first step): the guard finds it over its budget, halves
    its variance budget and solves the cutoff afresh, so the next steps keep more of its rows."""
    model = _Two(SEBPConfig("sampled", budget="auto"), SEBPConfig("sampled", budget="auto"))
    model.starved._sebp_sampler.tau = torch.tensor(1e4)
    recs = _steps(model, SampleGuard(1, 0, model), 3)
    first = recs[0]["layers"]["starved"]
    assert first["over"] and first["raised_to"] == {"var_tau": pytest.approx(0.0125)} and first["kept_share"] < 0.2
    assert not recs[0]["layers"]["fed"]["over"]
    assert model.starved._sebp_sampler.var_tau == pytest.approx(0.0125 / 2 ** (len(
        [r for r in recs if r["layers"]["starved"]["over"]]) - 1))
    assert recs[1]["layers"]["starved"]["kept_share"] > 0.5
