"""The sampled-mode state of a model's SEBP linears: reset, saved and restored with a run's checkpoints, and
their counters summed into the share of backward rows the sampling skipped (``--mode sampled``)."""
from __future__ import annotations

import torch

from sebp_kernels import SEBPLinear


def sampled_layers(model: torch.nn.Module) -> dict[str, SEBPLinear]:
    """Name -> SEBP linear of ``model`` running ``sampled`` mode."""
    return {n: m for n, m in model.named_modules()
            if isinstance(m, SEBPLinear) and m.sebp_config.mode == "sampled"}


def reset_samplers(model: torch.nn.Module) -> int:
    """Every sampled layer back to a fresh state (no cutoff, no backward counted): after calibration's passes,
    so that a run's draws start at its first training step; returns how many."""
    layers = sampled_layers(model)
    for m in layers.values():
        m._sebp_sampler.reset()
    return len(layers)


def sampler_states(model: torch.nn.Module) -> dict[str, dict]:
    """Name -> :meth:`~sebp_kernels.sampling.SampleState.state_dict` of each sampled layer (JSON-able; reads the
    device: at a checkpoint)."""
    return {n: m._sebp_sampler.state_dict() for n, m in sampled_layers(model).items()}


def load_sampler_states(model: torch.nn.Module, states: dict[str, dict]) -> None:
    """Restore :func:`sampler_states` (a resumed run continues the draws and cutoffs where it stopped)."""
    layers = sampled_layers(model)
    for name, d in states.items():
        if name in layers:
            m = layers[name]
            m._sebp_sampler.load_state_dict(d, m.weight.device)


def sampled_summary(model: torch.nn.Module, guard: dict | None = None) -> dict | None:
    """The sampled layers' rows over the run's sampled backwards (warm-up left out): all of dY's rows, the
    non-zero ones, those kept for dW, the shares skipped, and each layer's share of its non-zero rows kept;
    ``guard``: the exact-gradient guard's summary (:func:`~sebp_probe.train.sample_guard.guard_summary`). None
    without a sampled layer."""
    layers = sampled_layers(model)
    if not layers:
        return None
    totals = {"rows": 0, "nonzero": 0, "kept": 0}
    kept_share = {}
    for name, m in layers.items():
        c = m._sebp_sampler.counts()
        for k, v in c.items():
            totals[k] += v
        kept_share[name] = c["kept"] / c["nonzero"] if c["nonzero"] else None
    cfg = next(iter(layers.values())).sebp_config
    rows, nz, kept = totals["rows"], totals["nonzero"], totals["kept"]
    budget = cfg.budget if cfg.budget == "auto" else float(cfg.budget)
    return {"approximate": True, "layers": len(layers), "budget": budget, "variance_tau": cfg.variance_tau,
            "sample_dx": cfg.sample_dx, "warmup_backwards": cfg.warmup, **totals,
            "skipped_of_nonzero": 1 - kept / nz if nz else None, "skipped_of_rows": 1 - kept / rows if rows else None,
            "kept_share_by_layer": kept_share, **({"guard": guard} if guard else {})}
