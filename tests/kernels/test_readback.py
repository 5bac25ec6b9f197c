"""ShareReader (sebp_kernels.readback): a count read back as a share; on the CPU at once, on a GPU later; and
PeriodicShare, which reads every few calls and keeps the latest."""
import pytest
import torch

from sebp_kernels.readback import PeriodicShare, ShareReader


def test_a_cpu_count_is_read_at_once_and_leaves_nothing_in_flight():
    r = ShareReader()
    assert r.start(torch.tensor([3], dtype=torch.int32), 8) == 3 / 8
    assert not r.busy and r.poll() is None


@pytest.mark.gpu
def test_gpu_count_is_read_once_its_copy_is_done():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    r = ShareReader()
    assert r.start(torch.tensor([5], dtype=torch.int32, device="cuda"), 10) is None and r.busy
    torch.cuda.synchronize()
    assert r.poll() == 0.5 and not r.busy and r.poll() is None


def test_periodic_share_reads_every_nth_call_and_again_after_a_reset():
    p = PeriodicShare(every=3)
    assert p.share is None and p.poll() is None
    for i, count in enumerate((1, 2, 3, 4)):  # a CPU count is read at once: calls 0 and 3
        p.observe(torch.tensor([count]), 10)
        assert p.share == (0.1 if i < 3 else 0.4), i
    p.observe(torch.tensor([9]), 10, capturing=True)  # call 4: not due anyway
    p.calls = 0
    p.observe(torch.tensor([5]), 10, capturing=True)  # due, but a graph is captured: nothing read
    assert p.share == 0.4
    p.calls = 0
    p.observe(torch.tensor([5]), 10)
    assert p.share == 0.5 and p.poll() == 0.5
