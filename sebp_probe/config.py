"""Frozen, validated settings shared by analyze, heatmap and finetune."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal

from sebp_kernels import SEBPConfig
from sebp_kernels.config import MODES

from .layouts import LAYOUTS

Side = Literal["left", "right"]
TASKS = ("classification", "causal-lm", "mlm")
# Not a layout but a choice among them: finetune measures every layout and takes the fastest.
AUTO = "auto"
AUTO_HELP = "measure every layout on your batches, dense and SEBP, and train with the fastest"
# The whole-model bench's timings (sebp_probe.bench.bench_model), in the order tables and figures show them:
# eager, CUDA graphs, compiled, and each layer compiled with the step replayed as CUDA graphs.
TIMINGS = ("eager", "graphs", "compiled", "compiled_graphs")


def padding_help(auto: bool = False) -> str:
    """The --padding help: every layout of :data:`~sebp_probe.layouts.LAYOUTS` with its line (and ``auto``
    first where finetune offers it)."""
    items = [(AUTO, AUTO_HELP)] * auto + [(name, lay.help) for name, lay in LAYOUTS.items()]
    return " | ".join(f"{name} ({text})" for name, text in items) + "."

__all__ = ["DataConfig", "FinetuneConfig", "FinetuneError", "SEBPConfig", "TASKS"]


class FinetuneError(ValueError):
    """A run that cannot start or could not finish; the message is one line for the user."""


@dataclass(frozen=True)
class DataConfig:
    """Which data, how it is tokenized and padded into batches.

    dataset: ``tweets`` (bundled), a local CSV/JSON/JSONL/Parquet file, or a ``datasets`` hub name with an
    optional config after a slash or colon (``glue/sst2``, ``allenai/ai2_arc/ARC-Easy``, ``imdb``).
    split / eval_split: dataset splits (default ``train``; eval falls back to a held-out slice of train).
    padding: ``max_length`` pads every batch to ``max_length`` (what most fine-tuning scripts do);
    ``longest`` pads to the longest sample of the batch (dynamic padding); ``bucket`` draws batches of
    similar lengths and pads each to its longest; ``packed`` concatenates a batch's sequences into rows of
    ``max_length`` tokens, attention never crossing a sequence (padding-free); ``auto`` (finetune only)
    measures them on the run's own batches, dense and with SEBP, and trains with the fastest.
    padding_side: ``right`` or ``left`` (default: the tokenizer's, which is right for the bundled models).
    """

    dataset: str = "tweets"
    split: str | None = None
    eval_split: str | None = None
    text_column: str | None = None
    text_pair_column: str | None = None
    label_column: str | None = None
    padding: str = "max_length"  # a name of sebp_probe.layouts.LAYOUTS, or "auto"
    max_length: int = 128
    padding_side: Side | None = None
    batch_size: int = 32
    max_samples: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.dataset or not str(self.dataset).strip():
            raise ValueError("dataset must be a name or a path")
        if self.padding not in (*LAYOUTS, AUTO):
            raise ValueError(f"padding must be one of {', '.join(LAYOUTS)} or {AUTO}, got {self.padding!r}")
        if self.padding_side not in (None, "left", "right"):
            raise ValueError(f"padding side must be 'left' or 'right', got {self.padding_side!r}")
        if not isinstance(self.max_length, int) or self.max_length < 2:
            raise ValueError(f"max length must be an integer >= 2, got {self.max_length}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch size must be an integer >= 1, got {self.batch_size}")
        if self.max_samples is not None and self.max_samples < 1:
            raise ValueError(f"max samples must be >= 1, got {self.max_samples}")

    def to_dict(self) -> dict:
        return asdict(self)


METHODS = ("dense", "sebp", "resprop")  # resprop: gradient reuse (approximate), sebp_kernels.resprop
PRECISIONS = ("fp32", "bf16", "fp16")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
GRAPHED_COMPILE_MODES = ("reduce-overhead", "max-autotune")  # Inductor records CUDA graphs in these
# --compile auto: --padding auto times eager and compiled (this mode) candidates and compiles where that pays
COMPILE_AUTO, AUTO_COMPILE_MODE = "auto", "default"
# --compile-scope: each transformer layer compiled in place (one layer's compile) or the whole model
COMPILE_SCOPES = ("layers", "model")
DEFAULT_MAX_STEPS = 200


def _pos_int(value, what: str, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class FinetuneConfig:
    """One fine-tuning run (or a dense-vs-SEBP comparison) of ``finetune``.

    SEBP settings: ``mode`` is inferred when not given: ``topk`` with ``top_n``, ``sampled`` with ``budget``,
    ``threshold`` with ``eps``, ``auto_eps`` or ``report``, else ``exact``. ``sampled`` (approximate,
    experimental: :mod:`sebp_kernels.sampling`) keeps the ``budget`` share of each layer's non-zero rows for dW
    in expectation (``auto``, the default: per layer, the fewest rows whose added variance stays under the
    variance budget, ``variance_tau`` of the SGD variance), rescaled so that the gradient is unbiased (dX too with ``sample_dx``), after
    ``sample_warmup`` exact optimizer steps; its draws come from ``seed``; every ``guard_every`` steps the
    exact gradient is computed beside it (:mod:`~sebp_probe.train.sample_guard`). ``auto_eps`` runs the analysis
    first; ``report`` reads one.
    ``dense_fallback``: a layer whose measured share of active rows is above it stays dense;
    ``calib_budget``: the calibration (``--padding auto``'s timing, then SEBP's) takes at most this share of the
    run's estimated time (:mod:`sebp_probe.train.calibration_budget`);
    ``fallback_if_slower``: the whole model stays dense when SEBP's step (forward + backward) measures slower at
    calibration.
    ``sebp_norms``: where SEBP runs, the LayerNorms/RMSNorms get the SEBP backward too (exact; timed with the
    linear layers in calibration). ``sebp_acts``: likewise the MLP activations (SwiGLU, GELU; see
    :func:`~sebp_probe.model.patch.patch_activations`). ``cuda_graphs``: each micro-step's forward and backward
    are replayed as CUDA graphs (:mod:`sebp_probe.train.graphs`), one pair per batch shape, in calibration too
    (one GPU); with padding ``longest`` the batches are padded to a multiple of ``graph_bucket`` tokens.
    ``head``: ``labelled`` computes the loss without the rows no loss reaches where that is exact (the LM
    head and the last layer on labelled rows only; a BERT/RoBERTa classifier's last layer on its [CLS] rows;
    :mod:`sebp_probe.model.losses`), ``full`` the model's own loss, ``cce`` a causal LM's backbone and then
    Cut-Cross-Entropy on the labelled rows (:mod:`sebp_probe.model.cce_head`). ``compile``: a ``torch.compile``
    mode for the training model (one of ``COMPILE_MODES``); the SEBP layers' backward compiles as ``sebp::`` custom ops
    (:mod:`sebp_kernels.registry`); on a GPU, the modes that record CUDA graphs (``reduce-overhead``,
    ``max-autotune``) also time calibration as graph replays. ``compile_scope``: ``layers`` compiles each
    transformer layer in place (the layers share one compile; the embeddings, the head and the loss run eagerly:
    :func:`~sebp_probe.train.compiling.compile_layers`), ``model`` the whole model (and, with the labelled-rows
    head, the whole step's loss); ``layers`` falls back to ``model`` for a model without a layer stack that
    sebp-probe knows. ``deterministic``: torch's deterministic algorithms (and cuBLAS's fixed workspace), so
    that a resumed run computes the uninterrupted run's bits, and so does a second run of the same command
    where nothing is chosen by timing (:mod:`~sebp_probe.train.determinism`; slower; an op without a
    deterministic implementation stops the run at its first call, in one line).
    Length: ``max_steps`` optimizer steps, or ``epochs`` (default: ``DEFAULT_MAX_STEPS`` steps).
    ``eval_steps``/``save_steps``: None means 4 evaluations per run and a checkpoint at the end only.
    ``probe_every``: the gradient statistics of ``analyze`` on every Nth step's own backward
    (:mod:`~sebp_probe.train.probe_steps`).
    """

    model: str = "minilm"
    data: DataConfig = field(default_factory=lambda: DataConfig(max_length=64, batch_size=16, padding="auto"))
    output_dir: str = "runs/finetune"
    task: str | None = None
    method: str = "sebp"
    reuse: float = 0.9
    compare: bool = False
    sebp_first: bool = False
    mode: str | None = None
    eps: float | None = None
    top_n: int | None = None
    budget: float | str | None = None
    sample_dx: bool = False
    sample_warmup: int = 10
    guard_every: int = 50
    variance_tau: float = 0.025
    auto_eps: bool = False
    report: str | None = None
    targets: tuple[str, ...] | None = None
    backend: str = "auto"
    dense_fallback: float = 0.9
    fallback_if_slower: bool = True
    sebp_norms: bool = False
    sebp_acts: bool = False
    head: str = "labelled"
    cuda_graphs: bool = False
    graph_bucket: int = 32
    compile: str | None = None
    compile_scope: str = "layers"
    deterministic: bool = False
    max_steps: int | None = None
    epochs: float | None = None
    lr: float = 5e-5
    weight_decay: float = 0.0
    warmup_ratio: float = 0.06
    max_grad_norm: float | None = 1.0
    grad_accum: int = 1
    precision: str = "fp32"
    lora: bool = False
    lora_r: int = 8
    lora_alpha: int = 16
    eval_steps: int | None = None
    probe_every: int | None = None
    eval_samples: int | None = 1000
    save_steps: int | None = None
    save_total_limit: int = 2
    calib_batches: int = 2
    calib_budget: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.data, DataConfig):
            raise TypeError(f"data must be a DataConfig, got {type(self.data).__name__}")
        if self.task is not None and self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; choose one of {', '.join(TASKS)}")
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if isinstance(self.reuse, bool) or not isinstance(self.reuse, (int, float)) or not 0 <= self.reuse < 1:
            raise ValueError(f"reuse must be a share in [0, 1), got {self.reuse!r}")
        if self.compare and self.method == "dense":
            raise ValueError("--compare trains dense beside --method sebp or resprop: pick one of those")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"unknown SEBP mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not math.isfinite(self.lr) \
                or self.lr <= 0:
            raise ValueError(f"learning rate must be a finite number > 0, got {self.lr!r}")
        if not (0 <= self.weight_decay < math.inf):
            raise ValueError(f"weight decay must be >= 0, got {self.weight_decay}")
        if not (0 <= self.warmup_ratio < 1):
            raise ValueError(f"warmup ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.max_grad_norm is not None and not (0 < self.max_grad_norm < math.inf):
            raise ValueError(f"max grad norm must be > 0 (or None), got {self.max_grad_norm}")
        if self.max_steps is not None and self.epochs is not None:
            raise ValueError("give max steps or epochs, not both")
        if self.max_steps is not None:
            _pos_int(self.max_steps, "max steps")
        if self.epochs is not None and not (0 < self.epochs < math.inf):
            raise ValueError(f"epochs must be > 0, got {self.epochs}")
        _pos_int(self.grad_accum, "gradient accumulation steps")
        for value, what in ((self.eval_steps, "eval steps"), (self.eval_samples, "eval samples"),
                            (self.save_steps, "save steps")):
            if value is not None:
                _pos_int(value, what)
        _pos_int(self.save_total_limit, "save total limit")
        if self.probe_every is not None:
            _pos_int(self.probe_every, "--probe-every")
            if self.cuda_graphs:
                raise ValueError("--probe-every analyses a step's own backward, which CUDA-graph replays run "
                                 "without hooks: leave out --cuda-graphs")
        _pos_int(self.calib_batches, "calibration batches", 0)
        _pos_int(self.lora_r, "LoRA rank")
        if not self.lora_alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.lora_alpha}")
        if not (0 < self.dense_fallback <= 1):
            raise ValueError(f"dense fallback density must be in (0, 1], got {self.dense_fallback}")
        if not (isinstance(self.calib_budget, (int, float)) and 0 < self.calib_budget <= 1):
            raise ValueError(f"--calib-budget must be a share of the run's time in (0, 1], got {self.calib_budget!r}")
        if self.targets is not None and (isinstance(self.targets, str) or not all(
                isinstance(t, str) and t for t in self.targets)):
            raise ValueError("targets must be a tuple of module names or patterns")
        _pos_int(self.graph_bucket, "graph bucket")
        if self.head not in ("labelled", "full", "cce"):
            raise ValueError(f"unknown head {self.head!r}; choose labelled, full or cce")
        if self.cuda_graphs and self.precision == "fp16":
            raise ValueError("--cuda-graphs does not take --fp16 (its loss scaler is updated on the host); "
                             "use --bf16")
        if self.compile is not None:
            if self.compile not in (*COMPILE_MODES, COMPILE_AUTO):
                raise ValueError(f"unknown compile mode {self.compile!r}; choose one of {', '.join(COMPILE_MODES)} "
                                 f"or {COMPILE_AUTO}")
            if self.compile == COMPILE_AUTO and self.data.padding != "auto":
                raise ValueError("--compile auto chooses by timing, which --padding auto does: add --padding auto, "
                                 "or give a compile mode")
            if self.compile in GRAPHED_COMPILE_MODES and self.precision != "fp32":
                raise ValueError(f"--compile {self.compile} records CUDA graphs itself, and under autocast that "
                                 f"failed in this training step (bf16, torch 2.11: an output of its graphs was read "
                                 f"after they had overwritten it); with --{self.precision} use --compile default "
                                 f"--cuda-graphs (sebp-probe replays the compiled layers as graphs) or --compile "
                                 f"max-autotune-no-cudagraphs")
            if self.cuda_graphs and (self.compile in GRAPHED_COMPILE_MODES or self.compile == COMPILE_AUTO
                                     or self.compile_scope != "layers"):
                raise ValueError(f"--cuda-graphs replays the step with each layer compiled (--compile default or "
                                 f"max-autotune-no-cudagraphs, --compile-scope layers); --compile {self.compile} "
                                 f"with --compile-scope {self.compile_scope} does not go with it"
                                 + (" (it records CUDA graphs itself)" if self.compile in GRAPHED_COMPILE_MODES
                                    else ""))
        if self.compile_scope not in COMPILE_SCOPES:
            raise ValueError(f"unknown compile scope {self.compile_scope!r}; choose one of {', '.join(COMPILE_SCOPES)}")
        graphed = self.cuda_graphs or self.compile in GRAPHED_COMPILE_MODES
        if graphed and self.data.padding in LAYOUTS and not LAYOUTS[self.data.padding].fixed_shapes:
            fixed = [name for name, lay in LAYOUTS.items() if lay.fixed_shapes]
            raise ValueError(f"{'--cuda-graphs' if self.cuda_graphs else '--compile ' + self.compile} records CUDA "
                             f"graphs, which need few fixed batch shapes; {self.data.padding} batches change from "
                             f"batch to batch: use --padding {', '.join(fixed)} or {AUTO}")
        if self.sebp_first and not self.compare:
            raise ValueError("--sebp-first orders the two runs of --compare: add --compare")
        self._check_sebp_settings()

    def _check_sebp_settings(self) -> None:
        if self.eps is not None:
            if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not math.isfinite(self.eps) \
                    or self.eps < 0:
                raise ValueError(f"eps must be a finite number >= 0, got {self.eps!r}")
        if self.top_n is not None:
            _pos_int(self.top_n, "top-n (N)")
            rows = self.data.batch_size * self.data.max_length
            if self.top_n >= rows:
                raise ValueError(f"top-n {self.top_n} keeps every row: a micro-batch has at most batch size x max "
                                 f"length = {rows} rows; pick N below that")
        self._check_sampled()
        if self.auto_eps and self.report:
            raise ValueError("--auto-eps runs the analysis and --report reads one: pass only one of them")
        if self.auto_eps or self.report:
            clash = [n for n, v in (("--eps", self.eps is not None), ("--top-n", self.top_n is not None),
                                    ("--targets", self.targets is not None)) if v]
            if clash:
                src = "--auto-eps" if self.auto_eps else "--report"
                raise ValueError(f"{src} sets the layers and their eps/N itself: drop {', '.join(clash)} "
                                 "(or drop " + src + " and give the settings directly)")
        sebp_given = [n for n, v in (("eps", self.eps is not None), ("top-n", self.top_n is not None),
                                     ("budget", self.budget is not None), ("auto-eps", self.auto_eps),
                                     ("report", bool(self.report))) if v]
        if self.method != "sebp" and (sebp_given or self.mode):
            raise ValueError(f"method {self.method} uses no SEBP settings, but got {', '.join(sebp_given or ['mode'])}")
        if self.eps is not None and self.top_n is not None and self.mode is None:
            raise ValueError("both eps and top-n given: pass --mode threshold or --mode topk")
        mode = self.sebp_mode
        if mode == "exact" and (self.eps is not None or self.top_n is not None or self.auto_eps):
            raise ValueError("exact mode skips only all-zero rows and takes no eps, top-n or --auto-eps")
        if mode == "threshold" and self.eps is None and not (self.auto_eps or self.report):
            raise ValueError("threshold mode needs --eps, --auto-eps or --report")
        if mode == "topk" and self.top_n is None and not (self.auto_eps or self.report):
            raise ValueError("topk mode needs --top-n, --auto-eps or --report")
        if mode == "threshold" and self.top_n is not None or mode == "topk" and self.eps is not None:
            raise ValueError(f"{mode} mode does not use {'top-n' if mode == 'threshold' else 'eps'}")

    def _check_sampled(self) -> None:
        b = self.budget
        if b is not None and b != "auto" and (isinstance(b, bool) or not isinstance(b, (int, float))
                                              or not 0 < b <= 1):
            raise ValueError(f"--budget must be a share in (0, 1] (of each layer's non-zero rows kept) or auto, "
                             f"got {b!r}")
        _pos_int(self.sample_warmup, "sample warm-up steps", 0)
        _pos_int(self.guard_every, "--guard-every")
        t = self.variance_tau
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ValueError(f"--variance-tau must be a number > 0 (a share of the SGD variance), got {t!r}")
        if self.sebp_mode != "sampled":
            if b is not None or self.sample_dx or t != 0.025:
                raise ValueError(f"--budget, --sample-dx and --variance-tau belong to --mode sampled, "
                                 f"not {self.sebp_mode}")
            return
        if t != 0.025 and b not in (None, "auto"):
            raise ValueError("--variance-tau sets --budget auto's rule; a fixed --budget share does not use it")
        clash = [n for n, v in (("--eps", self.eps is not None), ("--top-n", self.top_n is not None),
                                ("--auto-eps", self.auto_eps), ("--report", bool(self.report))) if v]
        if clash:
            raise ValueError(f"--mode sampled takes --budget, not {', '.join(clash)}")

    @property
    def sebp_mode(self) -> str:
        if self.mode is not None:
            return self.mode
        if self.top_n is not None:
            return "topk"
        if self.budget is not None:
            return "sampled"
        if self.eps is not None or self.auto_eps or self.report:
            return "threshold"
        return "exact"

    @property
    def compile_mode(self) -> str | None:
        """The ``torch.compile`` mode compiled candidates and runs use (``auto``: ``AUTO_COMPILE_MODE``)."""
        return AUTO_COMPILE_MODE if self.compile == COMPILE_AUTO else self.compile

    def optimizer_steps(self, n_batches: int) -> int:
        """The run's planned optimizer steps with ``n_batches`` micro-batches an epoch."""
        if self.max_steps is not None:
            return self.max_steps
        if self.epochs is not None:
            return max(1, math.ceil(self.epochs * n_batches / self.grad_accum))
        return DEFAULT_MAX_STEPS

    @property
    def uses_report(self) -> bool:
        return bool(self.auto_eps or self.report)

    def sebp_config(self) -> SEBPConfig:
        """The one setting for every patched layer when no report gives per-layer ones."""
        if self.sebp_mode == "sampled":  # the warm-up counts each layer's backwards: grad_accum per step
            b = self.budget if self.budget not in (None, "auto") else "auto"
            return SEBPConfig(mode="sampled", backend=self.backend, budget=b if b == "auto" else float(b),
                              sample_dx=self.sample_dx, seed=self.seed, warmup=self.sample_warmup * self.grad_accum,
                              variance_tau=float(self.variance_tau))
        return SEBPConfig(mode=self.sebp_mode, eps=float(self.eps or 0.0), top_n=self.top_n, backend=self.backend)

    def methods(self) -> tuple[str, ...]:
        """The runs in the order they train: with --compare dense then the method (--sebp-first: the other way
        round; where the host's speed drifts during a session, the two orders together show how much)."""
        if not self.compare:
            return (self.method,)
        return (self.method, "dense") if self.sebp_first else ("dense", self.method)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["targets"] = list(self.targets) if self.targets is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "FinetuneConfig":
        d = dict(d)
        d["data"] = DataConfig(**d["data"])
        if d.get("targets") is not None:
            d["targets"] = tuple(d["targets"])
        return cls(**d)
