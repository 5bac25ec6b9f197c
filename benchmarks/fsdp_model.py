"""Write a Llama model with random weights (seed 0) and a tokenizer to a directory, for the GPU fine-tuning runs
of benchmarks/gpu_suite.py (steps fsdp*, compare; the device machine has no hub access).

Shapes: ``1b`` (default), sebp_probe.bench.bench_cases' Llama-3.2-1B; ``small``, a ~120M Llama (12 layers of 768).
The vocabulary is the tokenizer's: the bundled MiniLM's (30522 word pieces), so that the bundled tweets
tokenize without a download.

Usage: python benchmarks/fsdp_model.py TOKENIZER_DIR OUT_DIR [1b|small]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig  # noqa: E402

from sebp_probe.bench.bench_cases import MODEL_CASES  # noqa: E402


SHAPES = {"1b": MODEL_CASES["llama-3.2-1b-sft"].config,
          "small": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                        intermediate_size=2048, tie_word_embeddings=False)}


def main(argv=None) -> None:
    args = argv or sys.argv[1:]
    tok_dir, out = args[:2]
    tok = AutoTokenizer.from_pretrained(tok_dir)
    shape = {**SHAPES[args[2] if len(args) > 2 else "1b"], "vocab_size": len(tok), "pad_token_id": tok.pad_token_id,
             "max_position_embeddings": 4096}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**shape))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {n / 1e9:.2f}B parameters, vocabulary {len(tok)}")


if __name__ == "__main__":
    main()
