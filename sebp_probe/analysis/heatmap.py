"""Pictures of chosen layers' |dL/dY|: the statistics of a few batches and the full gradient of a small one.

No CLI code here; :mod:`sebp_probe.cli` only parses, calls and prints (:mod:`sebp_probe.analysis.plots` draws).
"""
from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial

import numpy as np
import torch
from torch import nn

from .analyze import AnalyzeSettings, Progress, _to_device, collect, load_assets, padding_info, resolve_device
from .knee import EpsResult, detect_eps
from ..notes import collect_notes, note
from ..model.linears import is_linear
from ..model.patch import _logical_name, name_matches


@contextlib.contextmanager
def capture_output_grads(model: nn.Module, names: list[str]):
    """Copy dL/dY of the named linears to the host (float32), for pictures of small batches only.

    Yields a dict name -> tensor of shape (*output shape), filled during the backward.
    """
    modules = dict(model.named_modules())
    captured: dict[str, torch.Tensor] = {}
    handles = []

    def on_forward(name, module, args, output):
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda g: captured.__setitem__(name, g.detach().float().cpu()))

    try:
        for name in names:
            real = name if is_linear(modules.get(name)) else f"{name}.base_layer"
            if real not in modules:
                raise ValueError(f"layer {name!r} is not in this model")
            handles.append(modules[real].register_forward_hook(partial(on_forward, name)))
        yield captured
    finally:
        for h in handles:
            h.remove()


def match_layers(model: nn.Module, pattern: str) -> list[str]:
    """Logical names of the linear layers (nn.Linear, Conv1D) matching a glob (``*.11.*.query``), an exact name,
    a dotted suffix or a regex. Raises ValueError when none matches."""
    names = [_logical_name(n) for n, m in model.named_modules() if is_linear(m)]
    hits = [n for n in names if fnmatch.fnmatchcase(n, pattern) or name_matches(n, pattern)]
    if not hits:
        sample = ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
        raise ValueError(f"layer pattern {pattern!r} matches no linear layer (they are named like {sample})")
    return hits


@dataclass
class LayerPicture:
    """What one heatmap figure row shows for a layer."""

    name: str
    samples: list[np.ndarray]  # |dL/dY| per sample: (padded tokens, features)
    lengths: list[int]  # real tokens of each sample
    padding_side: str
    element_hist: np.ndarray
    row_hist: np.ndarray
    eps: EpsResult
    zero_elements: float  # exact fractions over the analysed batches
    zero_rows: float
    labels: list[str] = field(default_factory=list)


def heatmap_data(model: nn.Module, batches: list[dict], sample_batch: dict, layers: list[str],
                 settings: AnalyzeSettings, padding_side: str = "right",
                 progress: Progress | None = None) -> list[LayerPicture]:
    """Statistics over ``batches`` and the full |dL/dY| of the (small) ``sample_batch`` for ``layers``."""
    s = AnalyzeSettings(**{**asdict(settings), "target_modules": tuple(layers), "exclude_modules": None})
    stats = collect(model, batches, s, total=len(batches), progress=progress)
    device = next(model.parameters()).device
    sample_batch = _to_device(sample_batch, device)
    was_training = model.training
    model.train(settings.train_mode)
    try:
        with capture_output_grads(model, layers) as dy:
            model(**sample_batch).loss.backward()
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    lengths = sample_batch["attention_mask"].sum(dim=1).tolist()
    out = []
    for name in layers:
        lay = stats.layers[name]
        g = dy[name].abs().numpy()
        g = g.reshape(len(lengths), -1, g.shape[-1])
        out.append(LayerPicture(name=name, samples=[g[i] for i in range(len(lengths))], lengths=lengths,
                                padding_side=padding_side, element_hist=lay.element_hist, row_hist=lay.row_hist,
                                eps=detect_eps(lay.row_hist, min_gap_decades=settings.min_gap_decades),
                                zero_elements=sum(lay.zero_elements) / max(sum(lay.elements), 1),
                                zero_rows=sum(lay.zero_rows) / max(sum(lay.rows), 1)))
    return out


MAX_HEATMAP_LAYERS = 6


def heatmaps(
    model_name: str,
    data_cfg,
    layer_pattern: str,
    settings: AnalyzeSettings = AnalyzeSettings(max_batches=4),
    task: str | None = None,
    device: str | None = None,
    progress: Progress | None = None,
    on_note: Callable[[str], None] | None = None,
) -> tuple[list[LayerPicture], dict]:
    """Pictures of the layers matching ``layer_pattern``: the shortest and the longest of the analysed
    samples, and the statistics of ``settings.max_batches`` batches. Returns (pictures, model info); every
    note (:mod:`.notes`) goes to ``on_note`` as it is said and into the info's ``notes``."""
    with collect_notes(on_note) as notes:
        pictures, info = _heatmaps(model_name, data_cfg, layer_pattern, settings, task, device, progress)
    return pictures, {**info, "notes": notes}


def _heatmaps(model_name, data_cfg, layer_pattern: str, settings: AnalyzeSettings, task: str | None,
              device: str | None, progress: Progress | None) -> tuple[list[LayerPicture], dict]:
    from ..data.textdata import make_loader, tokenize

    loaded, data, cfg = load_assets(model_name, data_cfg, settings.max_batches, task)
    for line in data.identity.get("notes", []):
        note(line)
    layers = match_layers(loaded.model, layer_pattern)
    if len(layers) > MAX_HEATMAP_LAYERS:
        raise ValueError(f"layer pattern {layer_pattern!r} matches {len(layers)} layers; narrow it to at most "
                         f"{MAX_HEATMAP_LAYERS} (e.g. add a layer index)")
    loaded.model.to(resolve_device(device))
    loader = make_loader(loaded, data, cfg)
    items = tokenize(loaded, data, cfg.max_length)
    lengths = [len(it["input_ids"]) for it in items]
    pick = [int(np.argmin(lengths)), int(np.argmax(lengths))]
    sample_batch = loader.collate_fn([items[i] for i in pick])
    batches = [b for _, b in zip(range(settings.max_batches or len(loader)), loader)]
    side = padding_info(loaded, cfg)["padding_side"]
    pictures = heatmap_data(loaded.model, batches, sample_batch, layers, settings, side, progress)
    for p in pictures:
        p.labels = ["shortest", "longest"]
    return pictures, {"name": loaded.name, "data": cfg.dataset, "padding": padding_info(loaded, cfg)}
