"""The batch layouts, one entry each: how a batch's sequences are drawn and laid out (the ``--padding`` flag,
named so before ``packed`` existed). Everything that depends on the layout reads its entry here: the settings'
check and the CLI help (:mod:`.config`), the training and evaluation loaders (:mod:`.train_data`), the
benchmark batches (:mod:`.bench_cases`), the padding share (:func:`.batching.padding_share`), the layout advice
(:mod:`.causes`) and ``--padding auto`` (:mod:`.strategy`, which times every entry).

An entry holds data, not code, so that this module sits below all of them: the sampler is the training
sampler's random batches or, with ``grouped``, the bucket sampler's batches of similar lengths
(:func:`.batching.batch_sampler`); the collator pads to ``pad_to`` or, without it, packs rows
(:func:`.batching.collator`). Adding a layout built from these parts is one entry here.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LAYOUTS", "PADDED", "Layout"]


@dataclass(frozen=True)
class Layout:
    """One batch layout.

    pad_to: what each batch is padded to (``max_length``: ``--max-length``; ``longest``: its longest sequence),
    as :class:`~sebp_probe.data.batching.PadCollator` takes it; None: sequences packed into rows
    (:class:`~sebp_probe.data.batching.PackedCollator`), which only some model families run exactly.
    grouped: batches of similar lengths (:class:`~sebp_probe.data.batching.LengthGroupedBatchSampler`), so a step
    holds other sequences than under the random batches of the other layouts.
    fixed_shapes: its batches take few shapes, so CUDA graphs (``--cuda-graphs``, ``--compile
    reduce-overhead``) can record them.
    """

    name: str
    help: str
    pad_to: str | None
    grouped: bool = False
    fixed_shapes: bool = True

    @property
    def one_shape(self) -> bool:
        """Every batch has the same shape (padded to ``--max-length``): compiled code needs no dynamic sizes."""
        return self.pad_to == "max_length"

    @property
    def packed(self) -> bool:
        """Rows of several sequences (no padding between them) rather than one padded sequence a row."""
        return self.pad_to is None

    @property
    def eval_pad_to(self) -> str:
        """How evaluation batches of a run trained under this layout are padded: as training pads them,
        packed runs evaluate padded to the longest."""
        return self.pad_to or "longest"


# Simplest first: the layout advice (:mod:`.causes`) recommends a later one only where it leaves less padding.
LAYOUTS: dict[str, Layout] = {lay.name: lay for lay in (
    Layout("max_length", "every batch padded to --max-length", pad_to="max_length"),
    Layout("longest", "each batch padded to its longest sequence", pad_to="longest"),
    Layout("bucket", "batches of similar lengths, each padded to its longest", pad_to="longest", grouped=True),
    Layout("packed", "sequences packed into rows without padding, where exact (docs/finetune.md lists the model "
                     "families; else bucket)", pad_to=None, fixed_shapes=False),
)}
# The layouts of padded sequences, one a row: what analyze and heatmap measure (rows of packed sequences hold
# no padding to find).
PADDED = tuple(name for name, lay in LAYOUTS.items() if not lay.packed)
