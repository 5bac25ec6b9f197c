"""The fast launcher's cache key (CPU: pure Python): everything Triton specialises on must change the key."""
import pytest
import torch

triton = pytest.importorskip("triton")

from sebp_kernels._triton.launch import _spec  # noqa: E402


def test_integer_specialisations_are_told_apart():
    assert _spec(16) != _spec(17)  # divisibility by 16
    assert _spec(1) != _spec(3)  # == 1
    assert _spec(2**31) != _spec(2**31 - 16 * 2**20)  # 32-bit range
    assert _spec(32) == _spec(48) and _spec(5) == _spec(7)
    assert _spec(True) != _spec(1) and _spec(True) != _spec(False)


def test_tensor_dtype_and_alignment_are_told_apart():
    buf = torch.zeros(64, dtype=torch.float32)
    assert _spec(buf) == _spec(buf[4:])  # 16 bytes further: still aligned
    assert _spec(buf) != _spec(buf[1:])  # 4 bytes: not
    assert _spec(buf) != _spec(buf.to(torch.float16))
    assert _spec(0.5) == _spec(2.0) and _spec(None) != _spec(0.5)


def test_launch_hooks_count_as_active_only_when_they_do_something():
    from sebp_kernels._triton.launch import _active

    class Chain:
        def __init__(self, calls):
            self.calls = calls

    assert not _active(None) and not _active(Chain([]))
    assert _active(Chain([print])) and _active(print)
