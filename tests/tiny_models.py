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
