"""Tiny Hugging Face models built from configs (no downloads), for tests."""
from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    BertConfig,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
    RobertaConfig,
)

ENCODERS = ("bert", "roberta")
DECODERS = ("llama", "qwen2", "qwen3")


def tiny_config(arch: str):
    common = dict(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=40)
    if arch == "bert":
        return BertConfig(**common, max_position_embeddings=64, num_labels=3,
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if arch == "roberta":
        return RobertaConfig(**common, max_position_embeddings=70, num_labels=3, pad_token_id=1,
                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    dec = dict(common, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    if arch == "llama":
        return LlamaConfig(**dec)
    if arch == "qwen2":
        return Qwen2Config(**dec)
    if arch == "qwen3":
        return Qwen3Config(**dec, head_dim=8)
    raise ValueError(arch)


def tiny_model(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = tiny_config(arch)
    cls = AutoModelForSequenceClassification if arch in ENCODERS else AutoModelForCausalLM
    model = cls.from_config(cfg)
    model.train()
    return model


def padded_batch(arch: str, lengths=(11, 4, 7), side: str = "right", seed: int = 0):
    """input_ids, attention_mask and labels with padding on ``side``; loss ignores pad positions."""
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    pad = 1 if arch == "roberta" else 0
    ids = torch.full((len(lengths), L), pad)
    mask = torch.zeros(len(lengths), L, dtype=torch.long)
    for i, n in enumerate(lengths):
        sl = slice(0, n) if side == "right" else slice(L - n, L)
        ids[i, sl] = torch.randint(3, 120, (n,), generator=g)
        mask[i, sl] = 1
    if arch in ENCODERS:
        labels = torch.randint(0, 3, (len(lengths),), generator=g)
    else:
        labels = ids.masked_fill(mask == 0, -100)
        first = mask.argmax(dim=1)  # the first real token is predicted by the position before it: no loss there
        labels[torch.arange(len(lengths)), first] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# One tiny config per family of sebp_probe.families (model type -> the task its test trains), and one family
# without an entry (OPT), for tests/probe/test_families.py and tests/cli/test_families_cli.py.
FAMILY_TASKS = {
    "llama": "causal-lm", "mistral": "causal-lm", "qwen2": "causal-lm", "qwen3": "causal-lm", "phi3": "causal-lm",
    "gemma2": "causal-lm", "gemma3_text": "causal-lm", "olmo2": "causal-lm", "granite": "causal-lm",
    "mixtral": "causal-lm", "qwen3_moe": "causal-lm",
    "bert": "classification", "roberta": "classification", "electra": "classification",
    "distilbert": "classification", "modernbert": "classification", "deberta-v2": "classification",
    "gpt2": "causal-lm", "albert": "classification",
}


def family_config(model_type: str, vocab_size: int = 120, pad: int = 0, cls: int = 1, sep: int = 2):
    """A tiny config of ``model_type`` (2 layers, width 32, no dropout) whose family-specific parts are on: sliding
    windows shorter than a sequence, logit softcaps, Granite's multipliers, DeBERTa-v3's relative attention, the
    mixtures of experts' top-2 routing over 4 experts (Qwen3-MoE: its first layer a dense MLP)."""
    from transformers import AutoConfig

    ids = dict(pad_token_id=pad, bos_token_id=cls, eos_token_id=sep)
    common = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=40, max_position_embeddings=128)
    no_drop = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    dec = dict(common, num_key_value_heads=2, **ids)
    kw = {
        "llama": dec, "qwen2": dec, "olmo2": dec, "phi3": dec,
        "mistral": dict(dec, sliding_window=6),
        "qwen3": dict(dec, head_dim=8),
        "gemma2": dict(dec, head_dim=8, sliding_window=6, query_pre_attn_scalar=8, final_logit_softcapping=0.05,
                       attn_logit_softcapping=0.05),
        "gemma3_text": dict(dec, head_dim=8, sliding_window=6, query_pre_attn_scalar=8,
                            layer_types=["sliding_attention", "full_attention"]),
        "mixtral": dict(dec, num_local_experts=4, num_experts_per_tok=2),
        "qwen3_moe": dict(dec, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                          mlp_only_layers=[0], norm_topk_prob=True),
        "granite": dict(dec, logits_scaling=4.0, residual_multiplier=0.5, attention_multiplier=0.3,
                        embedding_multiplier=2.0),
        "bert": dict(common, **no_drop, pad_token_id=pad),
        "electra": dict(common, **no_drop, pad_token_id=pad, embedding_size=24),
        "roberta": dict(common, **no_drop, pad_token_id=pad, max_position_embeddings=128 + pad + 1),
        "distilbert": dict(vocab_size=vocab_size, dim=32, n_layers=2, n_heads=4, hidden_dim=40, dropout=0.0,
                           attention_dropout=0.0, seq_classif_dropout=0.0, max_position_embeddings=128,
                           pad_token_id=pad),
        "modernbert": dict(common, **ids, cls_token_id=cls, sep_token_id=sep, global_attn_every_n_layers=2,
                           local_attention=8, attention_dropout=0.0, mlp_dropout=0.0, embedding_dropout=0.0),
        "deberta-v2": dict(common, **no_drop, pad_token_id=pad, relative_attention=True, pos_att_type=["p2c", "c2p"],
                           position_biased_input=False, max_relative_positions=-1, position_buckets=16,
                           norm_rel_ebd="layer_norm", share_att_key=True),
        "gpt2": dict(vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=4, n_inner=40, n_positions=128,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids),
        # 3 applications of its one shared layer group
        "albert": dict(common, **no_drop, num_hidden_layers=3, embedding_size=24, classifier_dropout_prob=0.0,
                       pad_token_id=pad),
        "opt": dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=40,
                    word_embed_proj_dim=32, max_position_embeddings=128, dropout=0.0, **ids),
    }[model_type]
    return AutoConfig.for_model(model_type, **kw, num_labels=3)


def family_model(model_type: str, task: str, dtype: torch.dtype = torch.float32, seed: int = 0, **ids):
    """A tiny model of ``model_type`` for ``task`` (causal-lm, mlm or classification), in training mode."""
    from transformers import AutoModelForMaskedLM

    torch.manual_seed(seed)
    auto = {"causal-lm": AutoModelForCausalLM, "mlm": AutoModelForMaskedLM,
            "classification": AutoModelForSequenceClassification}[task]
    return auto.from_config(family_config(model_type, **ids), dtype=dtype).train()


def word_tokenizer(vocab_size: int = 120):
    """A fast tokenizer of ``vocab_size`` ids: <pad> 0, <eos> 1, <unk> 2, then the words w0, w1, ... split on
    whitespace (what TRL's SFTTrainer needs besides a model; no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(vocab_size - len(specials))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
