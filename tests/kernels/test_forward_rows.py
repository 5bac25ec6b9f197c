"""The forward of an SEBP linear over the real-token rows (sebp_kernels.forward_rows) against F.linear.

The torch reference runs on the CPU directly; the Triton launch (the dX kernel fed X and Wᵀ) runs under the
interpreter in a subprocess, and on a GPU where there is one. The whole path in a model (eager and each layer
compiled, after the padding rows' check) is tested against dense in test_pad_rows.py.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from sebp_kernels import forward_rows
from sebp_kernels.forward_rows import linear_maybe_over_rows, linear_over_rows, pays
from sebp_kernels.pad_rows import ON, PadRows, forward_rows_traced
from sebp_kernels.reference import linear_rows_torch


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _rows(mask: torch.Tensor, device="cpu"):
    """(perm, count) of a (batch, seq) mask's real rows, as PadRows forms them."""
    pad = PadRows()
    pad.set(mask.to(device))
    return pad.rows[0], pad.rows[1]


def _case(device, dtype, m_batch=3, seq=11, n_in=19, n_out=23, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, seq + 1, (m_batch,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    x = torch.randn(m_batch, seq, n_in, generator=g).to(device, dtype)
    w = torch.randn(n_out, n_in, generator=g).to(device, dtype)
    b = torch.randn(n_out, generator=g).to(device, dtype) if bias else None
    return x, w, b, mask.to(device)


def _check(device, dtype, atol, rtol, **shape):
    x, w, b, mask = _case(device, dtype, **shape)
    perm, count = _rows(mask, device)
    got = linear_over_rows(x, w, b, perm, count)
    want = F.linear(x, w, b)
    real = mask.bool()
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got[real], want[real], atol=atol, rtol=rtol)
    pad_value = b if b is not None else torch.zeros(w.shape[0], dtype=dtype, device=device)
    assert torch.equal(got[~real], pad_value.expand_as(got[~real]))  # the padding rows: the bias alone


def test_reference_computes_the_real_rows_and_zeros_the_rest():
    x = torch.randn(6, 4)
    w = torch.randn(3, 4)
    perm, count = torch.tensor([0, 2, 5, 1, 3, 4], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    y = linear_rows_torch(x, w, perm, count)
    torch.testing.assert_close(y[[0, 2, 5]], x[[0, 2, 5]] @ w.t())
    assert not y[[1, 3, 4]].any()
    b = torch.randn(3)
    y = linear_rows_torch(x, w, perm, count, b)
    torch.testing.assert_close(y[[0, 2, 5]], x[[0, 2, 5]] @ w.t() + b)
    assert torch.equal(y[[1, 3, 4]], b.expand(3, 3))


@pytest.mark.parametrize("bias", [True, False])
def test_cpu_path_matches_f_linear_on_the_real_rows(bias):
    """Without triton for these tensors (the CPU outside the interpreter) the torch reference runs."""
    _check("cpu", torch.float32, 1e-5, 1e-5, bias=bias)


def test_no_rows_is_f_linear_itself():
    x, w, b, _ = _case("cpu", torch.float32)
    assert torch.equal(linear_maybe_over_rows(x, w, b, None), F.linear(x, w, b))


def test_it_pays_on_large_batches_with_padding_only():
    """The line drawn from the H100 probe (results/kernels.json, run forward_rows): Llama-3.2-1B's and
    Qwen2.5-0.5B's projections over 8192 rows half real, not their all-real batches, not Qwen's 896->128 k/v,
    not BERT-base's 2112-row batches."""
    assert pays(8192, 2048, 2048, 0.5) and pays(8192, 2048, 512, 0.5) and pays(8192, 896, 896, 0.5)
    assert pays(8192, 2048, 8192, None)  # no share read yet: taken as a half
    assert not pays(8192, 2048, 2048, 1.0) and not pays(8192, 896, 128, 0.25) and not pays(8192, 896, 896, 0.75)
    assert not pays(2112, 768, 3072, 0.25) and not pays(2112, 3072, 768, 0.5)


def test_a_shape_that_could_never_pay_is_told_apart_from_the_shapes_alone():
    """What a compiled layer asks when traced: BERT-base's 2112-row batches never pay (F.linear traced, no
    operator call); Llama's do at some share of real rows, Qwen's 896->128 k/v at none; and pays implies it."""
    from sebp_kernels.forward_rows import could_pay

    assert not could_pay(2112, 768, 3072) and not could_pay(4095, 8192, 8192)
    assert not could_pay(8192, 896, 128)  # 0.94e9 multiply-adds with every row padding: under the 3e9
    assert could_pay(8192, 2048, 2048) and could_pay(8192, 896, 896)
    for rows, n_in, n_out, share in ((8192, 2048, 512, 0.5), (4096, 2048, 2048, 0.1), (8192, 896, 128, 0.0)):
        assert could_pay(rows, n_in, n_out) or not pays(rows, n_in, n_out, share)


def test_a_compiled_layer_told_the_most_rows_of_a_batch_decides_by_them(monkeypatch):
    """functional._over_rows: told the run's most rows a batch, a compiled layer asks could_pay at them (the
    operator decides each batch itself), whatever this batch's rows; not told, at this batch's rows; never
    without padding rows."""
    from sebp_kernels.functional import _over_rows

    monkeypatch.setattr(forward_rows, "MIN_ROWS", 30)
    monkeypatch.setattr(forward_rows, "MIN_SKIPPED", 0.0)
    x, w, pad = torch.empty(3, 9, 64), torch.empty(32, 64), (None, None, None)
    assert not _over_rows(x, w, pad) and _over_rows(x, w, pad, 36)  # 27 rows, under the line of 30
    assert not _over_rows(x, w, pad, 20) and not _over_rows(x, w, None, 36)
    assert _over_rows(torch.empty(3, 12, 64), w, pad)


def test_the_kernel_reads_w_transposed_only_within_32_bit_offsets():
    """Wᵀ as a strided view: a unit stride in one dimension (a Conv1D's transposed weight has it in the other),
    none refused, and the largest offset (rows x row stride) under 2**31, which a column slice of a wide matrix
    can pass while its own size stays under it."""
    from sebp_kernels.forward_rows import _wt_view_ok

    assert _wt_view_ok(torch.empty(64, 32)) and _wt_view_ok(torch.empty(32, 64).t())
    assert not _wt_view_ok(torch.empty(64, 64)[::2, ::2])
    wide = torch.empty(0, device="meta").as_strided((2**16, 8), (2**16, 1))  # rows 2**16 apart: offsets to 2**32
    assert wide.numel() < 2**31 and not _wt_view_ok(wide)


def test_rows_that_do_not_pay_run_f_linear(monkeypatch):
    x, w, b, mask = _case("cpu", torch.float32)
    perm, count = _rows(mask)
    assert torch.equal(linear_maybe_over_rows(x, w, b, (perm, count, 0.5)), F.linear(x, w, b))  # too small
    monkeypatch.setattr(forward_rows, "MIN_ROWS", 0)
    monkeypatch.setattr(forward_rows, "MIN_SKIPPED", 0.0)  # the product's type
    got = linear_maybe_over_rows(x, w, b, (perm, count, 0.5))
    assert torch.equal(got[~mask.bool()], b.expand_as(got[~mask.bool()]))  # the rows path: padding rows the bias
    assert torch.equal(linear_maybe_over_rows(x, w, b, (perm, count, 1.0)), F.linear(x, w, b))  # nothing skipped


def test_the_real_row_share_is_read_back_as_rows_are_set():
    """On the CPU the share of the batch just set; a copy of the PadRows leaves nothing in flight behind."""
    import copy

    pad = PadRows()
    assert pad.density is None
    pad.set(torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]]))
    assert pad.density == 3 / 8
    pad.set(torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]))
    assert pad.density == 7 / 8
    twin = copy.deepcopy(pad)
    assert twin.density == 7 / 8 and twin._reader is not pad._reader and not twin._reader.busy


def test_rows_only_once_checked_and_only_for_the_batch_tokens():
    """PadRows hands the forward its rows only with the verdict "on", and only to an input of the batch's
    (batch, seq); compiled, the same from the flags the layer passed on."""
    pad = PadRows()
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    pad.set(mask)
    assert pad.forward_rows((2, 3, 8)) is None  # still checking
    perm, count, real = pad.traced()
    assert forward_rows_traced(pad, (2, 3, 8), perm, count, real) is None
    pad.state = ON
    got = pad.forward_rows((2, 3, 8))
    assert got[1].tolist() == [3] and got[0] is pad.rows[0] and got[2] == 3 / 6
    assert pad.forward_rows((6, 8)) is None and pad.forward_rows((3, 2, 8)) is None  # other leading dims
    assert forward_rows_traced(pad, (2, 3, 8), perm, count, real)[1].tolist() == [3]
    assert forward_rows_traced(pad, (6, 8), perm, count, real) is None
    assert forward_rows_traced(None, (2, 3, 8), perm, count, real) is None
    pad.clear()
    assert pad.forward_rows((2, 3, 8)) is None


if not INTERPRET:

    @pytest.mark.gpu
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
    @pytest.mark.parametrize("shape", [dict(m_batch=8, seq=300, n_in=2048, n_out=512),
                                       dict(m_batch=4, seq=129, n_in=768, n_out=3072),
                                       dict(m_batch=2, seq=70, n_in=64, n_out=130),
                                       dict(m_batch=2, seq=100, n_in=8192, n_out=256)])  # K split, bias once
    def test_gpu_triton_matches_f_linear_on_the_real_rows(dtype, shape):
        if not torch.cuda.is_available():
            pytest.skip("needs a GPU")
        atol, rtol = (2e-2, 2e-2) if dtype == torch.bfloat16 else (2e-4, 1e-4)
        _check("cuda", dtype, atol, rtol, **shape)

else:

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    @pytest.mark.parametrize("shape", [dict(), dict(m_batch=2, seq=40, n_in=33, n_out=17),
                                       dict(m_batch=1, seq=5, n_in=8, n_out=3, bias=False)])
    def test_interp_triton_matches_f_linear_on_the_real_rows(dtype, shape):
        from sebp_kernels import forward_rows

        from sebp_kernels._triton import fwd

        launches = []
        real = fwd.linear_rows_triton
        forward_rows._triton_parts.cache_clear()
        fwd.linear_rows_triton = lambda *a: launches.append(1) or real(*a)
        try:
            atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-3, 2e-3)
            _check("cpu", dtype, atol, rtol, **shape)
        finally:
            fwd.linear_rows_triton = real
            forward_rows._triton_parts.cache_clear()
        assert launches  # the Triton launch, not the reference

    @pytest.mark.parametrize("bias", [True, False])
    def test_interp_k_split_adds_the_bias_once(bias):
        """With SMs to spare the kernel splits K over several programs (the interpreter stands in one SM
        unless told more); the bias goes into one piece's partial, so the sum holds it once."""
        from sebp_kernels._triton.fwd import linear_rows_triton

        x, w, b, mask = _case("cpu", torch.float32, m_batch=2, seq=9, n_in=96, n_out=20, bias=bias)
        perm, count = _rows(mask)
        got = linear_rows_triton(x.reshape(-1, 96), w, perm, count, True, 6, True, b)
        want = linear_rows_torch(x.reshape(-1, 96), w, perm, count, b)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
