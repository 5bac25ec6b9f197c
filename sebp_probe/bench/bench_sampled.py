"""The whole-model bench's ``sampled`` method (opt-in: ``--methods sampled`` or ``sampled:labelled``): the SEBP
entry's linears in sampled mode (:mod:`sebp_kernels.sampling`, approximate), each layer drawing its rows with the
``budget`` (``auto`` by default, or a share in (0, 1]) from its first backward on, no warm-up. The entry's row
gives the share of the non-zero rows of dL/dY its linears skipped in dW over the timed and warm-up steps
(``sampled_rows``). On a GPU sampled mode runs on the Triton kernels (each layer's first backward, which solves
its cutoff, through torch); a whole step of it is not timed as CUDA graphs: its capture is tested on one layer
only (tests/kernels/test_sampled_gpu.py)."""
from __future__ import annotations

import contextlib

from sebp_kernels import SEBPConfig

from ..families import FAMILIES
from ..model.sampled import sampled_summary

VARIANTS = (("sampled", "full"), ("sampled", "labelled"))
METHODS = ("sampled",)  # not among the bench's default methods: asked for by name
GRAPHS_REASON = "sampled mode's CUDA-graph capture of a whole step is not tested"


def sampled_config(budget: float | str = "auto", seed: int = 0) -> SEBPConfig:
    """The bench's sampled-mode setting: ``budget`` (``auto`` or a share in (0, 1]), the draws from ``seed``."""
    return SEBPConfig("sampled", budget=budget, seed=seed)


@contextlib.contextmanager
def sampled_patched(model, case, head: str, counts: dict, budget: float | str = "auto", seed: int = 0,
                    pad_rows: bool = True):
    """``model`` with the SEBP entry's linears (every attention and MLP projection; a decoder's LM head under the
    full head) in sampled mode within the block; ``counts[f"sampled {head}"]`` gets their count and, summed over
    the blocks of the entry, the rows they sampled."""
    from ..model.patch import patch_sebp, unpatch_model

    targets = None if case.task == "classification" else \
        FAMILIES[case.arch].targets + (("lm_head",) if head == "full" else ())
    names = patch_sebp(model, sampled_config(budget, seed), target_modules=targets, pad_rows=pad_rows)
    mine = counts.setdefault(f"sampled {head}", {"linears": len(names["linears"]), "norms": 0, "acts": 0,
                                                  "budget": budget, "rows": 0, "nonzero": 0, "kept": 0})
    try:
        yield model
    finally:
        smp = sampled_summary(model) or {}
        for k in ("rows", "nonzero", "kept"):
            mine[k] += smp.get(k, 0)
        mine["skipped_of_nonzero"] = 1 - mine["kept"] / mine["nonzero"] if mine["nonzero"] else None
        unpatch_model(model)
