"""tests.helpers.run_torchrun, which every multi-process test uses: a failing rank's own stderr in the
assertion (with its Python stack where a signal killed it), and a hang named by the rank still running when the
timeout stops it."""
from __future__ import annotations

import os
import sys

import pytest

from tests.helpers import run_torchrun

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # two processes each: run apart from the xdist workers

WORKER = """
import os, sys, time
rank = int(os.environ["RANK"])
print(f"rank {rank} started", file=sys.stderr, flush=True)
if rank == 1:
    print("rank 1 gives up here", file=sys.stderr, flush=True)
    {action}
"""


def _worker(tmp_path, action: str) -> str:
    path = tmp_path / "worker.py"
    path.write_text(WORKER.replace("{action}", action))
    return str(path)


def test_a_failing_rank_is_named_with_its_own_stderr(tmp_path):
    with pytest.raises(pytest.fail.Exception) as err:
        run_torchrun([_worker(tmp_path, "os.abort()")], 120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    msg = str(err.value)
    assert msg.startswith("torchrun exited 1; failed rank(s): 1"), msg
    assert "-- rank 1's last lines of stderr:" in msg and "[default1]:rank 1 gives up here" in msg, msg
    assert "SIGABRT" in msg, msg
    # where in Python it was when it died (faulthandler): the worker's line that aborted
    assert "Fatal Python error: Aborted" in msg and 'worker.py", line 7' in msg, msg


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the running ranks are read from /proc")
def test_a_hang_names_the_rank_still_running(tmp_path):
    with pytest.raises(pytest.fail.Exception) as err:
        run_torchrun([_worker(tmp_path, "time.sleep(600)")], 10, env={**os.environ, "OMP_NUM_THREADS": "1"})
    msg = str(err.value)
    assert msg.startswith("torchrun hung: no exit within 10 s; rank(s) still running: 1"), msg
    assert "[default1]:rank 1 gives up here" in msg, msg


def test_a_run_that_passes_returns_the_ranks_stdout_unprefixed(tmp_path):
    out, err = run_torchrun([_worker(tmp_path, "print('done', flush=True)")], 120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.splitlines().count("done") == 1 and "[default0]:rank 0 started" in err
