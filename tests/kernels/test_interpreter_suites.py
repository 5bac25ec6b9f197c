"""The kernels' tests that run under the Triton interpreter (CPU tensors), all in one pytest subprocess.

TRITON_INTERPRET must be set before the kernels are decorated, and the other tests have imported them already,
so the files below define their interpreter cases only when the variable is set, and a normal run hands them to
one subprocess that has it (one, not one per file: each start imports torch, transformers and Triton again).
Run a file with TRITON_INTERPRET=1 yourself to see its cases one by one.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run_under_interpreter

HERE = Path(__file__).parent

SUITES = ("test_activations.py", "test_conv1d_interp.py", "test_forward_rows.py", "test_linear_ce_interp.py",
          "test_norms.py", "test_pad_rows.py", "test_resprop_interp.py", "test_rowstats_interp.py",
          "test_sampled_triton.py", "test_traced_grads.py", "test_triton_interp.py", "test_zero_rows.py")
# read TRITON_INTERPRET without interpreter cases of their own (the layering, a launch detail, a lowering check)
NOT_UNDER = ("test_functional.py", "test_launch.py", "test_traced_lowering.py")


def test_every_file_that_reads_the_variable_is_listed():
    reads = {p.name for p in HERE.glob("test_*.py") if "INTERPRET" in p.read_text() and p.name != Path(__file__).name}
    assert reads == set(SUITES) | set(NOT_UNDER), "list the file in SUITES (its interpreter cases) or NOT_UNDER"


@pytest.mark.slow
def test_interpreter_suite():
    run_under_interpreter(*(HERE / name for name in SUITES))
