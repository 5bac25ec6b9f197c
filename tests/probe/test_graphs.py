"""sebp_probe.train.graphs on a machine without a GPU: batch shape keys, and a clear refusal to capture."""
from __future__ import annotations

import pytest
import torch

from sebp_probe.train.graphs import CaptureError, StepGraphs, shape_key
from tests.tiny_models import padded_batch, tiny_model


def test_shape_key_tells_batches_apart_by_shapes_and_dtypes_only():
    a, b = padded_batch("bert", (11, 4, 7), seed=1), padded_batch("bert", (3, 11, 2), seed=2)
    assert shape_key(a) == shape_key(b)  # other values, same shapes: the same graphs replay both
    assert shape_key(a) == shape_key(dict(reversed(list(a.items()))))  # key order does not matter
    assert shape_key(a) != shape_key(padded_batch("bert", (5, 9), seed=1))  # another batch size and length
    assert shape_key(a) != shape_key({**a, "labels": a["labels"].int()})  # another dtype
    # the ints a causal LM's batch carries for the labelled-rows head are no input of the replayed forward
    assert shape_key({**a, "n_targets": 3}) == shape_key({**a, "n_targets": 5}) == shape_key(a)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_capture_without_a_gpu_is_refused_and_leaves_the_gradients():
    model = tiny_model("bert")
    batch = padded_batch("bert")
    model(**batch).loss.backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with pytest.raises(CaptureError, match="need a CUDA GPU"):
        StepGraphs(model, batch)
    assert all(torch.equal(p.grad, before[n]) for n, p in model.named_parameters() if n in before)
