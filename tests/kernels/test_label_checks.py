"""sebp_kernels.label_checks: the labelled-rows head's label checks held on the device inside ``deferred()``
and read where the caller waits: the same rows and gradients as the eager checks, the same one-line errors,
raised at ``check()`` (or the block's end), and nothing out of range reaching a kernel meanwhile."""
from __future__ import annotations

import pytest
import torch

from sebp_kernels import label_checks
from sebp_kernels.linear_ce import labelled_rows, linear_cross_entropy


def _labels(n=23, vocab=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, vocab, (n,), generator=g)
    y[torch.rand(n, generator=g) < 0.4] = -100
    return y


def test_deferred_checks_give_the_same_rows_loss_and_gradients():
    y = _labels()
    n = int((y != -100).sum())
    h = torch.randn(y.numel(), 8, requires_grad=True)
    w = torch.randn(20, 8, requires_grad=True)
    want_rows = labelled_rows(y, 20)
    want = torch.autograd.grad(linear_cross_entropy(h, w, y), (h, w))
    with label_checks.deferred() as checks:
        assert torch.equal(labelled_rows(y, 20, count=n), want_rows)
        got = torch.autograd.grad(linear_cross_entropy(h, w, y, labelled=n), (h, w))
        checks.check()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [-1, 20, 10**6])
def test_a_bad_label_raises_at_the_check_and_reaches_no_kernel(bad):
    y = _labels()
    at = int((y != -100).nonzero()[3])
    y[at] = bad
    n = int((y != -100).sum())
    h = torch.randn(y.numel(), 8, requires_grad=True)
    w = torch.randn(20, 8, requires_grad=True)
    with label_checks.deferred() as checks:
        rows = labelled_rows(y, 20, count=n)  # no raise here: no host read
        assert torch.equal(rows, (y != -100).nonzero().squeeze(1))  # the rows as if the label were good
        safe = label_checks.safe(y, 20, -100)
        assert safe[at] == 0 and torch.equal(safe[y != bad], y[y != bad]) and y[at] == bad  # a new tensor
        loss = linear_cross_entropy(h, w, y, labelled=n)  # reads no logit past the vocabulary
        loss.backward()
        assert torch.isfinite(loss)
        with pytest.raises(ValueError, match=rf"^label {bad} is outside \[0, 20\) \(and is not ignore_index -100\)$"):
            checks.check()
        checks.check()  # read and forgotten: nothing left to raise
    assert label_checks.safe(y, 20, -100) is y  # outside a block the eager checks raise first


def test_a_wrong_count_raises_at_the_end_of_the_block():
    y = _labels()
    n = int((y != -100).sum())
    with pytest.raises(ValueError, match=rf"^{n} labels are not ignore_index -100, not the {n + 1} given$"):
        with label_checks.deferred():
            rows = labelled_rows(y, 20, count=n + 1)
            assert rows.numel() == n + 1 and rows[-1] == 0  # the missing row is row 0: in range
    assert label_checks.active() is None


def test_without_a_count_or_outside_a_block_the_checks_read_at_once():
    y = _labels()
    y[int((y != -100).nonzero()[0])] = 99
    with pytest.raises(ValueError, match=r"^label 99 is outside"):
        labelled_rows(y, 20, count=int((y != -100).sum()))
    with label_checks.deferred() as checks:
        with pytest.raises(ValueError, match=r"^label 99 is outside"):
            labelled_rows(y, 20)  # no count: the rows need the host anyway, and so does the check
        checks.check()


def test_an_exception_inside_the_block_is_the_one_that_goes_on_and_many_calls_stay_bounded(monkeypatch):
    y = _labels()
    n = int((y != -100).sum())
    with pytest.raises(KeyError):
        with label_checks.deferred():
            labelled_rows(y, 20, count=n + 1)
            raise KeyError("first")
    monkeypatch.setattr(label_checks, "MAX_HELD", 4)
    with label_checks.deferred() as checks:
        for _ in range(10):
            labelled_rows(y, 20, count=n)
        assert len(checks._bad) + len(checks._counts) <= 4
    with label_checks.deferred() as outer:
        with label_checks.deferred() as inner:
            assert label_checks.active() is inner
        assert label_checks.active() is outer


def test_no_labels_hold_nothing_but_their_count():
    empty = torch.empty(0, dtype=torch.long)
    with label_checks.deferred() as checks:
        assert labelled_rows(empty, 20, count=0).numel() == 0
        assert checks._bad == [] and len(checks._counts) == 1
    with pytest.raises(ValueError, match=r"^0 labels are not ignore_index -100, not the 1 given$"):
        with label_checks.deferred():
            labelled_rows(empty, 20, count=1)
