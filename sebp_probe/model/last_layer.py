"""The last transformer layer computed for the rows the loss reads only.

In the last layer every position-wise product of a row (its query, the attention-output projection, the
residual, the norms and the MLP) feeds that row's output alone, so for rows the loss never reads (SFT prompts,
the ~85% unmasked positions of masked LM, all but [CLS] in BERT classification) it is wasted. Keys and values
are still needed for every position: the kept queries attend to them.

Inside :func:`last_layer_on_rows` the model's last layer computes keys/values for all positions and the rest for
the kept rows only, and returns those rows as a (1, n, d) tensor (BERT-like encoders with the [CLS] rows only:
(B, 1, d), which their pooler and classification heads read as position 0). The layout of the kept queries:
per sequence, its kept positions in order, padded to the longest such list (padding slots attend everywhere
and are dropped); the layer's own attention mask (causal, padding, packing, sliding window) is gathered at the
kept query positions. Exact: the same operations on the same values as the full layer, for the kept rows.
Attention dropout and hidden dropout draw other random numbers than the full layer (same distribution).

Layers handled: those the model-family registry names (:mod:`sebp_probe.families`: decoder layers of the
Llama-like families, with split or fused q/k/v projections, per-head or whole-projection query/key norms, and
norms before, around or after attention and MLP; BERT-like encoder layers); attention "sdpa" or "eager", and for
decoders the varlen attention of packed batches (:mod:`sebp_probe.model.packing`): on its flattened row the kept
queries attend, through sdpa, to the keys of their own sequence up to their position.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..families import Family, family_of, layer_stack, model_type
from .packing import VARLEN
from .sdpa import without_cudnn_attention

ATTENTION = ("sdpa", "eager", VARLEN)


class LastLayerError(ValueError):
    """A model whose last layer this module does not compute on kept rows; the message is one line."""


@dataclass
class KeptRows:
    """Kept rows of a (B, T) batch: ``rows`` flat indices (sorted), and their query layout (B, Q): ``pos`` the
    position of each slot (0 in padding slots), ``valid`` whether a slot holds a kept row, ``slots`` the flat
    slot of each kept row. ``per_sequence``: the layer returns the (B, Q, d) layout (an encoder's [CLS] rows,
    Q = 1) instead of the kept rows as (1, n, d)."""

    rows: torch.Tensor
    batch: int
    length: int
    pos: torch.Tensor
    valid: torch.Tensor
    slots: torch.Tensor
    per_sequence: bool = False

    @classmethod
    def first_rows(cls, batch: int, length: int, device: torch.device) -> "KeptRows":
        """Position 0 of every sequence ([CLS]), returned per sequence."""
        rows = torch.arange(batch, device=device) * length
        return cls.from_rows(rows, batch, length, per_sequence=True, most=1)

    @classmethod
    def from_rows(cls, rows: torch.Tensor, batch: int, length: int, per_sequence: bool = False,
                  most: int | None = None) -> "KeptRows":
        """``most``: the most kept rows in one sequence, when the caller knows it (a Python int: no graph break
        under ``torch.compile``, where it is taken as given; eagerly it is checked); else counted here."""
        b, t = rows // length, rows % length
        # bincount's length would depend on the values (a graph break under torch.compile); b < batch always
        counts = torch.zeros(batch, dtype=torch.long, device=rows.device).index_add_(0, b, torch.ones_like(b))
        if most is None or not torch.compiler.is_compiling():
            counted = int(counts.max()) if rows.numel() else 0
            if most is not None and most != counted:
                raise ValueError(f"the most kept rows in one sequence are {counted}, not the {most} given")
            most = counted
        q = most
        rank = torch.arange(rows.numel(), device=rows.device) - (counts.cumsum(0) - counts)[b]
        slots = b * q + rank
        pos = torch.zeros(batch * q, dtype=torch.long, device=rows.device).index_copy_(0, slots, t)
        valid = torch.zeros(batch * q, dtype=torch.bool, device=rows.device).index_fill_(0, slots, True)
        return cls(rows, batch, length, pos.view(batch, q), valid.view(batch, q), slots, per_sequence)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """(B, Q, ...) from (B, T, ...); ``x`` may broadcast over the batch (leading size 1)."""
        x = x.expand(self.batch, *x.shape[1:])
        return x[torch.arange(self.batch, device=x.device)[:, None], self.pos]

    def from_slots(self, y: torch.Tensor) -> torch.Tensor:
        """(n, ...) of the kept rows from (B, Q, ...), in the order of ``rows``."""
        return y.reshape(-1, *y.shape[2:]).index_select(0, self.slots)

    def of(self, x: torch.Tensor) -> torch.Tensor:
        """(n, ...) of the kept rows from (B, T, ...)."""
        return x.reshape(-1, *x.shape[2:]).index_select(0, self.rows)

    def mask(self, attention_mask: torch.Tensor | None, causal: bool, dtype: torch.dtype,
             additive: bool) -> torch.Tensor | None:
        """The attention mask of the kept queries (B, 1, Q, T) from the layer's (B, 1, T or 1, T) or None."""
        if attention_mask is None and not causal:
            return None
        if attention_mask is None:  # the full layer ran causal without a mask: no padding, no packing
            keys = torch.arange(self.length, device=self.pos.device)
            attention_mask = keys[None, None, :] <= self.pos[:, :, None]
        elif attention_mask.dim() != 4:
            raise LastLayerError(f"a {attention_mask.dim()}-D attention mask; the kept-rows layer needs the 4-D "
                                 "mask of the sdpa or eager attention")
        elif attention_mask.shape[2] == 1:
            attention_mask = attention_mask[:, 0].expand(self.batch, self.pos.shape[1], -1)
        else:
            attention_mask = self.queries(attention_mask[:, 0])
        open_ = True if attention_mask.dtype == torch.bool else 0.0  # padding slots attend everywhere
        attention_mask = attention_mask.masked_fill(~self.valid[:, :, None], open_)
        if additive and attention_mask.dtype == torch.bool:
            attention_mask = torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device
                                         ).masked_fill_(~attention_mask, torch.finfo(dtype).min)
        return attention_mask[:, None]

    def sequence_mask(self, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """The (B, 1, Q, T) boolean mask of the kept queries of one flattened row of sequences starting at
        ``cu_seqlens``: a key is visible when it is of the query's sequence and not after it."""
        keys = torch.arange(self.length, device=self.pos.device)
        seq = torch.bucketize(keys, cu_seqlens[1:].to(keys.device), right=True)
        q_seq = seq[self.pos]
        visible = (seq[None, None, :] == q_seq[:, :, None]) & (keys[None, None, :] <= self.pos[:, :, None])
        return visible.masked_fill(~self.valid[:, :, None], True)[:, None]


def last_layer(backbone: nn.Module) -> nn.Module:
    """The last layer of ``backbone``'s stack (:func:`~sebp_probe.families.layer_stack`)."""
    layers = layer_stack(backbone)
    if layers is None or not len(layers):
        raise LastLayerError(f"{type(backbone).__name__} has no layer stack the kept-rows layer knows")
    n = getattr(getattr(backbone, "config", None), "num_hidden_layers", len(layers))
    return layers[n - 1]


def kept_rows_family(backbone: nn.Module | None, cls_rows: bool = False) -> Family:
    """The registry entry of the layer that :func:`last_layer_on_rows` computes for ``backbone`` (``cls_rows``:
    an encoder's, for the [CLS] rows of a classifier); LastLayerError (one line) where it cannot."""
    family = family_of(backbone) if backbone is not None else None
    if family is None:
        raise LastLayerError(f"model type {model_type(backbone) if backbone is not None else None!r} has no entry "
                             "in sebp-probe's model families")
    if family.layer is None or (cls_rows and family.block == "decoder"):
        raise LastLayerError(f"the {family.name} entry has no kept-rows {'encoder' if cls_rows else 'last'} layer")
    pooling = getattr(backbone.config, "classifier_pooling", "cls")
    if cls_rows and pooling != "cls":
        raise LastLayerError(f"the classifier pools {pooling!r}, every row; the [CLS]-rows layer needs 'cls'")
    layer = last_layer(backbone)
    name = type(layer).__name__
    if name != family.layer:
        raise LastLayerError(f"the kept-rows last layer computes {family.layer}, not {name}")
    impl = getattr(backbone.config, "_attn_implementation", None)
    if impl not in ATTENTION:
        raise LastLayerError(f"the kept-rows last layer needs attention 'sdpa', 'eager' or varlen, not {impl!r}")
    if family.block != "decoder" and (getattr(layer, "is_decoder", False) or getattr(layer, "add_cross_attention",
                                                                                      False)):
        raise LastLayerError(f"{name} is configured as a decoder; the kept-rows layer takes encoders only")
    return family


def install_kept_rows(backbone: nn.Module) -> nn.Module:
    """Give ``backbone``'s last layer the forward :func:`last_layer_on_rows` switches (its own outside the
    block), once, and return the layer. Installed once and left in place, not swapped per block: under
    torch.compile a forward set and deleted inside the traced code cannot be replayed, and a compiled model
    would see its layer change. A compiled caller installs it before its first call: installed inside it, the
    second call would find the layer changed and compile again."""
    layer = last_layer(backbone)
    if "_sebp_kept" not in vars(layer):
        layer.forward = functools.partial(_kept_rows_forward, layer, layer.forward)
        layer._sebp_kept = None
    return layer


@contextlib.contextmanager
def last_layer_on_rows(backbone: nn.Module, kept: KeptRows) -> Iterator[None]:
    """Within the block, ``backbone``'s last layer computes the ``kept`` rows only (see the module doc)."""
    family = kept_rows_family(backbone)
    layer = install_kept_rows(backbone)
    additive = backbone.config._attn_implementation == "eager"
    layer._sebp_kept = (family, kept, additive)
    # Not checkpointed while it computes the kept rows (a few rows; the keys and values of all): a recomputation
    # in the backward, after the block, would run the layer's own forward.
    checkpointed = getattr(layer, "gradient_checkpointing", None)
    if checkpointed:
        layer.gradient_checkpointing = False
    try:
        yield
    finally:
        layer._sebp_kept = None  # the layer's own forward again
        if checkpointed:
            layer.gradient_checkpointing = checkpointed


def computes_kept_rows(layer: nn.Module) -> bool:
    """Whether ``layer`` computes kept rows now (inside :func:`last_layer_on_rows`)."""
    return vars(layer).get("_sebp_kept") is not None


def _kept_rows_forward(layer: nn.Module, own_forward, *args, **kwargs):
    """The last layer's forward: on the kept rows inside :func:`last_layer_on_rows`, else its own."""
    state = layer._sebp_kept
    if state is None:
        return own_forward(*args, **kwargs)
    family, kept, additive = state
    if family.block == "decoder":
        return _decoder_forward(layer, family, kept, additive, *args, **kwargs)
    return _ENCODERS[family.block](layer, kept, additive, *args, **kwargs)


def _attend(attn: nn.Module, q, k, v, mask, dropout: float) -> torch.Tensor:
    """The layer's own attention function on (B, H, Q, hd) queries; (B, Q, H * hd) out. The window and logit
    softcap the layer passes go along (the attention functions that use them: eager Gemma, flash)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = sys.modules[type(attn).__module__].eager_attention_forward
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager)
    extra = {k: v for k, v in (("sliding_window", getattr(attn, "sliding_window", None)),
                               ("softcap", getattr(attn, "attn_logit_softcapping", None))) if v is not None}
    scaling = getattr(attn, "scaling", q.shape[-1] ** -0.5)  # ModernBERT keeps none: the default
    with _no_plan_per_shape(q, attn.config._attn_implementation):
        out, _ = fn(attn, q, k, v, mask, dropout=dropout if attn.training else 0.0, scaling=scaling,
                    is_causal=False, **extra)
    return out.reshape(*out.shape[:2], -1)


def _no_plan_per_shape(q: torch.Tensor, impl: str):
    """Eager sdpa on CUDA without cuDNN's attention (:mod:`.sdpa`): the kept queries' shape is new with nearly
    every batch."""
    if impl != "sdpa" or not q.is_cuda or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return without_cudnn_attention()


def _rotate_apart(rotate, q, k, q_cos, q_sin, cos, sin):
    """The model's rotary function on queries and keys at different positions: one call each, the unused
    half a one-head copy of the other (a rotary kernel that works in place, as Liger-Kernel's does, must not
    get one tensor twice)."""
    q_out = rotate(q, q[:, :1].detach().clone(), q_cos, q_sin)[0]
    return q_out, rotate(k[:, :1].detach().clone(), k, cos, sin)[1]


def _projections(attn: nn.Module, family: Family, x: torch.Tensor, xq: torch.Tensor, kept: KeptRows):
    """Queries of the kept rows (B, Q, H, hd), keys and values of every row (B, T, Hkv, hd), as the family's
    attention makes them (split or fused projections, query/key norms)."""
    b, t, _ = x.shape
    if family.qkv == "fused":  # one GEMM gives all three: the queries are its kept rows
        qkv = attn.qkv_proj(x)
        nq, nkv = attn.config.num_attention_heads * attn.head_dim, attn.num_key_value_heads * attn.head_dim
        q, k, v = kept.queries(qkv[..., :nq]), qkv[..., nq:nq + nkv], qkv[..., nq + nkv:]
    else:
        q, k, v = attn.q_proj(xq), attn.k_proj(x), attn.v_proj(x)
    if family.qk_norm == "full":  # OLMo-2: over the whole projection
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.view(b, q.shape[1], -1, attn.head_dim), k.view(b, t, -1, attn.head_dim)
    if family.qk_norm == "head":  # Qwen3, Gemma 3: per head, before the rotation
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q, k, v.view(b, t, -1, attn.head_dim)


def _decoder_forward(layer, family: Family, kept: KeptRows, additive: bool, hidden_states, attention_mask=None,
                     position_embeddings=None, cache=None, **kwargs):
    if cache is not None:
        raise LastLayerError("the kept-rows last layer runs without a KV cache (pass use_cache=False)")
    if not kept.rows.numel():
        return kept.of(hidden_states)[None]
    attn = layer.self_attn
    rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    x = hidden_states if family.norms_at == "post" else layer.input_layernorm(hidden_states)
    q, k, v = _projections(attn, family, x, kept.queries(x), kept)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cos, sin = position_embeddings
    q, k = _rotate_apart(rotate, q, k, kept.queries(cos), kept.queries(sin), cos, sin)
    cu = kwargs.get("cu_seq_lens_q")  # a flattened packed row (varlen): its sequences, not a mask, part it
    mask = kept.mask(attention_mask, True, q.dtype, additive) if cu is None else kept.sequence_mask(cu)
    out = attn.o_proj(kept.from_slots(_attend(attn, q, k, v, mask, attn.attention_dropout)))
    scale = getattr(layer, "residual_multiplier", None)  # Granite
    drop_attn = getattr(layer, "resid_attn_dropout", None)  # Phi-3
    drop_mlp = getattr(layer, "resid_mlp_dropout", None)
    if family.norms_at != "pre":
        out = layer.post_attention_layernorm(out)
    if drop_attn is not None:
        out = drop_attn(out)
    h = kept.of(hidden_states) + (out if scale is None else out * scale)
    mlp = layer.mlp if not family.experts else lambda x: layer.mlp(x[None])[0]  # an MoE block takes (B, T, H)
    if family.norms_at == "pre":
        m = mlp(layer.post_attention_layernorm(h))
    elif family.norms_at == "sandwich":
        m = layer.post_feedforward_layernorm(mlp(layer.pre_feedforward_layernorm(h)))
    else:
        m = layer.post_feedforward_layernorm(mlp(h))
    if drop_mlp is not None:
        m = drop_mlp(m)
    h = h + (m if scale is None else m * scale)
    return h[None]


def _encoder_qkv(attn: nn.Module, linears, head_size: int, hidden_states, kept: KeptRows):
    """(B, H, Q, hd) queries of the kept rows, (B, H, T, hd) keys and values of every row, from split
    projections."""
    b, t, _ = hidden_states.shape
    xq = kept.queries(hidden_states)
    q, k, v = linears
    return (q(xq).view(b, xq.shape[1], -1, head_size).transpose(1, 2),
            k(hidden_states).view(b, t, -1, head_size).transpose(1, 2),
            v(hidden_states).view(b, t, -1, head_size).transpose(1, 2))


def _padded_only(kwargs) -> None:
    if kwargs.get("cu_seq_lens_q") is not None:
        raise LastLayerError("the kept-rows encoder layer takes padded batches, not a flattened packed row")


def _rows_out(h: torch.Tensor, kept: KeptRows, batch: int) -> torch.Tensor:
    return h.view(batch, -1, h.shape[-1]) if kept.per_sequence else h[None]


def _encoder_forward(layer, kept: KeptRows, additive: bool, hidden_states, attention_mask=None, *_, **kwargs):
    _padded_only(kwargs)
    if not kept.rows.numel():
        return kept.of(hidden_states)[None]
    attn = layer.attention.self
    q, k, v = _encoder_qkv(attn, (attn.query, attn.key, attn.value), attn.attention_head_size, hidden_states, kept)
    mask = kept.mask(attention_mask, False, q.dtype, additive)
    out = kept.from_slots(_attend(attn, q, k, v, mask, attn.dropout.p))
    h = layer.feed_forward_chunk(layer.attention.output(out, kept.of(hidden_states)))
    return _rows_out(h, kept, hidden_states.shape[0])


def _distilbert_forward(layer, kept: KeptRows, additive: bool, hidden_states, attention_mask=None, *_, **kwargs):
    _padded_only(kwargs)
    if not kept.rows.numel():
        return kept.of(hidden_states)[None]
    attn = layer.attention
    q, k, v = _encoder_qkv(attn, (attn.q_lin, attn.k_lin, attn.v_lin), attn.attention_head_size, hidden_states, kept)
    mask = kept.mask(attention_mask, False, q.dtype, additive)
    out = attn.out_lin(kept.from_slots(_attend(attn, q, k, v, mask, attn.dropout.p)))
    h = layer.sa_layer_norm(out + kept.of(hidden_states))
    h = layer.output_layer_norm(layer.ffn(h) + h)
    return _rows_out(h, kept, hidden_states.shape[0])


def _modernbert_forward(layer, kept: KeptRows, additive: bool, hidden_states, attention_mask=None,
                        position_embeddings=None, *_, **kwargs):
    _padded_only(kwargs)
    if not kept.rows.numel():
        return kept.of(hidden_states)[None]
    attn = layer.attn
    rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    x = layer.attn_norm(hidden_states)
    b, t, _ = x.shape
    qkv = attn.Wqkv(x).view(b, t, 3, -1, attn.head_dim)  # one GEMM gives all three: the queries are its kept rows
    q, k, v = kept.queries(qkv[:, :, 0]).transpose(1, 2), qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2)
    cos, sin = position_embeddings
    q, k = _rotate_apart(rotate, q, k, kept.queries(cos), kept.queries(sin), cos, sin)
    mask = kept.mask(attention_mask, False, q.dtype, additive)
    out = attn.out_drop(attn.Wo(kept.from_slots(_attend(attn, q, k, v, mask, attn.attention_dropout))))
    h = kept.of(hidden_states) + out
    h = h + layer.mlp(layer.mlp_norm(h))
    return _rows_out(h, kept, b)


# the encoder layers by their entry's ``block``
_ENCODERS = {"encoder": _encoder_forward, "distilbert": _distilbert_forward, "modernbert": _modernbert_forward}
