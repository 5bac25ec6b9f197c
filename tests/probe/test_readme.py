"""The README's Python snippets run as written (their imports, and the API example on a tiny model)."""
from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_every_python_block_imports():
    blocks = _python_blocks()
    assert len(blocks) >= 2
    for block in blocks:
        compile(block, "README.md", "exec")
        imports = "\n".join(line for line in block.splitlines() if line.startswith(("import ", "from ")))
        exec(imports, {})


def test_python_api_example_runs_on_a_tiny_llama():
    from sebp_probe import patched_activations, patched_layers
    from tests.tiny_models import padded_batch, tiny_model

    block = next(b for b in _python_blocks() if "patch_activations(model)" in b)
    model = tiny_model("llama")
    ns = {"x": torch.randn(5, 8), "weight": torch.randn(6, 8), "bias": torch.randn(6), "model": model}
    exec(block, ns)
    # the last line unpatched everything again; the model still trains
    assert patched_layers(model) == {} and patched_activations(model) == []
    model(**padded_batch("llama")).loss.backward()
