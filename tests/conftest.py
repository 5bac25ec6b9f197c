import gc
import os

import pytest
import torch

# One thread per process, here and in the processes tests start: the models are tiny, and on a machine with
# two cores, several processes with two threads each (DDP tests, the interpreter suites) spin against each
# other; a tiny forward+backward took seconds instead of milliseconds that way.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


# Set by `bootstrap.py test` for its xdist run: the tests that start several processes (marker multiprocess)
# are left out of it and run after it, alone (on 2 cores, a torchrun child once died with SIGABRT while the
# xdist workers ran other tests beside it).
APART = "SEBP_MULTIPROCESS_APART"


def pytest_collection_modifyitems(config, items):
    # The interpreter suite (one subprocess for every file with interpreter cases, about six minutes on 2 cores)
    # goes first: xdist splits the list into one run of tests per worker and a worker that is done takes from the
    # end of another's, so a long test left at the end of a run keeps one worker busy while the other has nothing
    # left to take.
    items.sort(key=lambda item: item.name != "test_interpreter_suite")
    if os.environ.get(APART) == "1":
        apart = [item for item in items if "multiprocess" in item.keywords]
        if apart:
            config.hook.pytest_deselected(items=apart)
            items[:] = [item for item in items if "multiprocess" not in item.keywords]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Every module the tests import is loaded now (torch, transformers, the tests'): those objects live as long
    as the process, so the cyclic garbage collector need not walk them again. Frozen, a full collection walks
    only what the tests create: ``gc.collect()``, which the runs call when they free a model (a --compare's
    first run, accelerate's free_memory), took about 0.3 s of CPU each over the imported half million objects,
    a few milliseconds after this."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True, scope="module")
def _freeze_survivors():
    """After each test module, collect and freeze what is still alive (Dynamo's caches of the compiled tests
    and other objects that live as long as the process): the runs that call ``gc.collect()`` walk only what
    the next module creates. Without it an xdist worker that had run the compile tests spent three times the
    CPU on the later fine-tuning tests (tests/convergence/test_finetune_convergence.py: 77 s against 26)."""
    yield
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()  # the interpreter's own teardown sees every object again


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _precision_flags() -> list[tuple[object, str]]:
    """Where torch keeps float32 matmul/conv precision: the fp32_precision settings (torch >= 2.9; the legacy
    flags may not be read then) or the legacy allow_tf32 flags."""
    if hasattr(torch.backends, "fp32_precision"):
        return [(o, "fp32_precision") for o in (torch.backends, torch.backends.cuda.matmul, torch.backends.cudnn)
                if hasattr(o, "fp32_precision")]
    return [(torch.backends.cuda.matmul, "allow_tf32"), (torch.backends.cudnn, "allow_tf32")]


@pytest.fixture(autouse=True)
def _tf32_as_before():
    """TrainingArguments(torch_compile=True) on a GPU turns TF32 on for the whole process (transformers'
    enable_tf32), and the Trainer integration's tests build such arguments; later tests compare fp32 results
    (on an H100 the padding-rows model test, run after them, failed by 1e-4): every test starts from the
    process's settings."""
    flags = _precision_flags()
    saved = [getattr(o, name) for o, name in flags]
    yield
    for (o, name), value in zip(flags, saved):
        setattr(o, name, value)
