"""benchmarks/jit_log.py: the lines it logs for a Triton compile, from what Triton's JIT hook passes."""
from __future__ import annotations

import sys

import pytest

from tests.helpers import load_benchmark


@pytest.fixture(scope="module")
def script():
    yield load_benchmark("jit_log")
    sys.modules.pop("jit_log", None)


def test_a_compile_line_names_the_variant_and_for_the_gradient_kernel_what_was_specialised(script):
    names = {0: "count_ptr", 1: "DB_COLS", 2: "BLOCK_M", 3: "DO_DB"}
    info = {"num_warps": 8, "num_stages": 3, "constants": {(2,): 128, (3,): False},
            "configs": [{(0,): [["tt.divisibility", 16]], (1,): []}], "signature": {0: "*i32", 1: "i32"}}
    head, attrs, sig = script.compile_line("_grads_kernel", 12.34, info, names)
    assert head == "JIT    12.3s _grads_kernel warps=8 stages=3 {'BLOCK_M': 128, 'DO_DB': False}"
    assert attrs == "   ATTRS {'count_ptr': [['tt.divisibility', 16]], 'DB_COLS': []}"
    assert sig == "   SIG {'count_ptr': '*i32', 'DB_COLS': 'i32'}"
    plain = script.compile_line("_ce_kernel", 1.0, {"num_warps": 4}, {})
    assert plain == ["JIT     1.0s _ce_kernel warps=4 stages=None {}"]
