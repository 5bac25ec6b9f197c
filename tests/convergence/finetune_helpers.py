"""Synthetic token data and test isolation for fine-tuning tests (no tokenizer, no downloads)."""
from __future__ import annotations

import random

import pytest

from sebp_probe.data.train_data import TrainData


def synthetic_data(task: str, n: int = 96, n_eval: int = 32, max_len: int = 24, min_len: int = 4,
                   vocab: int = 120, seed: int = 0, prompt: float = 0.0) -> TrainData:
    """Random token sequences of random length; the class is the first token mod 3 (learnable). Causal LM:
    the first ``prompt`` share of each sequence's tokens carries label -100 (a prompt, as in SFT). Masked LM:
    token 3 is the mask token, 0-2 are special."""
    rng = random.Random(seed)

    def item():
        ids = [rng.randint(3, vocab - 1) for _ in range(rng.randint(min_len, max_len))]
        if task == "classification":
            return {"input_ids": ids, "label": ids[0] % 3}
        cut = int(len(ids) * prompt)
        return {"input_ids": ids, "labels": [-100] * cut + ids[cut:]}

    names = ["a", "b", "c"] if task == "classification" else []
    return TrainData(task, [item() for _ in range(n)], [item() for _ in range(n_eval)], pad_id=0,
                     label_names=names, identity={"synthetic": True, "seed": seed},
                     mlm=(3, vocab, (0, 1, 2)) if task == "mlm" else ())


@pytest.fixture(autouse=True)
def isolated_accelerate():
    """A fresh accelerate state per test (tests/conftest.py already runs one torch thread)."""
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
