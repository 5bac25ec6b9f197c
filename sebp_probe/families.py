"""Model families: what sebp-probe knows of each transformers architecture, in one map keyed by
``config.model_type`` (Liger-Kernel's ``monkey_patch`` shape: one entry per family; adding a family is one entry
and its tests, ``tests/probe/test_families.py``).

Each entry says which linears SEBP patches by default (the attention and MLP projections), which layer class the
kept-rows last layer computes and how that layer is built (:mod:`.last_layer`), which RMSNorm and MLP classes
have the SEBP norm and activation (:mod:`.patch`), whether packed rows run exactly (:mod:`.packing`), how the
labelled-rows head reads the LM head (:mod:`.heads`: the masked-LM transform, a logit softcap or divisor), and
whether Liger-Kernel has a patch the whole-model benchmark runs.

A family not in the map still runs, with fallbacks said in one line each (:func:`.notes.note`): SEBP on every linear
but the output head, the model's own loss, bucketed batches instead of packed ones. Class names were checked
against transformers 5.x.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

_LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_BERT_TARGETS = ("query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense")


def _bert_mlm(lm: nn.Module, decoder: nn.Linear) -> Callable | None:
    predictions = getattr(getattr(lm, "cls", None), "predictions", None)
    if predictions is not None and predictions.decoder is decoder:  # dense, activation, LayerNorm
        return predictions.transform
    return None


def _roberta_mlm(lm: nn.Module, decoder: nn.Linear) -> Callable | None:
    head = getattr(lm, "lm_head", None)
    if head is not None and getattr(head, "decoder", None) is decoder and type(head).__name__ == "RobertaLMHead":
        from transformers.activations import gelu

        return lambda h: head.layer_norm(gelu(head.dense(h)))
    return None


def _electra_mlm(lm: nn.Module, decoder: nn.Linear) -> Callable | None:
    if getattr(lm, "generator_lm_head", None) is decoder:  # dense, GELU, LayerNorm
        return lm.generator_predictions
    return None


def _distilbert_mlm(lm: nn.Module, decoder: nn.Linear) -> Callable | None:
    if getattr(lm, "vocab_projector", None) is decoder:
        return lambda h: lm.vocab_layer_norm(lm.activation(lm.vocab_transform(h)))
    return None


def _modernbert_mlm(lm: nn.Module, decoder: nn.Linear) -> Callable | None:
    if getattr(lm, "decoder", None) is decoder and hasattr(lm, "head"):  # dense, activation, LayerNorm
        return lm.head
    return None


@dataclass(frozen=True)
class Family:
    """What sebp-probe knows of one model family (see the module docstring).

    ``targets``: SEBP's default linears (names or dotted suffixes). ``layer``: the transformer layer class the
    kept-rows last layer computes (None: the labelled-rows head is not offered), ``layers`` the attribute path
    of the layer stack in the backbone; ``block`` how that layer runs: ``decoder`` (rotary attention and an
    MLP), ``encoder`` (BERT-like), ``distilbert`` or ``modernbert`` (their encoder layers); for decoders ``qkv`` (``split``
    q/k/v projections or one ``fused`` qkv_proj), ``qk_norm`` (``head``: per-head norms of queries and keys;
    ``full``: over the whole projection) and ``norms_at`` (``pre``: before attention and MLP; ``sandwich``:
    before and after each; ``post``: after each). ``rms_norms``: RMSNorm classes whose forward is Llama's
    formula; ``gated_mlps``: MLP classes ``down(act(gate(x)) * up(x))``; ``gelu_mlps``: BERT-like intermediate
    classes (a ``dense`` linear, then GELU). ``packed``: packed rows run exactly (causal LMs of a decoder
    family, classifiers of an encoder family); ``first_token``: the attribute path of the module that reads a
    classifier's token 0; ``position_offset``: positions count from ``pad_token_id + 1``. ``mlm``: the
    masked-LM head's transform before its decoder. ``logit_softcap``: the LM head applies
    ``config.final_logit_softcapping``; ``logit_divisor``: the config field the logits are divided by.
    ``liger``: Liger-Kernel's ``apply_liger_kernel_to_<model_type>`` runs in the whole-model benchmark.
    ``experts``: mixture-of-experts classes whose experts are fused 3-D parameters (``gate_up_proj``,
    ``down_proj``), which get the SEBP experts backward with the linears (:mod:`.model.experts`)."""

    name: str
    targets: tuple[str, ...]
    layer: str | None = None
    block: str | None = None
    layers: str = "layers"
    qkv: str = "split"
    qk_norm: str | None = None
    norms_at: str = "pre"
    rms_norms: tuple[str, ...] = ()
    gated_mlps: tuple[str, ...] = ()
    gelu_mlps: tuple[str, ...] = ()
    packed: bool = False
    first_token: tuple[str, ...] = ()
    position_offset: bool = False
    mlm: Callable[[nn.Module, nn.Linear], Callable | None] | None = None
    logit_softcap: bool = False
    logit_divisor: str | None = None
    liger: bool = False
    experts: tuple[str, ...] = ()


def _decoder(name: str, prefix: str, **kw) -> Family:
    """A Llama-like decoder family whose classes are named ``<prefix>DecoderLayer``, ``<prefix>RMSNorm``..."""
    return Family(name, kw.pop("targets", _LLAMA_TARGETS), f"{prefix}DecoderLayer", "decoder",
                  rms_norms=kw.pop("rms_norms", (f"{prefix}RMSNorm",)),
                  gated_mlps=kw.pop("gated_mlps", (f"{prefix}MLP",)), packed=kw.pop("packed", True), **kw)


def _encoder(name: str, prefix: str, first_token: tuple[str, ...], **kw) -> Family:
    """A BERT-like encoder family (``<prefix>Layer``: attention.self.query..., intermediate, output)."""
    return Family(name, _BERT_TARGETS, f"{prefix}Layer", "encoder", "encoder.layer",
                  gelu_mlps=(f"{prefix}Intermediate",), packed=True, first_token=first_token, **kw)


FAMILIES: dict[str, Family] = {
    "llama": _decoder("Llama", "Llama", liger=True),
    "mistral": _decoder("Mistral", "Mistral"),
    "qwen2": _decoder("Qwen2", "Qwen2", liger=True),
    "qwen3": _decoder("Qwen3", "Qwen3", qk_norm="head"),
    # one qkv_proj and one gate_up_proj: SEBP skips their rows as any linear's; the fused MLP has no SEBP SwiGLU
    "phi3": _decoder("Phi-3", "Phi3", targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
                     qkv="fused", gated_mlps=()),
    # Gemma's RMSNorm scales by (1 + weight) and its MLP is GeGLU: neither has an SEBP kernel
    "gemma2": _decoder("Gemma 2", "Gemma2", norms_at="sandwich", rms_norms=(), gated_mlps=(), logit_softcap=True),
    "gemma3_text": _decoder("Gemma 3", "Gemma3", qk_norm="head", norms_at="sandwich", rms_norms=(), gated_mlps=(),
                            logit_softcap=True),
    # OLMo-2's RMSNorm casts after the weight, not before: other bits than the SEBP norm's in half precision
    "olmo2": _decoder("OLMo-2", "Olmo2", qk_norm="full", norms_at="post", rms_norms=()),
    "granite": _decoder("Granite", "Granite", logit_divisor="logits_scaling"),
    # mixtures of experts: the router (mlp.gate) stays dense, the fused experts take their routed rows' backward
    "mixtral": _decoder("Mixtral", "Mixtral", targets=_LLAMA_TARGETS[:4], gated_mlps=(), experts=("MixtralExperts",)),
    "qwen3_moe": _decoder("Qwen3-MoE", "Qwen3Moe", qk_norm="head", experts=("Qwen3MoeExperts",)),
    "bert": _encoder("BERT", "Bert", ("bert", "pooler"), mlm=_bert_mlm),
    "roberta": _encoder("RoBERTa", "Roberta", ("classifier",), position_offset=True, mlm=_roberta_mlm),
    "electra": _encoder("ELECTRA", "Electra", ("classifier",), mlm=_electra_mlm),
    # packed rows: DistilBERT's classifier reads token 0 inside its forward, ModernBERT's layers half-window
    "distilbert": Family("DistilBERT", ("q_lin", "k_lin", "v_lin", "out_lin", "lin1", "lin2"), "TransformerBlock",
                         "distilbert", "transformer.layer", mlm=_distilbert_mlm),
    # fused Wqkv and Wi (GeGLU: no SEBP activation); the [CLS]-rows layer with classifier_pooling 'cls' only
    "modernbert": Family("ModernBERT", ("attn.Wqkv", "attn.Wo", "mlp.Wi", "mlp.Wo"), "ModernBertEncoderLayer",
                         "modernbert", mlm=_modernbert_mlm),
    # Conv1D projections (weight stored (in, out): SEBPConv1D); learned absolute positions, restarted per packed
    # sequence by position_ids; no kept-rows last layer (its block is not Llama's), GELU-new MLP, LayerNorms
    "gpt2": Family("GPT-2", ("c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"), layers="h", packed=True),
    # one layer group applied num_hidden_layers times: each call of a shared linear has its own backward rows;
    # the pooler reads token 0 inside AlbertModel's forward (no packed rows), its layer is no BERT layer
    "albert": Family("ALBERT", ("embedding_hidden_mapping_in", "attention.query", "attention.key",
                                "attention.value", "attention.dense", "ffn", "ffn_output"),
                     layers="encoder.albert_layer_groups"),
    # disentangled attention reads relative positions of every query: its last layer runs whole
    "deberta-v2": Family("DeBERTa-v2/v3", ("query_proj", "key_proj", "value_proj", "attention.output.dense",
                                           "intermediate.dense", "output.dense"),
                         gelu_mlps=("DebertaV2Intermediate",)),
}


def unwrapped(model: nn.Module) -> nn.Module | None:
    """The transformers model inside ``model``'s peft, DDP/FSDP and ``torch.compile`` wrappers (the first module
    whose config names a model type; ``model`` itself when it is one), or None."""
    m = model
    for _ in range(8):
        get_base = getattr(m, "get_base_model", None)  # peft's wrapper passes its model's config through
        if not callable(get_base) and getattr(getattr(m, "config", None), "model_type", None):
            return m
        nxt = get_base() if callable(get_base) else getattr(m, "module", None) or getattr(m, "_orig_mod", None)
        if not isinstance(nxt, nn.Module) or nxt is m:
            return None
        m = nxt
    return None


def config_of(model: nn.Module):
    """The transformers config of ``model`` (also inside peft, DDP/FSDP and ``torch.compile`` wrappers), or
    None."""
    m = unwrapped(model)
    return None if m is None else m.config


def model_type(model: nn.Module) -> str | None:
    """``config.model_type`` of ``model`` (see :func:`config_of`), or None."""
    cfg = config_of(model)
    return getattr(cfg, "model_type", None) if cfg is not None else None


def family_of(model: nn.Module) -> Family | None:
    """The registry entry of ``model``'s family, or None for a family sebp-probe does not know."""
    return FAMILIES.get(model_type(model) or "")


def layer_stack(model: nn.Module) -> nn.ModuleList | None:
    """The transformer layers of ``model`` (a backbone, or a model with a ``base_model``): where its family's
    entry says (``layers``), else a decoder stack (``layers``) or a BERT-like encoder (``encoder.layer``); None
    where there is none."""
    family = family_of(model)
    paths = (family.layers,) if family is not None else ("layers", "encoder.layer")
    for root in (model, getattr(model, "base_model", None)):
        for path in paths:
            layers = root
            for part in path.split("."):
                layers = getattr(layers, part, None)
            if isinstance(layers, nn.ModuleList):
                return layers
    return None


def names(pick: Callable[[Family], object]) -> list[str]:
    """The model types whose entry has ``pick(entry)`` true, in the map's order (for messages)."""
    return [t for t, f in FAMILIES.items() if pick(f)]
