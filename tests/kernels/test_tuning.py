"""Host-side launch choices of the Triton kernels (CPU: pure Python)."""
import pytest

pytest.importorskip("triton")


def test_dw_splits_with_dx_work_in_the_same_launch():
    """With dX tiles sharing the launch, a dW tile is split only as far as keeps one split within an even
    share of all the work (the measured H100 choices: 4 for BERT 768x768, 1 for the other six shapes), never
    below MIN_CHUNK rows a split nor above 8; alone, the waves rule."""
    from sebp_kernels._triton.dw import MIN_CHUNK, dw_splits
    from sebp_kernels._triton.tuning import cdiv

    def fused(m, n_in, n_out, n_sm=132):
        return dw_splits(n_out, n_in, m, n_sm, 128, 256, cdiv(m, 128) * cdiv(n_in, 256) * n_out)

    assert fused(16384, 768, 768) == 4
    for m, n_in, n_out in ((16384, 768, 3072), (16384, 3072, 768), (4096, 3072, 3072), (4096, 3072, 1024),
                           (4096, 3072, 8192), (4096, 8192, 3072)):
        assert fused(m, n_in, n_out) == 1
    assert dw_splits(768, 768, 16384, 132, 128, 256) == 7  # alone: fill the waves
    assert fused(3 * MIN_CHUNK, 256, 128, n_sm=10_000) == 3  # capped by MIN_CHUNK rows per split
    assert fused(64 * MIN_CHUNK, 256, 128, n_sm=10_000) == 8  # and by 8


def test_dx_split_args_piece_length_depends_on_company():
    """dX beside dW tiles may split K into pieces of MIN_K; dX alone (every SM free) only into pieces of
    MIN_K_ALONE, and with no free SM not at all."""
    from sebp_kernels._triton.dx import MIN_K, MIN_K_ALONE, dx_split_args
    from sebp_kernels._triton.tuning import DX_CONFIG

    assert MIN_K < MIN_K_ALONE
    programs, extra, fill, min_k, part_tiles = dx_split_args(4096, 3072, 1024, DX_CONFIG, 132, False, busy=96)
    assert (extra, fill, min_k, part_tiles) == (36, 36, MIN_K, 72) and programs == 32 * 12 + 36
    assert dx_split_args(4096, 3072, 1024, DX_CONFIG, 132, False)[3] == MIN_K_ALONE
    assert dx_split_args(4096, 3072, 1024, DX_CONFIG, 132, False, busy=131)[1:] == (0, 1, 64, 0)
