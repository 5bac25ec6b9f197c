"""The training run reads top to bottom: no function of the loop, its step or the fine-tuning entry point is
longer than about a screen (issue: `Run._train` had grown to 189 lines)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 60
MODULES = ("loop", "finetune", "strategy", "train_step")


def _long_functions(source: str, limit: int = MAX_LINES) -> list[str]:
    """'name (N lines)' of every function or method in ``source`` longer than ``limit`` lines."""
    return [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit]


@pytest.mark.parametrize("module", MODULES)
def test_no_function_of_the_training_run_is_longer_than_a_screen(module):
    path = next((ROOT / "sebp_probe").rglob(f"{module}.py"))  # wherever a subpackage puts it
    assert _long_functions(path.read_text()) == [], f"{path.relative_to(ROOT)}: split these into named steps"


def test_a_long_function_is_found():
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_LINES))  # with its def: one line too many
    assert _long_functions(f"class A:\n    def short(self):\n        pass\n\n    def long(self):\n{body}\n") == \
        [f"long ({MAX_LINES + 1} lines)"]
    fits = body[:body.rindex("\n")]
    assert _long_functions(f"class A:\n    def fits(self):\n{fits}\n") == []
