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
    assert len(blocks) >= 1
    for block in blocks:
        compile(block, "README.md", "exec")
        imports = "\n".join(line for line in block.splitlines() if line.startswith(("import ", "from ")))
        exec(imports, {})


def test_python_api_example_runs_on_a_tiny_llama():
    from sebp_probe import patched_layers
    from tests.tiny_models import padded_batch, tiny_model

    block = next(b for b in _python_blocks() if "patch_model(model" in b)
    model = tiny_model("llama")
    labels = torch.randint(0, 6, (5,))
    labels[1] = -100
    ns = {"x": torch.randn(5, 8, requires_grad=True), "weight": torch.randn(6, 8), "bias": torch.randn(6),
          "model": model, "hidden": torch.randn(5, 8, requires_grad=True), "labels": labels}
    exec(block, ns)
    ns["y"].sum().backward()
    ns["loss"].backward()
    assert ns["names"] and ns["hidden"].grad[1].abs().sum() == 0  # the label -100 row gets no gradient
    # the last line unpatched everything again; the model still trains
    assert patched_layers(model) == {}
    model(**padded_batch("llama")).loss.backward()


def test_quick_start_is_the_ci_command():
    """The README's two commands are what a new user runs; CI runs the second one as written."""
    text = README.read_text()
    assert "python3 bootstrap.py analyze" in text and "python3 bootstrap.py test" in text
    ci = (README.parent / ".ci" / "run").read_text()
    assert "python3 bootstrap.py test" in ci
