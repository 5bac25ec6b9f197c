"""Masked-language-modelling batches: the standard 15% masking, seeded.

Of the positions that are neither padding nor special tokens, each is chosen with probability 15%; a chosen
position keeps its token as the label and gets the mask token (80%), a random token (10%) or its own token
(10%); every other position has label -100. The draws come from a ``torch.Generator``, so a seed gives the same
batches on every run.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable

import torch

IGNORE_INDEX = -100


def mask_tokens(
    input_ids: torch.Tensor,
    *,
    mask_token_id: int,
    vocab_size: int,
    special_ids: Iterable[int] = (),
    attention_mask: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    probability: float = 0.15,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(masked input ids, labels) for ``input_ids`` (a new tensor; the input is left as it is).

    Padding (``attention_mask`` 0) and tokens in ``special_ids`` are never chosen. Random replacements are
    drawn uniformly from [0, vocab_size). The generator must live on ``input_ids``' device (CPU by default).
    """
    if not 0.0 <= probability <= 1.0:
        raise ValueError(f"masking probability must be in [0, 1], got {probability}")
    ids = input_ids.clone()
    eligible = ~torch.isin(ids, torch.tensor(sorted(set(special_ids)), dtype=ids.dtype, device=ids.device))
    if attention_mask is not None:
        eligible &= attention_mask.bool()

    def draw(p: float) -> torch.Tensor:
        return torch.rand(ids.shape, generator=generator, device=ids.device) < p

    chosen = draw(probability) & eligible
    labels = torch.where(chosen, ids, torch.full_like(ids, IGNORE_INDEX))
    to_mask = chosen & draw(0.8)
    to_random = chosen & ~to_mask & draw(0.5)
    ids[to_mask] = mask_token_id
    ids[to_random] = torch.randint(vocab_size, ids.shape, generator=generator, device=ids.device,
                                   dtype=ids.dtype)[to_random]
    return ids, labels


class MLMCollator:
    """Pads items with ``pad`` (a collator giving input_ids and attention_mask), then masks the batch with
    :func:`mask_tokens`. The masking is a pure function of ``seed`` and the batch's tokens (a generator seeded
    from both), so a resumed run, and the dense and SEBP runs of a comparison, mask every batch alike; the same
    sequence in another batch (another epoch) is masked afresh."""

    def __init__(self, pad: Callable[[list[dict]], dict], mask_token_id: int, vocab_size: int,
                 special_ids: Iterable[int], seed: int = 0, probability: float = 0.15):
        self.pad, self.mask_token_id, self.vocab_size = pad, mask_token_id, vocab_size
        self.special_ids, self.probability, self.seed = tuple(special_ids), probability, seed

    @classmethod
    def for_tokenizer(cls, tokenizer, pad: Callable[[list[dict]], dict], seed: int = 0) -> "MLMCollator":
        """The collator for ``tokenizer``'s mask token, vocabulary and special tokens."""
        if tokenizer.mask_token_id is None:
            raise ValueError(f"tokenizer {type(tokenizer).__name__} has no mask token: it cannot do masked LM")
        return cls(pad, tokenizer.mask_token_id, len(tokenizer), tokenizer.all_special_ids, seed)

    def __call__(self, items: list[dict]) -> dict:
        batch = self.pad(items)
        content = zlib.crc32(batch["input_ids"].numpy().tobytes())
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + content)
        ids, labels = mask_tokens(batch["input_ids"], mask_token_id=self.mask_token_id, vocab_size=self.vocab_size,
                                  special_ids=self.special_ids, attention_mask=batch.get("attention_mask"),
                                  generator=generator, probability=self.probability)
        return {**batch, "input_ids": ids, "labels": labels}
