"""SEBP linears under torch FSDP2 (``fully_shard``), 2 processes on the CPU (gloo): the sharded gradients
equal those of the same model without SEBP, for a plain stack and for a peft LoRA model whose frozen base
projections run SEBP. (Fine-tuning under `accelerate launch --use_fsdp` needs GPUs: accelerate runs CPU
processes as plain DDP.) One launch runs every case (tests/kernels/fsdp_worker.py's modes)."""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from tests.helpers import run_torchrun

# Two processes each: `bootstrap.py test` runs these after the xdist workers are done (see tests/conftest.py)
pytestmark = pytest.mark.multiprocess
ROOT = Path(__file__).resolve().parents[2]


PEFT = importlib.util.find_spec("peft") is not None
MODES = ["plain", "compiled", "kept"] + (["lora", "merge"] if PEFT else [])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Every mode of fsdp_worker.py in one 2-process launch (a launch costs more than the modes' work); the
    results of rank 0 and rank 1."""
    pytest.importorskip("torch.distributed.fsdp")
    out = tmp_path_factory.mktemp("fsdp")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    run_torchrun([str(Path(__file__).with_name("fsdp_worker.py")), str(out), *MODES], 600, env=env, cwd=ROOT)
    lines = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in lines] == [0, 1], "a process wrote no result"
    return lines


@pytest.mark.slow
def test_fsdp2_sharded_gradients_equal_dense(ranks):
    for r in ranks:
        assert r["plain"]["sharded"] == "DTensor"
        d = r["plain"]["diffs"]
        assert len(d) == 6 and max(d.values()) <= 1e-6, d


@pytest.mark.slow
def test_fsdp2_lora_adapters_get_dense_gradients_with_sebp_base_layers(ranks):
    """A peft LoRA model (tiny Llama) with SEBP on its frozen base projections, every decoder layer sharded with
    FSDP2: the adapters' sharded gradients equal those without SEBP."""
    pytest.importorskip("peft")
    for r in ranks:
        d = r["lora"]["diffs"]
        assert len(d) == 16 and max(d.values()) <= 1e-5, d  # 2 layers x 4 x (A, B)


@pytest.mark.slow
def test_fsdp2_lora_gathered_and_merged_equals_merge_and_unload(ranks):
    """How finetune saves a sharded LoRA run: the full state dict gathered from the shards and merged key by key
    (sebp_probe.train.lora_merge) equals peft's merge_and_unload of the same model unsharded, under the base keys."""
    pytest.importorskip("peft")
    diffs = ranks[0]["merge"]["diffs"]
    assert len(diffs) > 20 and max(diffs.values()) <= 1e-6, diffs


@pytest.mark.slow
def test_fsdp2_layers_compiled_in_place_get_dense_gradients_with_sebp(ranks):
    """``finetune --compile``'s default scope under FSDP2: each sharded decoder layer of a tiny Llama with SEBP
    compiled in place (aot_eager), over two batch shapes: the eager dense model's gradients, and Dynamo
    compiled one graph for all of them, without a break."""
    for r in ranks:
        d = dict(r["compiled"]["diffs"])
        assert (d.pop("graphs"), d.pop("graph_breaks")) == (1, 0)  # one layer graph for every layer and shape
        assert len(d) > 10 and max(d.values()) <= 1e-5, d


@pytest.mark.slow
def test_fsdp2_labelled_head_through_the_models_forward_gets_the_models_gradients(ranks):
    """``--head labelled`` in two processes: the output layer on the labelled positions through the sharded
    model's own forward (logits_to_keep), SEBP on the projections: the sharded dense model's gradients under its
    own loss, with fewer rows through the output layer."""
    for r in ranks:
        diffs = dict(r["kept"]["diffs"])
        rows, every = diffs.pop("head_rows"), diffs.pop("all_rows")
        assert 0 < rows < every, (rows, every)
        assert len(diffs) > 20 and max(diffs.values()) <= 1e-5, diffs
