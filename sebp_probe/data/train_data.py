"""Training data of a fine-tune: tokenized examples, their order, and the batches the loop and calibration see.

Data order is a pure function of (seed, epoch, micro-batch index): a resumed run skips to the same place.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .assets import AssetError, LoadedModel

from .batching import COMPILE_MULTIPLE, LengthGroupedBatchSampler, PadCollator, collator, lengths, padded_length
from ..config import FinetuneConfig, FinetuneError
from ..layouts import LAYOUTS
from .mlm import MLMCollator
from .textdata import BUNDLED_DATASETS, load_text_data, padding_side, tokenize


@dataclass
class TrainData:
    """Tokenized, unpadded examples ({input_ids, label} or {input_ids, labels}) and how to pad them; ``mlm``:
    (mask token id, vocabulary size, special token ids) for masked-LM batches."""

    task: str
    train: list[dict]
    eval: list[dict]
    pad_id: int
    padding_side: str = "right"
    label_names: list[str] = field(default_factory=list)
    identity: dict = field(default_factory=dict)
    mlm: tuple = ()


def load_train_data(cfg: FinetuneConfig, loaded: LoadedModel) -> TrainData:
    """Train and held-out examples of ``cfg.data``: ``eval_split`` if given, the bundled test split of
    ``tweets``, else a deterministic 10% of the training split with repeated texts dropped first; at most
    ``eval_samples`` of them."""
    data = load_text_data(cfg.data, loaded.task)
    if cfg.data.eval_split or cfg.data.dataset in BUNDLED_DATASETS:
        held = load_text_data(replace(cfg.data, max_samples=None), loaded.task,  # --eval-samples caps this one
                              split=cfg.data.eval_split or "test", label_names=data.label_names or None)
    else:  # a held-out tenth of the data: without repeated texts, or it would hold training rows
        data, held = data.deduplicated().split_off(0.1, seed=cfg.seed)
    if cfg.eval_samples is not None:
        held.examples = held.examples[: cfg.eval_samples]
    train, ev = tokenize(loaded, data, cfg.data.max_length), tokenize(loaded, held, cfg.data.max_length)
    if not train or not ev:
        raise AssetError(f"dataset {cfg.data.dataset!r} has no non-empty text to train or evaluate on")
    side = padding_side(loaded, cfg.data)
    identity = {"train": data.identity, "eval": held.identity}
    vocab = loaded.model.get_input_embeddings().num_embeddings
    top = max(max(it["input_ids"]) for it in (*train, *ev) if it["input_ids"])
    if top >= vocab:  # a tokenizer with tokens the model has no embedding (and, as labels, no logit) for
        raise AssetError(f"token id {top} is outside the model's vocabulary of {vocab}: the tokenizer does not "
                         "belong to this model (resize its embeddings, or pick the matching tokenizer)")
    tok = loaded.tokenizer
    mlm = (tok.mask_token_id, len(tok), tuple(tok.all_special_ids)) if loaded.task == "mlm" else ()
    return TrainData(loaded.task, train, ev, tok.pad_token_id, side, data.label_names, identity, mlm)


class EpochSampler(torch.utils.data.Sampler):
    """A fresh permutation per epoch, a pure function of (seed, epoch), so a resumed run replays it."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


def pad_multiple(cfg: FinetuneConfig) -> int:
    """What a run's padded lengths are a multiple of: CUDA graphs, ``graph_bucket`` (few batch shapes); a compiled
    run, :data:`~.batching.COMPILE_MULTIPLE` (no length that recompiles); else 1."""
    return cfg.graph_bucket if cfg.cuda_graphs else COMPILE_MULTIPLE if cfg.compile else 1


def most_rows(cfg: FinetuneConfig, data: TrainData, padding: str | None = None) -> int:
    """The most rows (sequences x length) a training micro-batch of ``padding`` (the run's by default) can have:
    the batch size times ``max_length`` where every batch has one shape, else times the longest training
    example as its batches pad it (at most ``max_length``). What a compiled run tells its layers
    (:func:`~sebp_probe.train.compiling.compile_layers`): a bound as loose as ``max_length`` would have short
    texts (tweets under a max length of 128) call an SEBP forward operator that never pays on their batches."""
    if LAYOUTS[padding or cfg.data.padding].one_shape:
        return cfg.data.batch_size * cfg.data.max_length
    longest = min(max(lengths(data.train), default=1), cfg.data.max_length)
    return cfg.data.batch_size * padded_length(longest, cfg.data.max_length, pad_multiple(cfg))


def make_loaders(cfg: FinetuneConfig, data: TrainData, pin: bool = False):
    """(train loader, eval loader, sampler) for ``cfg.data.padding`` (a layout of :data:`.layouts.LAYOUTS`, not
    ``auto``): the sampler has ``set_epoch``. Evaluation batches are padded as the layout pads (packed runs: to
    the longest). ``pin``: batches in page-locked memory (on a GPU), so that their copy to the device does not
    wait for the work already queued there (a copy from pageable memory does)."""
    layout = LAYOUTS.get(cfg.data.padding)
    if layout is None:
        raise FinetuneError(f"padding {cfg.data.padding!r} is not a batch layout; 'auto' is resolved before training")
    multiple = pad_multiple(cfg)

    def mlm(collate):
        return MLMCollator(collate, *data.mlm, seed=cfg.seed) if data.task == "mlm" else collate

    # Own generators: creating a loader iterator must not draw from the global RNG (it holds dropout's state).
    gen = lambda: torch.Generator().manual_seed(cfg.seed)  # noqa: E731
    bs = cfg.data.batch_size
    # the labelled-rows head reads its rows' counts from the batch (ints), not the device: no host sync, and
    # compiled steps trace it without a graph break
    collate = collator(layout, data.pad_id, data.task, cfg.data.max_length, data.padding_side, multiple,
                       counts=True)
    collate = collate if layout.packed else mlm(collate)  # packed rows train no masked LM (check_packable)
    if layout.grouped:
        sampler = LengthGroupedBatchSampler(lengths(data.train), bs, cfg.seed)
        train = torch.utils.data.DataLoader(data.train, batch_sampler=sampler, collate_fn=collate,
                                            generator=gen(), pin_memory=pin)
    else:
        sampler = EpochSampler(len(data.train), cfg.seed)
        train = torch.utils.data.DataLoader(data.train, batch_size=bs, sampler=sampler, collate_fn=collate,
                                            generator=gen(), pin_memory=pin)
    pad_eval = PadCollator(data.pad_id, data.task, layout.eval_pad_to, cfg.data.max_length, data.padding_side,
                           multiple)
    ev = torch.utils.data.DataLoader(data.eval, batch_size=bs, shuffle=False, collate_fn=mlm(pad_eval),
                                     generator=gen(), pin_memory=pin)
    return train, ev, sampler


def to_device(batch: dict, device: torch.device) -> dict:
    """The batch's tensors on ``device`` (a packed batch also holds a plain int)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def first_batches(cfg: FinetuneConfig, data: TrainData, device: torch.device, n: int | None = None) -> list[dict]:
    """The first ``n`` (default ``cfg.calib_batches``, at least 1) training batches of epoch 0, on ``device``."""
    loader, _, sampler = make_loaders(cfg, data)
    sampler.set_epoch(0)
    out = []
    for b in loader:
        out.append(to_device(b, device))
        if len(out) >= max(1, n or cfg.calib_batches):
            break
    return out
