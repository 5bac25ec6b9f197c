"""Write a Llama-3.2-1B-shaped model with random weights (seed 0) and a tokenizer to a directory, for the
two-GPU runs of benchmarks/fsdp_session.sh (the device machine has no hub access).

The shape is sebp_probe.bench_cases' Llama-3.2-1B except the vocabulary, which is the tokenizer's: the bundled
MiniLM's (30522 word pieces), so that the bundled tweets tokenize without a download.

Usage: python benchmarks/fsdp_model.py TOKENIZER_DIR OUT_DIR
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig  # noqa: E402

from sebp_probe.bench_cases import _LLAMA_1B  # noqa: E402


def main(argv=None) -> None:
    tok_dir, out = (argv or sys.argv[1:])[:2]
    tok = AutoTokenizer.from_pretrained(tok_dir)
    shape = {**_LLAMA_1B, "vocab_size": len(tok), "pad_token_id": tok.pad_token_id, "max_position_embeddings": 4096}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**shape))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {n / 1e9:.2f}B parameters, vocabulary {len(tok)}")


if __name__ == "__main__":
    main()
