"""Frozen, validated settings shared by analyze, heatmap and finetune."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from sebp_kernels import SEBPConfig

Padding = Literal["max_length", "longest"]
Side = Literal["left", "right"]
TASKS = ("classification", "causal-lm")

__all__ = ["DataConfig", "SEBPConfig", "TASKS"]


@dataclass(frozen=True)
class DataConfig:
    """Which data, how it is tokenized and padded into batches.

    dataset: ``tweets`` (bundled), a local CSV/JSON/JSONL/Parquet file, or a ``datasets`` hub name with an
    optional config after a slash or colon (``glue/sst2``, ``allenai/ai2_arc/ARC-Easy``, ``imdb``).
    split / eval_split: dataset splits (default ``train``; eval falls back to a held-out slice of train).
    padding: ``max_length`` pads every batch to ``max_length`` (what most fine-tuning scripts do);
    ``longest`` pads to the longest sample of the batch (dynamic padding).
    padding_side: ``right`` or ``left`` (default: the tokenizer's, which is right for the bundled models).
    """

    dataset: str = "tweets"
    split: str | None = None
    eval_split: str | None = None
    text_column: str | None = None
    text_pair_column: str | None = None
    label_column: str | None = None
    padding: Padding = "max_length"
    max_length: int = 128
    padding_side: Side | None = None
    batch_size: int = 32
    max_samples: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.dataset or not str(self.dataset).strip():
            raise ValueError("dataset must be a name or a path")
        if self.padding not in ("max_length", "longest"):
            raise ValueError(f"padding must be 'max_length' or 'longest', got {self.padding!r}")
        if self.padding_side not in (None, "left", "right"):
            raise ValueError(f"padding side must be 'left' or 'right', got {self.padding_side!r}")
        if not isinstance(self.max_length, int) or self.max_length < 2:
            raise ValueError(f"max length must be an integer >= 2, got {self.max_length}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch size must be an integer >= 1, got {self.batch_size}")
        if self.max_samples is not None and self.max_samples < 1:
            raise ValueError(f"max samples must be >= 1, got {self.max_samples}")

    def to_dict(self) -> dict:
        return asdict(self)
