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


def sampled_config(budget: float | str = "auto", seed: int = 0, sample_dx: bool = False) -> SEBPConfig:
    """The bench's sampled-mode setting: ``budget`` (``auto`` or a share in (0, 1]), the draws from ``seed``,
    dX from the sample too with ``sample_dx``."""
    return SEBPConfig("sampled", budget=budget, seed=seed, sample_dx=sample_dx)


@contextlib.contextmanager
def sampled_patched(model, case, head: str, counts: dict, budget: float | str = "auto", seed: int = 0,
                    pad_rows: bool = True, sample_dx: bool = False):
    """``model`` with the SEBP entry's linears (every attention and MLP projection; a decoder's LM head under the
    full head) in sampled mode within the block; ``counts[f"sampled {head}"]`` gets their count and, summed over
    the blocks of the entry, the rows they sampled."""
    from ..model.patch import patch_sebp, unpatch_model

    targets = None if case.task == "classification" else \
        FAMILIES[case.arch].targets + (("lm_head",) if head == "full" else ())
    names = patch_sebp(model, sampled_config(budget, seed, sample_dx), target_modules=targets, pad_rows=pad_rows)
    mine = counts.setdefault(f"sampled {head}", {"linears": len(names["linears"]), "norms": 0, "acts": 0,
                                                  "budget": budget, "sample_dx": sample_dx, "rows": 0,
                                                  "nonzero": 0, "kept": 0})
    try:
        yield model
    finally:
        smp = sampled_summary(model) or {}
        for k in ("rows", "nonzero", "kept"):
            mine[k] += smp.get(k, 0)
        mine["skipped_of_nonzero"] = 1 - mine["kept"] / mine["nonzero"] if mine["nonzero"] else None
        unpatch_model(model)


def bench_layer_sampled(shape, densities, dtype, budget: float, repeats: int = 30, seed: int = 0,
                        progress=None) -> list:
    """``bench --scope layers --mode sampled``: one linear layer's backward in sampled mode at a fixed
    ``budget`` (its Triton path: dW and db over the kept rows, dX exact or, ``_dx``, sampled too) against the
    dense one, at each density of non-padding rows. Each is timed as a CUDA-graph replay (the GPU's work alone)
    and eagerly (``_eager``: one call's launches from the host, with the GPU idle before it, so a host slower
    than the GPU shows). dY's rows have log-normal norms (sigma 1.5), so the keep probabilities spread."""
    import torch

    from sebp_kernels._triton.sampled import sampled_backward_triton
    from sebp_kernels.sampling import SampleState

    from .bench import LayerResult, dense_backward, layer_setup, padded_rows, time_methods

    dev, g, x, w, flush = layer_setup(shape, dtype, seed)
    m, n_out = shape.rows, shape.out_features
    spread = torch.exp(1.5 * torch.randn(m, 1, device=dev, generator=g))
    dy_full = (torch.randn(m, n_out, device=dev, generator=g) * spread).to(dtype)
    results = []
    for density in densities:
        mask = padded_rows(m, shape.seq, density, dev)
        dy = dy_full * mask.unsqueeze(1).to(dtype)
        bias = shape.bias

        def dense():
            return dense_backward(dy, x, w, bias)

        def sampled(sample_dx: bool):
            cfg, state = sampled_config(budget, seed, sample_dx), SampleState(1)
            return lambda: sampled_backward_triton(dy, x, w, cfg, state, need_db=bias)

        methods = {"dense": (dense, True), "sampled": (sampled(False), True), "sampled_dx": (sampled(True), True),
                   "dense_eager": (dense, False), "sampled_eager": (sampled(False), False),
                   "sampled_dx_eager": (sampled(True), False)}
        res = LayerResult(shape, density, int(mask.sum()))
        if progress:
            progress(f"{shape.name} d={density:g} sampled {budget:g}")
        res.ms = {name: round(ms, 5) for name, ms in time_methods(methods, repeats, flush).items()}
        results.append(res)
    return results
