"""Device helpers shared by the GEMM kernels."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, ROWS, COLS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program ``pid`` over a ROWS x COLS output in grouped order: GROUP_M row tiles are
    walked together, so neighbouring programs share operand tiles in L2."""
    num_m = tl.cdiv(ROWS, BLOCK_M)
    num_n = tl.cdiv(COLS, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % group) % size_m, (pid % group) // size_m
