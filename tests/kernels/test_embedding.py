"""The embedding backward over the real-token rows (sebp_kernels.embedding) and its patch (sebp_probe.model.embed_rows):
the weight gradient of the real rows alone, exactly; on only where the padding check said so."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from sebp_kernels.embedding import real_rows, sebp_embedding
from sebp_kernels.pad_rows import ON, PadRows


def _grad(ids, weight, padding_idx, dy, real=None):
    w = weight.detach().clone().requires_grad_(True)
    sebp_embedding(ids, w, padding_idx, real).backward(dy)
    return w.grad


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("tokens", [5, 1100])  # on a GPU 3 x 1100 takes PyTorch's other (sorting) kernel
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_the_backward_leaves_out_the_rows_not_real(device, tokens, padding_idx):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    torch.manual_seed(0)
    ids = torch.randint(0, 40, (3, tokens), device=device)
    ids[:, : tokens // 3] = 0  # some rows name the padding index (left out anyway where there is one)
    real = torch.rand(3, tokens, device=device) > 0.4
    weight = torch.randn(40, 8, device=device)
    dy = torch.randn(3, tokens, 8, device=device)
    got = _grad(ids, weight, padding_idx, dy, real)
    want = _grad(ids, weight, padding_idx, dy * real.unsqueeze(-1))  # the real rows alone, through PyTorch's own
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(_grad(ids, weight, padding_idx, dy), got)  # the rows left out did carry gradient
    out = sebp_embedding(ids, weight, padding_idx, real)
    torch.testing.assert_close(out, F.embedding(ids, weight, padding_idx))


def test_real_rows_only_once_the_check_is_on_and_for_the_batch_tokens():
    pad = PadRows()
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    pad.set(mask)
    ids = torch.zeros(2, 3, dtype=torch.long)
    assert real_rows(pad, ids) is None  # still checking
    pad.state = ON
    assert real_rows(pad, ids).tolist() == [[True, True, False], [True, False, False]]
    assert real_rows(pad, torch.zeros(2, 4, dtype=torch.long)) is None and real_rows(None, ids) is None
    with torch.no_grad():  # nothing to differentiate: the plain lookup
        assert sebp_embedding(ids, torch.randn(3, 2, requires_grad=True), None, real_rows(pad, ids)).grad_fn is None


def test_patch_model_gives_the_plain_embeddings_the_rows_and_unpatch_takes_them_back(monkeypatch):
    from sebp_kernels import SEBPConfig
    from sebp_probe import patch_model, unpatch_model
    from sebp_probe.model import patch as patch_module
    from tests.tiny_models import padded_batch, tiny_model

    torch.manual_seed(0)
    dense = tiny_model("bert").eval()
    model = copy.deepcopy(dense)
    patch_model(model, SEBPConfig("exact", backend="torch"))
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    assert len(embeddings) == 3 and all("forward" in vars(m) for m in embeddings)
    monkeypatch.setattr(patch_module, "_triton_backward_on", lambda device: True)  # the pre-hook sets the rows
    pad = model.base_model._sebp_pad_rows
    pad.state = ON
    calls = []
    from sebp_kernels import embedding

    real_backward = embedding._Embedding.backward
    monkeypatch.setattr(embedding._Embedding, "backward",
                        staticmethod(lambda ctx, dy: calls.append(1) or real_backward(ctx, dy)))
    batch = padded_batch("bert", lengths=(6, 2, 4))
    model(**batch).loss.backward()
    dense(**batch).loss.backward()
    assert len(calls) == 2  # words and token types; BERT looks positions up as (1, seq), summed over the batch first
    for (name, p), q in zip(model.named_parameters(), dense.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    unpatch_model(model)
    assert not any("forward" in vars(m) or "_sebp_pad_rows" in vars(m) for m in embeddings)


def test_traced_embeddings_read_nothing_of_the_check():
    """Inside torch.compile the embedding is the plain lookup, decided before the check's state is read: its
    verdict changing compiles nothing again."""
    import torch._dynamo as dynamo
    from torch._dynamo.testing import CompileCounter

    pad = PadRows()
    pad.set(torch.tensor([[1, 1, 0], [1, 0, 0]]))
    weight = torch.randn(5, 2, requires_grad=True)
    counter = CompileCounter()
    dynamo.reset()
    try:
        fn = torch.compile(lambda ids: sebp_embedding(ids, weight, None, real_rows(pad, ids)), backend=counter)
        ids = torch.ones(2, 3, dtype=torch.long)
        fn(ids).sum().backward()
        pad.state = ON
        fn(ids).sum().backward()
    finally:
        dynamo.reset()
    assert counter.frame_count == 1
