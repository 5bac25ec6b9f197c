"""ShareReader (sebp_kernels.readback): a count read back as a share; on the CPU at once, on a GPU later."""
import pytest
import torch

from sebp_kernels.readback import ShareReader


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
