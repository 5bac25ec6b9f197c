"""What is done to a model and how it is called: SEBP layers patched in (patch), gradient reuse (resprop), the
model call on packed batches (packing), the head over the labelled rows (heads, last_layer) and one batch's loss
(losses)."""
