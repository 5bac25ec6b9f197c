"""The gradient-statistics collector on tiny BERT/Llama: exact zero-row counts, CLS-only rows, noise rows,
device reductions equal to a brute-force host computation, hooks removed on exit and on error."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from sebp_kernels import SEBPConfig
from sebp_probe import patch_model
from sebp_probe.analysis.causes import grouper
from sebp_probe.analysis.heatmap import capture_output_grads
from sebp_probe.analysis.hooks import N_GROUPS, GradientStatsCollector, reduce_grad
from sebp_probe.analysis.knee import detect_eps, fine_histogram, octave_histogram
from tests.helpers import LinearStack, assert_same_stats, collect_with_grads, roundoff_first_queries, \
    special_rows_grad
from tests.tiny_models import padded_batch, tiny_model

LENGTHS = (11, 4, 7, 9, 2)


def _collect(model, batches, **kw):
    with GradientStatsCollector(model, **kw) as col:
        for b in batches:
            model.zero_grad(set_to_none=True)
            with col.batch(b["attention_mask"]):
                model(**b).loss.backward()
    return col.stats()


def _n_pad(batch):
    return int((batch["attention_mask"] == 0).sum())


def test_right_padded_bert_pad_rows_are_exactly_zero_and_last_layer_is_cls_only():
    model = tiny_model("bert")
    batch = padded_batch("bert", LENGTHS)
    stats = _collect(model, [batch])
    n_rows, n_pad, n_samples = batch["input_ids"].numel(), _n_pad(batch), len(LENGTHS)
    assert stats.batches == 1 and len(stats.layers) == 12
    for name, layer in stats.layers.items():
        assert layer.rows == [n_rows]
        cls_only = name.startswith("bert.encoder.layer.1.") and not name.endswith(("key", "value"))
        # the last layer's query, attention output, intermediate and output only act on the CLS rows
        want = n_rows - n_samples if cls_only else n_pad
        assert layer.zero_rows == [want], name
    assert [list(x) for x in stats.lengths] == [list(LENGTHS)]
    assert stats.padded_lengths == [max(LENGTHS)]


def test_right_padded_llama_zero_rows_are_pads_plus_each_last_token():
    model = tiny_model("llama")
    batch = padded_batch("llama", LENGTHS)
    stats = _collect(model, [batch])
    # a pad row gets no gradient; nor does each sample's last token (it predicts nothing, nothing sees it)
    want = _n_pad(batch) + len(LENGTHS)
    got = {n: lay.zero_rows[0] for n, lay in stats.layers.items()}
    # A sample's first query sees one key only, so its softmax is constant and dL/dq is zero in exact
    # arithmetic: rounding leaves it tiny on some CPUs, others and some GPU attention kernels give exactly 0.
    # So is dL/dk of a 2-token sample's first key: its only other query is the last token's, which gets none.
    q = {n for n in got if n.endswith("q_proj")}
    k = {n for n in got if n.endswith("k_proj")}
    assert {n: v for n, v in got.items() if n not in q | k} == {n: want for n in got if n not in q | k}
    assert all(want <= got[n] <= want + len(LENGTHS) for n in q), {n: got[n] for n in q}
    assert all(want <= got[n] <= want + LENGTHS.count(2) for n in k), {n: got[n] for n in k}


@pytest.mark.parametrize("arch, side", [("bert", "right"), ("llama", "left"), ("qwen3", "right")])
def test_device_reductions_equal_brute_force(arch, side):
    model = tiny_model(arch)
    batch = padded_batch(arch, LENGTHS, side=side)
    groups = grouper(model, None)(batch)
    with GradientStatsCollector(model) as col:
        names = col.names
        with capture_output_grads(model, names) as dy, col.batch(batch["attention_mask"], groups):
            model(**batch).loss.backward()
    stats = col.stats()
    for name in names:
        g = dy[name].reshape(-1, dy[name].shape[-1]).numpy()
        layer = stats.layers[name]
        row_max = np.abs(g).max(axis=1)
        assert layer.rows == [g.shape[0]] and layer.elements == [g.size]
        assert layer.zero_elements == [int((g == 0).sum())]
        assert layer.zero_rows == [int((row_max == 0).sum())]
        assert layer.max_abs == [float(row_max.max())]
        np.testing.assert_array_equal(layer.element_hist, fine_histogram(g))
        np.testing.assert_array_equal(layer.row_hist, fine_histogram(row_max))
        np.testing.assert_array_equal(layer.octaves()[0], octave_histogram(fine_histogram(row_max)))
        for k in range(N_GROUPS):  # each row group's own histogram
            in_group = row_max[groups.numpy() == k + 1]
            np.testing.assert_array_equal(layer.group_octaves_seen()[0, k], octave_histogram(fine_histogram(in_group)))


def test_bfloat16_and_float16_gradients_bucket_like_float32():
    g = torch.randn(37, 19) * torch.logspace(-12, 2, 19)
    g[3] = 0
    g[5, 2] = float("nan")
    for dtype in (torch.bfloat16, torch.float16):
        gd = g.to(dtype)
        rows, elems, scalars, eh, rh = reduce_grad(gd)
        ref = gd.float().numpy()
        assert (rows, elems) == (37, 37 * 19)
        zero_rows, nonfinite, zero_elems, _ = scalars.tolist()
        assert zero_rows == 1 and nonfinite == 1 and zero_elems == int((ref == 0).sum())
        np.testing.assert_array_equal(eh.numpy(), fine_histogram(ref))


def test_large_gradients_sample_rows_for_the_element_histogram_only():
    from sebp_probe.analysis import grad_reduce

    g = torch.randn(1000, 600) * torch.logspace(-9, 1, 600)
    g[::7] = 0
    rows, elems, scalars, eh, rh = reduce_grad(g)
    step = -(-g.numel() // grad_reduce.ELEMENT_SAMPLE)
    assert step > 1
    ref = g.numpy()
    np.testing.assert_array_equal(eh.numpy(), fine_histogram(ref[::step]))  # sampled rows
    np.testing.assert_array_equal(rh.numpy(), fine_histogram(np.abs(ref).max(axis=1)))  # exact
    assert scalars.tolist()[:3] == [143, 0, int((ref == 0).sum())]


def test_sync_free_bucket_counts_equal_bincount():
    """The GPU path (histc on bucket centres, chunked) is exercised on the CPU against bincount."""
    from sebp_probe.analysis import grad_reduce

    ids = torch.randint(0, 2049, (100_003,), dtype=torch.int32)
    ids[:5000] = 0
    ids[-7:] = 2048
    want = torch.bincount(ids, minlength=2049)
    old = grad_reduce._HISTC_CHUNK
    try:
        grad_reduce._HISTC_CHUNK = 4096  # several chunks, the last one short
        got = grad_reduce.bucket_counts(ids, 2049, sync_free=True)
    finally:
        grad_reduce._HISTC_CHUNK = old
    assert got.dtype == torch.int64 and torch.equal(got, want)


def test_left_padded_decoder_noise_rows_fall_below_the_detected_eps():
    """In a left-padded decoder the first real token only attends to itself, so its query gradient is
    round-off noise (~1e-11) rather than zero (on CPUs whose attention gives exactly 0 there,
    ``roundoff_first_queries`` puts such noise in); the detected eps must separate these rows from the rest."""
    model = tiny_model("llama")
    batches = [padded_batch("llama", LENGTHS, side="left", seed=s) for s in range(4)]
    name = "model.layers.1.self_attn.q_proj"
    with roundoff_first_queries(model), GradientStatsCollector(model, target_modules=[name]) as col:
        row_max, first = [], []
        for b in batches:
            with capture_output_grads(model, [name]) as dy, col.batch(b["attention_mask"]):
                model(**b).loss.backward()
            row_max.append(dy[name].abs().amax(-1).flatten())
            mask = b["attention_mask"]
            first.append((mask.cumsum(1) == 1) & (mask == 1))  # the first real token of each sample
    row_max, first = torch.cat(row_max).numpy(), torch.cat([f.flatten() for f in first]).numpy()
    res = detect_eps(col.stats().layers[name].row_hist)
    assert res.knee_found, res.reason
    noise = (row_max > 0) & (row_max < 1e-9)
    assert noise.sum() >= 15 and not (noise & ~first).any()  # round-off can also give an exact zero
    real = row_max[row_max >= 1e-9]
    assert row_max[noise].max() <= res.eps < real.min()


def test_patched_model_gives_the_same_statistics():
    dense = tiny_model("llama")
    sebp = copy.deepcopy(dense)
    patch_model(sebp, SEBPConfig("exact"))
    batch = padded_batch("llama", LENGTHS, side="left")
    a, b = _collect(dense, [batch]), _collect(sebp, [batch])
    assert a.layers.keys() == b.layers.keys()
    for name in a.layers:
        la, lb = a.layers[name], b.layers[name]
        assert (la.rows, la.zero_rows, la.zero_elements) == (lb.rows, lb.zero_rows, lb.zero_elements)
        np.testing.assert_array_equal(la.row_hist, lb.row_hist)


def _hook_count(model):
    return sum(len(m._forward_hooks) for m in model.modules())


def test_hooks_are_removed_on_exit_and_on_error_and_a_failed_batch_is_dropped():
    model = tiny_model("bert")
    batch = padded_batch("bert", LENGTHS)
    before = _hook_count(model)
    with pytest.raises(RuntimeError, match="boom"):
        with GradientStatsCollector(model) as col:
            assert _hook_count(model) == before + len(col.names)
            with col.batch(batch["attention_mask"]):
                model(**batch).loss.backward()
            with col.batch(batch["attention_mask"]):
                model(**batch).loss.backward()
                raise RuntimeError("boom")
    assert _hook_count(model) == before
    stats = col.stats()
    assert stats.batches == 1 and all(len(lay.rows) == 1 for lay in stats.layers.values())
    with pytest.raises(RuntimeError, match="with"):
        with col.batch():
            pass


def test_a_collector_entered_step_after_step_keeps_the_users_hooks_and_adds_none():
    """Each entry puts the collector's forward hooks into the modules' hook dicts under ids made once, each exit
    takes them out: a hook of the user's on a target linear runs at every step and stays; nothing piles up."""
    model = tiny_model("bert")
    batch = padded_batch("bert", LENGTHS)
    col = GradientStatsCollector(model)
    target = model.get_submodule(col.names[0])
    seen = []
    handle = target.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    before = _hook_count(model)
    for step in range(3):
        with col:
            assert _hook_count(model) == before + len(col.names)
            with col.batch(batch["attention_mask"]):
                model(**batch).loss.backward()
        assert _hook_count(model) == before and len(seen) == step + 1
    assert col.stats().batches == 3
    handle.remove()
    assert _hook_count(model) == before - 1


def test_nan_rows_are_counted_and_layers_without_gradient_record_zero_rows():
    model = tiny_model("bert")
    for p in model.bert.encoder.layer[0].parameters():
        p.requires_grad_(False)
    model.bert.embeddings.requires_grad_(False)
    batch = padded_batch("bert", LENGTHS)
    name = "bert.encoder.layer.1.output.dense"

    def poison(module, args, out):  # registered first, so the collector sees the poisoned gradient
        out.register_hook(lambda g: g.index_fill(-1, torch.tensor([0]), float("nan")))

    handle = model.get_submodule(name).register_forward_hook(poison)
    with GradientStatsCollector(model, target_modules="all-linear") as col:
        with col.batch(batch["attention_mask"]):
            model(**batch).loss.backward()
    handle.remove()
    stats = col.stats()
    n_rows = batch["input_ids"].numel()
    assert stats.layers[name].nonfinite_rows == [n_rows]
    assert np.isnan(stats.layers[name].max_abs[0])
    assert stats.layers["bert.encoder.layer.0.attention.self.query"].rows == [0]
    assert not stats.layers["bert.encoder.layer.0.attention.self.query"].seen.any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_reduction_equals_cpu_and_backward_never_syncs(dtype):
    g = torch.randn(4096, 1536) * torch.logspace(-12, 2, 1536)
    g[::3] = 0
    gd = g.to(dtype)
    on_gpu, on_cpu = reduce_grad(gd.cuda()), reduce_grad(gd)
    assert on_gpu[:2] == on_cpu[:2]
    for a, b in zip(on_gpu[2:], on_cpu[2:]):
        assert torch.equal(a.cpu(), b)

    model = tiny_model("bert").cuda()
    batch = {k: v.cuda() for k, v in padded_batch("bert", LENGTHS).items()}
    with GradientStatsCollector(model) as col:
        with col.batch(batch["attention_mask"], grouper(model, None)(batch)):
            loss = model(**batch).loss
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")  # any host sync in the hooks raises
            try:
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode(0)
    layer = col.stats().layers["bert.encoder.layer.0.attention.self.query"]
    assert layer.zero_rows == [_n_pad(batch)] and layer.group_octaves[0][0, 0] == _n_pad(batch)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_collector_equals_cpu_torch_path(dtype):
    """The CUDA path (one rowstats kernel per hook) gives the CPU torch path's statistics field for field:
    MiniLM-sized 3-D gradients that sample rows for the element histogram, CLS-only and odd shapes, a layer
    called twice, a layer without gradient, zero/noise/NaN/Inf rows, three batches."""
    shapes = [(384, 1536), (1536, 384), (384, 384), (64, 1027)]
    steps = []
    for b in range(3):
        calls = [(0, (32, 128), special_rows_grad((32, 128, 1536), dtype, seed=10 * b)),
                 (1, (32, 128), special_rows_grad((32, 128, 384), dtype, seed=10 * b + 1)),
                 (1, (32,), special_rows_grad((32, 384), dtype, seed=10 * b + 2)),
                 (3, (999,), special_rows_grad((999, 1027), dtype, seed=10 * b + 3))]
        if b != 1:
            calls.append((2, (7, 33), special_rows_grad((7, 33, 384), dtype, seed=10 * b + 4)))
        steps.append(calls)
    # row groups for the calls with one row per token of a 32 x 128 batch (the 3-D ones)
    groups = [torch.randint(0, N_GROUPS + 1, (32 * 128,), generator=torch.Generator().manual_seed(b),
                            dtype=torch.int8) for b in range(3)]
    cpu = collect_with_grads(LinearStack(shapes, dtype), steps, groups)
    gpu = collect_with_grads(LinearStack(shapes, dtype, "cuda"), steps, groups)
    assert not cpu._buffers and list(gpu._buffers) and gpu._element_acc is None  # the kernel did the work
    assert_same_stats(gpu.stats(), cpu.stats())
