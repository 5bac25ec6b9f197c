"""The notebooks run top to bottom (on the bundled offline assets, smaller workloads than their own)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))

# Each notebook with a workload sets it in its one cell tagged "parameters"; here it runs on these values instead,
# set by a cell right after that one (as papermill injects parameters): every cell after it runs as written.
SMALL = {
    "01_tour.ipynb": {"batch_size": 8, "max_length": 32, "max_batches": 2},
    "02_eps_and_topn.ipynb": {"batch_size": 4, "max_length": 32},
    "03_finetune.ipynb": {"max_samples": 64, "batch_size": 4, "max_length": 32, "max_steps": 4, "eval_steps": 2,
                          "eval_samples": 8, "sft_samples": 16, "sft_steps": 2},
}


def _assigned(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def with_parameters(nb, values: dict):
    """``nb`` with a cell setting ``values`` after its cell tagged "parameters" (each value one that cell sets)."""
    import nbformat

    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{len(tagged)} cells tagged parameters"
    unknown = set(values) - _assigned(nb.cells[tagged[0]].source)
    assert not unknown, f"the parameters cell does not set {sorted(unknown)}"
    code = "\n".join(f"{k} = {v!r}" for k, v in values.items())
    nb.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(code, metadata={"tags": ["injected-parameters"]}))
    return nb


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(path, as_version=4)
    if path.name in SMALL:
        nb = with_parameters(nb, SMALL[path.name])
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors


def test_there_is_a_notebook():
    assert NOTEBOOKS


def test_the_notebooks_with_a_workload_take_the_smaller_one():
    """Every notebook with a parameters cell has its smaller workload here, and the injected cell comes right
    after that cell, where the later cells read it."""
    import nbformat

    tagged = {p.name for p in NOTEBOOKS
              if any("parameters" in c.get("metadata", {}).get("tags", []) for c in nbformat.read(p, 4).cells)}
    assert tagged == set(SMALL)
    nb = with_parameters(nbformat.read(NOTEBOOKS[0], 4), {"max_batches": 1})
    i = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    assert nb.cells[i + 1].source == "max_batches = 1"
    with pytest.raises(AssertionError, match="does not set"):
        with_parameters(nbformat.read(NOTEBOOKS[0], 4), {"no_such_setting": 1})
