"""Cost of the analysis of a batch: median forward + backward with the gradient-statistics collector
attached, over the same without it (the budget is 1.3x).

Models are built from configs (random weights: the cost does not depend on them), batches have random
lengths, padded to --seq. Runs on the GPU when there is one.

    python scripts/collector_overhead.py                       # MiniLM- and SmolLM2-shaped, batch 32 x 128
    python scripts/collector_overhead.py --models bert-base --bf16 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import platform

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, BertConfig, LlamaConfig

from sebp_probe.analyze import measure_overhead

SHAPES = {
    "minilm": lambda: AutoModelForSequenceClassification.from_config(BertConfig(
        hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536, num_labels=3)),
    "bert-base": lambda: AutoModelForSequenceClassification.from_config(BertConfig(num_labels=3)),
    "smollm2": lambda: AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=1536, max_position_embeddings=2048, pad_token_id=0)),
}


def batches(name: str, n: int, batch: int, seq: int, side: str, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.randint(8, seq + 1, (batch,), generator=g)
        ids = torch.zeros(batch, seq, dtype=torch.long)
        mask = torch.zeros(batch, seq, dtype=torch.long)
        for i, k in enumerate(lengths.tolist()):
            sl = slice(0, k) if side == "right" else slice(seq - k, seq)
            ids[i, sl] = torch.randint(5, 20000, (k,), generator=g)
            mask[i, sl] = 1
        labels = torch.randint(0, 3, (batch,), generator=g) if name != "smollm2" else ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="minilm,smollm2")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    ap.add_argument("--output", help="also write the results as JSON here")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"{platform.processor() or 'cpu'}, " \
        f"{torch.get_num_threads()} threads"
    results = []
    for name in args.models.split(","):
        torch.manual_seed(0)
        model = SHAPES[name]().to(device)
        side = "left" if name == "smollm2" else "right"
        r = measure_overhead(model, batches(name, args.batches, args.batch, args.seq, side), args.rounds,
                             amp_dtype=torch.bfloat16 if args.bf16 else None)
        r.update(model=name, batch=args.batch, seq=args.seq, padding_side=side, where=where,
                 torch=torch.__version__)
        results.append(r)
        print(f"{name:10s} {r['amp']:5s} batch {args.batch}x{args.seq} on {where}: plain {1e3 * r['plain_s']:.1f} ms, "
              f"with collector {1e3 * r['collect_s']:.1f} ms, ratio {r['ratio']:.3f}", flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.output:
        with open(args.output, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
