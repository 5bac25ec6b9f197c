"""Write SFT-length instruction pairs made of the bundled tweets, for GPU runs that need long sequences
(benchmarks/gpu_suite.py step fsdp): the tweets alone are 20-60 tokens, so their batches leave little for SEBP.

Each example's length in tokens (of the given tokenizer) follows the whole-model benchmark's ``sft``
distribution (:func:`sebp_probe.bench.bench_cases.sample_lengths`: log-normal, median 300 at 2048, up to 2048): the
prompt lists consecutive tweets of the training split and asks for the sentiment of each; the response is
the list of sentiment words (the loss reads only it, as in supervised fine-tuning).

Usage: python benchmarks/sft_long_data.py TOKENIZER_DIR OUT.jsonl [N=2000] [MAX_LENGTH=2048] [SEED=0]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sebp_probe.bench.bench_cases import sample_lengths  # noqa: E402
from sebp_probe.config import DataConfig  # noqa: E402
from sebp_probe.data.textdata import load_text_data  # noqa: E402

HEAD = "Classify the sentiment of each tweet below as negative, neutral or positive, one word per tweet.\n"


def examples(tok, n: int, max_length: int, seed: int) -> list[dict]:
    """``n`` prompt/response pairs whose token counts follow the ``sft`` lengths (each at least one tweet)."""
    data = load_text_data(DataConfig(dataset="tweets"), "classification")  # the bundled tweets' training split
    texts = [(" ".join(e["text"].split()), data.label_names[e["label"]]) for e in data.examples]
    cost = [len(tok(f"Tweet {i % 100}: {t}\n", add_special_tokens=False)["input_ids"]) + 2
            for i, (t, _) in enumerate(texts)]  # the tweet's line and its answer word
    out, at = [], 0
    for target in sample_lengths("sft", n, max_length, seed):
        lines, words, used = [], [], len(tok(HEAD)["input_ids"]) + 2
        while not lines or used + cost[at % len(texts)] <= target:
            text, label = texts[at % len(texts)]
            lines.append(f"Tweet {len(lines) + 1}: {text}")
            words.append(label)
            used += cost[at % len(texts)]
            at += 1
        out.append({"prompt": HEAD + "\n".join(lines) + "\nSentiments:", "response": " " + ", ".join(words)})
    return out


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    args = argv if argv is not None else sys.argv[1:]
    tok_dir, out = args[:2]
    n, max_length, seed = (int(a) for a in (args[2:] + ["2000", "2048", "0"][len(args[2:]):]))
    tok = AutoTokenizer.from_pretrained(tok_dir)
    rows = examples(tok, n, max_length, seed)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    lens = sorted(len(tok(r["prompt"] + r["response"])["input_ids"]) for r in rows)
    print(f"wrote {out}: {len(rows)} examples, tokens median {lens[len(lens) // 2]}, max {lens[-1]}")


if __name__ == "__main__":
    main()
