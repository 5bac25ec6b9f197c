"""The sebp-probe command line: parse, call, print. Errors become one clear line and a non-zero exit."""
from __future__ import annotations

import functools
import logging
import sys

import typer
from rich.console import Console

from .config import COMPILE_MODES, padding_help
from .layouts import PADDED
from .outputs import check_output_file
from .tables import (batch_progress, bench_tables, console, finetune_progress, print_analysis, print_finetune_summary,
                     print_note)

app = typer.Typer(
    name="sebp-probe",
    help="Find and exploit gradient sparsity in Transformer fine-tuning (SEBP).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
err_console = Console(stderr=True)

# Exit codes: 0 ok, 1 bad input or a failed run (one line on stderr), 130 interrupted.
EXIT_ERROR = 1
EXIT_INTERRUPTED = 130


class UserError(Exception):
    """An error caused by the user's input; printed as one line without a traceback."""


class _Notes(logging.Handler):
    """Prints each distinct note said outside a command's own collection (:mod:`sebp_probe.notes`: the
    benchmark's, say) once, on stderr, as the commands print theirs."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.said: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        msg = " ".join(record.getMessage().split())
        if msg not in self.said:
            self.said.add(msg)
            print_note(err_console, msg)


def one_line_errors(fn):
    """Turn expected failures into one line on stderr and a meaningful exit code; the library's fallback notes
    are one line each on stderr too."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        notes, log = _Notes(), logging.getLogger("sebp_probe")
        log.addHandler(notes)
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except KeyboardInterrupt:
            err_console.print("[red]interrupted[/red]")
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except (UserError, ValueError, FileNotFoundError, OSError, KeyError, TypeError, RuntimeError) as e:
            msg = " ".join(str(e).split()) or type(e).__name__
            err_console.print(f"[red]error:[/red] {msg}", highlight=False, soft_wrap=True)
            raise typer.Exit(EXIT_ERROR) from None
        finally:
            log.removeHandler(notes)

    return wrapper


@app.callback(invoke_without_command=True)
def _main(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", help="Print the version and exit."),
) -> None:
    """sebp-probe: where does your backward pass waste work, and how much of it can SEBP get back?"""
    if version:
        from ._version import __version__

        console.print(f"sebp-probe {__version__}")
        raise typer.Exit()
    if ctx.invoked_subcommand is None:
        console.print(ctx.get_help())
        raise typer.Exit()


# ------------------------------------------------------------------------------------------------ finetune


_DATA_HELP = ("Bundled name (tweets; tweets-sft: instruction pairs for causal LMs), local CSV/JSON/JSONL/Parquet "
              "file, or a datasets hub name (glue/sst2).")
_MODEL_HELP = "Bundled name (minilm, smollm2), local Hugging Face directory, or hub id."
# Options that analyze, heatmap and finetune share, declared once (typer reads these defaults per command).
_TASK = typer.Option(None, "--task", help="classification | causal-lm | mlm (masked LM, 15% masking; BERT/RoBERTa) "
                     "(default: from the model).")
_SPLIT = typer.Option(None, "--split", help="Dataset split (default train).")
_TEXT = typer.Option(None, "--text-column", help="Text (or prompt) column (default: detected).")
_PAIR = typer.Option(None, "--text-pair-column", help="Second text of sentence pairs.")
_LABEL = typer.Option(None, "--label-column", help="Label column (default: detected).")
_PADDING = typer.Option("max_length", "--padding", help=padding_help())
_PADDING_SIDE = typer.Option(None, "--padding-side", help="left | right (default: the tokenizer's).")
_MIN_GAP = typer.Option(1.0, "--min-gap", help="Decades between noise and signal needed for a knee.")
_DEVICE = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N.")


def _budget(value: str | None) -> float | None:
    """``--budget``: a share (checked by FinetuneConfig); ``auto`` is not built yet."""
    if value is None:
        return None
    if value.strip().lower() == "auto":
        raise UserError("--budget auto is not built yet: give a share in (0, 1], e.g. --budget 0.3")
    try:
        return float(value)
    except ValueError:
        raise UserError(f"--budget must be a share in (0, 1], got {value!r}") from None


@app.command("finetune")
@one_line_errors
def finetune_cmd(
    model: str = typer.Argument("minilm", help=_MODEL_HELP),
    dataset: str = typer.Argument("tweets", help=_DATA_HELP),
    auto_eps: bool = typer.Option(False, "--auto-eps", help="Run the analysis first and use its per-layer eps/N."),
    report: str = typer.Option(None, "--report", help="Use the per-layer settings of this analysis report."),
    eps: float = typer.Option(None, "--eps", help="One threshold for every layer (threshold mode)."),
    top_n: int = typer.Option(None, "--top-n", help="Rows kept per layer (topk mode)."),
    mode: str = typer.Option(None, "--mode", help="exact | threshold | topk | sampled (approximate, experimental: "
                             "unbiased row sampling, see --budget) (default: from the other options)."),
    budget: str = typer.Option(None, "--budget", help="sampled mode: the share of each layer's non-zero rows of "
                               "dL/dY kept for dW in expectation, in (0, 1] (rescaled: unbiased)."),
    sample_dx: bool = typer.Option(False, "--sample-dx", help="sampled mode: dX from the sample too (default: "
                                   "dX exact)."),
    sample_warmup: int = typer.Option(10, "--sample-warmup", help="sampled mode: exact optimizer steps first."),
    method: str = typer.Option("sebp", "--method", help="dense | sebp | resprop (gradient reuse: approximate, "
                               "see --reuse)."),
    reuse: float = typer.Option(0.9, "--reuse", help="resprop: share of the rows of dL/dY - P reused from the "
                                "previous step instead of computed (0 = exact)."),
    compare: bool = typer.Option(False, "--compare", help="Train dense, then SEBP, same seed and data order."),
    sebp_first: bool = typer.Option(False, "--sebp-first", help="With --compare: train SEBP first, then "
                                    "dense (run both orders to see how much the host's speed drifts)."),
    targets: str = typer.Option(None, "--targets", help="Comma-separated layers/patterns to patch (default: "
                                "attention + MLP projections); 'all-linear' works."),
    dense_fallback: float = typer.Option(0.9, "--dense-fallback", help="Layers with more active rows than "
                                         "this share run dense."),
    always_sebp: bool = typer.Option(False, "--always-sebp", help="Keep SEBP even where calibration measures "
                                     "it slower than dense."),
    sebp_acts: bool = typer.Option(False, "--sebp-acts", help="Also run the MLP activations (SwiGLU, GELU) as "
                                   "SEBP activations (exact; the linears before them skip their row selection)."),
    sebp_norms: bool = typer.Option(False, "--sebp-norms", help="Also give the LayerNorms/RMSNorms the SEBP "
                                    "backward (exact; calibrated together with the linear layers)."),
    head: str = typer.Option("labelled", "--head", help="labelled: the loss without the rows no loss reaches "
                             "(LM head and last layer on the labelled rows; a classifier's last layer on [CLS]) "
                             "where that is exact, and under --padding auto timed against the model's own head "
                             "(and, on a GPU where cut-cross-entropy imports, against cce) | full: the model's own "
                             "loss | cce: a causal LM's backbone, then Cut-Cross-Entropy on the labelled rows."),
    cuda_graphs: bool = typer.Option(False, "--cuda-graphs", help="Replay each micro-step's forward and backward "
                                     "as CUDA graphs, one pair per batch shape (one GPU): no host launch overhead, "
                                     "in calibration too; with --compile default, each layer compiled and then "
                                     "replayed."),
    graph_bucket: int = typer.Option(32, "--graph-bucket", help="With --cuda-graphs and --padding longest: pad "
                                     "each batch to a multiple of this many tokens (fewer shapes to capture)."),
    compile_mode: str = typer.Option(None, "--compile", metavar="MODE", help="torch.compile the training model "
                                     "in this mode: default | reduce-overhead (CUDA graphs; the fast one on a "
                                     "GPU) | max-autotune | max-autotune-no-cudagraphs | auto (with --padding "
                                     "auto: time eager and compiled, compile where the whole run's estimate, "
                                     "compile time included, says it pays; the default on a GPU with --padding "
                                     "auto) | off (eager; the default otherwise)."),
    compile_scope: str = typer.Option("layers", "--compile-scope", help="With --compile: what compiles: "
                                      "layers (each transformer layer in place; the embeddings, head and loss "
                                      "run eagerly; one layer's compile, seconds) | model (the whole model, and "
                                      "with the labelled-rows head the whole step; minutes for a 1B model)."),
    deterministic: bool = typer.Option(False, "--deterministic", help="torch's deterministic algorithms "
                                       "(slower): a resumed run computes the uninterrupted run's bits, and so "
                                       "does a second run of the same command where nothing is chosen by timing "
                                       "(--padding and --compile other than auto, --always-sebp)."),
    task: str = _TASK,
    split: str = typer.Option(None, "--split", help="Training split (default train)."),
    eval_split: str = typer.Option(None, "--eval-split", help="Held-out split (default: test for tweets, "
                                   "else 10% of train)."),
    text_column: str = _TEXT,
    label_column: str = _LABEL,
    max_samples: int = typer.Option(None, "--max-samples", help="Use at most this many training examples."),
    eval_samples: int = typer.Option(1000, "--eval-samples", help="Evaluate on at most this many examples."),
    padding: str = typer.Option("auto", "--padding", help=padding_help(auto=True)),
    max_length: int = typer.Option(64, "--max-length"),
    batch_size: int = typer.Option(16, "--batch-size", help="Per process (and per micro-batch)."),
    grad_accum: int = typer.Option(1, "--grad-accum", help="Micro-batches per optimizer step."),
    epochs: float = typer.Option(None, "--epochs"),
    max_steps: int = typer.Option(None, "--max-steps", help="Optimizer steps (default 200 unless --epochs)."),
    lr: float = typer.Option(5e-5, "--lr"),
    warmup_ratio: float = typer.Option(0.06, "--warmup-ratio"),
    bf16: bool = typer.Option(False, "--bf16", help="bfloat16 autocast."),
    fp16: bool = typer.Option(False, "--fp16", help="float16 autocast with loss scaling (GPU)."),
    lora: bool = typer.Option(False, "--lora", help="Train LoRA adapters (peft); SEBP on the frozen base layers "
                              "computes no dW."),
    lora_r: int = typer.Option(8, "--lora-r"),
    eval_steps: int = typer.Option(None, "--eval-steps", help="Evaluate every N steps (default: steps // 4, "
                                   "at least 1) and at the last step."),
    save_steps: int = typer.Option(None, "--save-steps", help="Checkpoint every N steps (default: at the end, "
                                   "and on Ctrl-C/SIGTERM)."),
    output_dir: str = typer.Option("runs/finetune", "--output-dir", "-o"),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --output-dir from its last checkpoint."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the run in --output-dir."),
    seed: int = typer.Option(0, "--seed"),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON instead of a table."),
) -> None:
    """Fine-tune with the SEBP linear (and measure it against dense).

    Examples:

    - `sebp-probe finetune` : MiniLM on the bundled tweets, 200 steps; the fastest of every padding layout, dense
      or with exact SEBP, measured on your batches first (CPU: minutes)
    - `sebp-probe finetune minilm tweets --padding packed --compare` : dense vs SEBP on padding-free batches
    - `sebp-probe finetune minilm tweets --auto-eps --compare -o runs/auto` : analysis, then dense vs SEBP
    - `sebp-probe finetune minilm tweets --report report.json` : per-layer settings of `sebp-probe analyze -o report.json`
    - `sebp-probe finetune ./my-model data.csv --eps 1e-6 --bf16 --lora --epochs 1`
    - `accelerate launch --multi_gpu --num_processes 2 -m sebp_probe finetune minilm tweets --compare` : DDP

    Ctrl-C or SIGTERM writes a checkpoint and stops (exit 130); `--resume` continues it. Output: run_config.json,
    metrics.jsonl, summary.json, loss.png, eval.png, model/ (plain Hugging Face) and checkpoints/.
    """
    from .config import DataConfig, FinetuneConfig
    from .train.finetune import finetune

    if bf16 and fp16:
        raise UserError("--bf16 and --fp16 exclude each other")
    data = DataConfig(dataset=dataset, split=split, eval_split=eval_split, text_column=text_column,
                      label_column=label_column, padding=padding, max_length=max_length, batch_size=batch_size,
                      max_samples=max_samples, seed=seed)
    cfg = FinetuneConfig(
        model=model, data=data, output_dir=output_dir, task=task, method=method, reuse=reuse, compare=compare,
        sebp_first=sebp_first,
        mode=mode,
        eps=eps, top_n=top_n, budget=_budget(budget), sample_dx=sample_dx, sample_warmup=sample_warmup,
        auto_eps=auto_eps, report=report,
        targets=tuple(t.strip() for t in targets.split(",") if t.strip()) if targets else None,
        dense_fallback=dense_fallback, fallback_if_slower=not always_sebp, sebp_norms=sebp_norms, sebp_acts=sebp_acts, head=head, cuda_graphs=cuda_graphs, graph_bucket=graph_bucket,
        compile=_compile_setting(compile_mode, padding, cuda_graphs), compile_scope=compile_scope,
        deterministic=deterministic,
        max_steps=max_steps, epochs=epochs, lr=lr, warmup_ratio=warmup_ratio,
        grad_accum=grad_accum, precision="bf16" if bf16 else "fp16" if fp16 else "fp32", lora=lora, lora_r=lora_r,
        eval_steps=eval_steps, eval_samples=eval_samples, save_steps=save_steps, seed=seed)
    progress, on_event = finetune_progress(err_console if as_json else console)
    with progress:
        summary = finetune(cfg, resume=resume, overwrite=overwrite, on_event=on_event)
    if as_json:
        import json

        console.print_json(json.dumps(summary, default=str))
    else:
        print_finetune_summary(summary)
    if summary["status"] == "interrupted":
        ckpt = next((s.get("checkpoint") for s in (summary.get("runs") or {"": summary}).values()
                     if s.get("status") == "interrupted"), None)
        err_console.print(f"interrupted: checkpoint {ckpt}; continue with the same command and --resume",
                          highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_INTERRUPTED)


# --------------------------------------------------------------------------------------------------- bench


@app.command("bench")
@one_line_errors
def bench_cmd(
    model: str = typer.Argument("bert-base", help="Shape set (bert-base, llama-3.2-3b, llama-3.2-1b, "
                                "qwen2.5-1.5b, qwen2.5-0.5b), local model directory or hub id; with --scope "
                                "model a whole-model case (bert-base, llama-3.2-1b-sft, qwen2.5-0.5b-sft, "
                                "llama-3.2-3b, qwen2.5-1.5b)."),
    rows: int = typer.Option(None, "--rows", "-M", help="Rows of dL/dY (batch x seq tokens)."),
    in_features: int = typer.Option(None, "--in-features", help="One explicit layer (with --out-features)."),
    out_features: int = typer.Option(None, "--out-features"),
    seq: int = typer.Option(None, "--seq", help="Tokens per sequence: active rows are laid out as right padding."),
    densities: str = typer.Option("0.01,0.05,0.1,0.2,0.5,1.0", "--densities", "-d",
                                  help="Fractions of active rows, comma-separated."),
    scope: str = typer.Option("layers", "--scope", help="layers | model (whole-model forward+backward) | all."),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16 | fp16 | fp32."),
    mode: str = typer.Option("exact", "--mode", help="exact | threshold | topk (N = active rows)."),
    repeats: int = typer.Option(30, "--repeats", help="Timed repeats per measurement (median)."),
    model_repeats: int = typer.Option(5, "--model-repeats", help="Timed steps per batch in the whole-model run."),
    model_batches: int = typer.Option(8, "--model-batches", help="Whole model: batches in the pool of sequences "
                                      "that every layout lays out."),
    output: str = typer.Option(None, "--output", "-o", help="Write the results (with GPU, versions, date, "
                               "command) to this JSON file."),
    graphs: bool = typer.Option(False, "--graphs", help="Whole model: also time each step as CUDA-graph "
                                "replays (no host launch overhead) where the batch has a fixed shape."),
    figure: str = typer.Option(None, "--figure", help="Whole model: draw step ms per layout, dense vs SEBP (vs "
                               "Liger), to this image (.png, .pdf, .svg)."),
    tiny: bool = typer.Option(False, "--tiny", help="Whole model: the case shrunk to hidden size 32 and 2 layers "
                              "(same layouts and labels); runs on a CPU without a GPU (a check, not a timing)."),
    pad_mask: bool = typer.Option(True, "--pad-mask/--no-pad-mask", help="Whole model, decoders: pass the "
                                  "padding mask (default, as a data collator does) or leave it out (right "
                                  "padding: same loss and gradients, causal attention kernel)."),
    breakdown: bool = typer.Option(False, "--breakdown", help="Whole model: split one backward's GPU kernel "
                                   "time by kind (GEMMs, attention, SEBP, elementwise, ...)."),
    norms: bool = typer.Option(False, "--norms", help="Whole model: the SEBP run also swaps LayerNorm/RMSNorm "
                               "for the SEBP norm (exact: their zero rows of dL/dY skipped too)."),
    acts: bool = typer.Option(False, "--acts", help="Whole model: the SEBP run also runs the MLP activations "
                              "(SwiGLU, GELU) as SEBP activations (their zero rows skipped; the linears "
                              "before them skip their row selection)."),
    keep_dx: bool = typer.Option(False, "--keep-dx", help="Whole model: the SEBP run keeps each dX's zero rows "
                                 "between backwards (sebp_kernels.zero_rows)."),
    pad_rows: bool = typer.Option(True, "--pad-rows/--no-pad-rows", help="Whole model: the SEBP linears take "
                                  "a batch's padding rows from its attention mask (checked once) instead of "
                                  "selecting them (sebp_kernels.pad_rows)."),
    compile_mode: str = typer.Option(None, "--compile", metavar="MODE", help="Whole model: also time every "
                                     "entry compiled (torch.compile with dynamic shapes, once per entry; compile "
                                     "seconds and recompiles per row) in this mode: default | reduce-overhead | "
                                     "max-autotune | max-autotune-no-cudagraphs. SEBP entries patch the linears "
                                     "only unless --norms/--acts (Inductor fuses those)."),
    compile_scope: str = typer.Option("layers", "--compile-scope", help="Whole model, with --compile: what "
                                      "compiles: each transformer layer, the embeddings, head and loss eager "
                                      "(layers: one layer's compile, seconds) or the whole step (step: "
                                      "minutes on a 1B model)."),
    layouts: str = typer.Option(None, "--layouts", help="Whole model: only these layouts, comma-separated "
                                "(max_length, longest, bucket, packed; default all)."),
    methods: str = typer.Option(None, "--methods", help="Whole model: only these methods, comma-separated "
                                "(dense, sebp, liger, cce; default all), or one head of a method as method:head (sebp:labelled)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what would run and exit (no GPU needed)."),
) -> None:
    """Time the SEBP backward on the GPU against dense cuBLAS, the torch reference and the ideal.

    Examples:

    - `sebp-probe bench` : BERT-base layer shapes (16384 rows), densities 0.01 ... 1.0
    - `sebp-probe bench llama-3.2-3b --densities 0.1,0.2,0.5 -o results.json`
    - `sebp-probe bench --rows 8192 --in-features 4096 --out-features 11008`
    - `sebp-probe bench ./my-model --rows 8192 --seq 256` : shapes read from a local config
    - `sebp-probe bench bert-base --scope model --graphs -o bert.json --figure bert.png` : whole model, every
      layout (max_length, longest, bucket, packed), dense vs SEBP, eager and as CUDA graphs
    - `sebp-probe bench llama-3.2-1b-sft --scope model --norms --acts` : SFT batches, the labelled-rows head
      too, Liger-Kernel where it imports; SEBP on the norms and MLP activations as well
    - `sebp-probe bench llama-3.2-3b --scope model --no-pad-mask --breakdown` : causal attention without the
      padding mask, and where the backward's GPU time goes
    - `sebp-probe bench llama-3.2-1b-sft --scope model --tiny` : the whole run on a tiny model (CPU: seconds)
    - `sebp-probe bench llama-3.2-1b-sft --scope model --compile default --layouts packed,longest` : compiled
      entries too (and Cut-Cross-Entropy, Liger compiled), on two layouts
    - `sebp-probe bench llama-3.2-3b --scope all --dry-run` : show the plan only

    Per layer: dense = cuBLAS backward; ideal = cuBLAS on the k active rows already contiguous; ideal +io =
    the ideal plus the bytes SEBP cannot skip (dY's inactive rows read, dX's zero rows written) at the fill
    bandwidth measured in the run; triton = the fused SEBP backward (selection included); torch ref = the
    pure-torch SEBP. Whole model: step = forward + backward of one batch (median ms, mean over the batches every
    layout forms from one pool of sequences); the limit of a layout = its step with the backward GEMMs of the
    inactive rows removed (see sebp_probe/bench/bench_cases.py). Exit code 1 without a GPU (unless --tiny).
    """
    import json
    import shlex

    import torch

    from .bench import bench, bench_cases, bench_compile, bench_model
    from .analysis.plots import check_image_path, plot_bench_models

    if scope not in ("layers", "model", "all"):
        raise UserError(f"--scope must be layers, model or all, got {scope!r}")
    if dtype not in bench.DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(bench.DTYPES)}, got {dtype!r}")
    if mode not in ("exact", "threshold", "topk"):
        raise UserError(f"--mode must be exact, threshold or topk, got {mode!r}")
    if repeats < 1 or model_repeats < 1 or model_batches < 1:
        raise UserError("--repeats, --model-repeats and --model-batches must be >= 1")
    if mode == "topk" and scope != "layers":
        raise UserError("--mode topk needs an N per layer, which only the per-layer benchmark sets "
                        "(N = active rows); use --scope layers, or exact/threshold for the whole model")
    dens = bench.parse_densities(densities)
    shapes = bench.resolve_shapes(model, rows, in_features, out_features, seq) if scope != "model" else []
    cases = []
    if scope != "layers":
        if model.lower() not in bench_cases.MODEL_CASES:
            raise UserError(f"no whole-model case for {model!r}; choose one of {', '.join(bench_cases.MODEL_CASES)}")
        case = bench_cases.MODEL_CASES[model.lower()]
        cases = [bench_cases.tiny(case) if tiny else case]
        try:
            bench_model.check_pad_mask(case, pad_mask)
        except ValueError as e:
            raise UserError(f"--no-pad-mask: {e}") from None
        if figure:
            check_image_path(figure)
    elif (not pad_mask or breakdown or norms or acts or keep_dx or tiny or figure or not pad_rows or compile_mode
          or layouts or methods):
        raise UserError("--no-pad-mask, --breakdown, --norms, --acts, --keep-dx, --no-pad-rows, --tiny, --figure, "
                        "--compile, --layouts and --methods are for the whole-model run (--scope model or all)")
    if compile_mode is not None and compile_mode not in COMPILE_MODES:
        raise UserError(f"--compile must be one of {', '.join(COMPILE_MODES)}, got {compile_mode!r}")
    if compile_scope not in bench_compile.SCOPES:
        raise UserError(f"--compile-scope must be one of {', '.join(bench_compile.SCOPES)}, got {compile_scope!r}")
    split = lambda text: tuple(x.strip() for x in text.split(",") if x.strip())  # noqa: E731
    chosen = dict(layouts=split(layouts) if layouts is not None else bench_cases.LAYOUTS,
                  methods=split(methods) if methods is not None else bench_model.METHODS)
    try:
        bench_model.check_selection(**chosen)
    except ValueError as e:
        raise UserError(f"--layouts/--methods: {e}") from None
    if dry_run:
        plans = [bench_model.plan(c, model_batches, graphs, pad_mask, bench.DTYPES[dtype], compile=compile_mode,
                                  compile_scope=compile_scope, **chosen) for c in cases]
        console.print_json(json.dumps(bench.run_plan(shapes, dens, plans)))
        return
    device = "cpu" if tiny and not torch.cuda.is_available() else "cuda"
    if device == "cuda":
        bench._require_cuda()
    from pathlib import Path

    from .train.rundir import write_json

    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
    result = {"command": "sebp-probe " + shlex.join(sys.argv[1:]), "environment": bench.environment(),
              "dtype": dtype, "mode": mode, "densities": dens, "layers": [], "models": []}
    with console.status("benchmarking") as status:
        def progress(msg: str) -> None:
            status.update(msg)

        def note(msg: str) -> None:
            console.print(msg, highlight=False, soft_wrap=True)

        for s in shapes:
            for r in bench.bench_layer(s, dens, bench.DTYPES[dtype], mode, repeats, progress=progress):
                result["layers"].append(r.to_dict())
        def partial(model_so_far: dict) -> None:  # a run cut short keeps what it measured
            if output:
                write_json(Path(output), {**result, "models": [*result["models"], model_so_far], "complete": False})

        for case in cases:
            result["models"].append(bench_model.bench_model(
                case, bench.DTYPES[dtype], model_repeats, model_batches, mode=mode, graphs=graphs, progress=progress,
                pad_mask=pad_mask, breakdown=breakdown, norms=norms, acts=acts, keep_dx=keep_dx, device=device,
                pad_rows=pad_rows, compile=compile_mode, compile_scope=compile_scope, note=note, partial=partial,
                **chosen))
    if output:  # first: what was measured survives any trouble with the tables
        write_json(Path(output), result)
    if figure and result["models"]:
        console.print(f"figure written to {plot_bench_models(result['models'], figure)}", highlight=False,
                      soft_wrap=True)
    bench_tables(result)
    if output:
        console.print(f"results written to {output}", highlight=False, soft_wrap=True)


# ------------------------------------------------------------------------------------------ analyze, heatmap


def _compile_setting(given: str | None, padding: str, cuda_graphs: bool) -> str | None:
    """finetune's --compile: ``off`` is eager (None); unset, ``auto`` on a GPU under --padding auto (compile
    where it pays), else eager (on a CPU compiling takes long: ask for it)."""
    if given == "off":
        return None
    if given is None:
        import torch

        return "auto" if padding == "auto" and not cuda_graphs and torch.cuda.is_available() else None
    return given


def _data_config(dataset, split, text_column, text_pair_column, label_column, padding, max_length,
                 padding_side, batch_size, max_samples, seed):
    from .config import DataConfig

    return DataConfig(dataset=dataset, split=split, text_column=text_column, text_pair_column=text_pair_column,
                      label_column=label_column, padding=padding, max_length=max_length,
                      padding_side=padding_side, batch_size=batch_size, max_samples=max_samples, seed=seed)


def _check_padded(padding: str) -> None:
    if padding not in PADDED:
        raise UserError(f"--padding {padding}: analyze and heatmap measure padded batches ({', '.join(PADDED)}); "
                        "the report gives the padding every layout leaves, packed included")


def _patterns(value: str | None) -> tuple[str, ...] | None:
    return tuple(p.strip() for p in value.split(",") if p.strip()) if value else None


@app.command("analyze")
@one_line_errors
def analyze_cmd(
    model: str = typer.Argument("minilm", help=_MODEL_HELP),
    dataset: str = typer.Argument("tweets", help=_DATA_HELP),
    task: str = _TASK,
    split: str = _SPLIT,
    text_column: str = _TEXT,
    text_pair_column: str = _PAIR,
    label_column: str = _LABEL,
    padding: str = _PADDING,
    max_length: int = typer.Option(128, "--max-length", help="Truncate, and pad to, this many tokens."),
    padding_side: str = _PADDING_SIDE,
    batch_size: int = typer.Option(32, "--batch-size"),
    max_batches: int = typer.Option(16, "--max-batches", help="Analyse this many batches (the first ones)."),
    max_samples: int = typer.Option(None, "--max-samples", help="Read at most this many samples."),
    targets: str = typer.Option(None, "--targets", help="Comma-separated layers/patterns (default: attention + "
                                "MLP projections; 'all-linear' works)."),
    exclude: str = typer.Option(None, "--exclude", help="Comma-separated layers/patterns to leave out."),
    quantile: float = typer.Option(0.99, "--quantile", help="N covers this quantile of per-batch active rows..."),
    margin: float = typer.Option(0.1, "--margin", help="...plus this margin..."),
    tile: int = typer.Option(64, "--tile", help="...rounded up to a multiple of this (the kernel's row block)."),
    min_gap: float = _MIN_GAP,
    device: str = _DEVICE,
    seed: int = typer.Option(0, "--seed", help="Seed for dropout."),
    output: str = typer.Option(None, "--output", "-o", help="Write the JSON report here (finetune --report)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the --output file if it exists."),
    per_layer: bool = typer.Option(False, "--per-layer", help="Also print a table row per layer."),
    reuse: bool = typer.Option(False, "--reuse", help="Also measure what gradient reuse (finetune --method "
                               "resprop) would drop per layer, P from the previous batch (needs >= 2 batches)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout (for programs)."),
) -> None:
    """Measure gradient sparsity layer by layer; recommend eps and N for SEBP.

    For every target linear, dL/dY is reduced on the device batch by batch: zero rows, zero elements, and
    histograms of |dL/dY| and of each row's max. eps is the knee of the smoothed CDF of row max |dL/dY| above
    a noise gap (none found: eps = 0, exact mode); N covers the active rows of nearly every batch.

    Examples:

    - `sebp-probe analyze` : MiniLM on the bundled tweets, max length 128, 16 batches of 32 (CPU: ~1 min)
    - `sebp-probe analyze minilm tweets --max-batches 4 -o report.json` : quick, and keep the report
    - `sebp-probe analyze smollm2 tweets --padding-side left --max-length 64 --per-layer`
    - `sebp-probe analyze ./my-bert data.csv --text-column review --label-column stars --json`
    - `sebp-probe analyze bert-base-uncased glue/sst2 --padding longest --device cuda`
    """
    import torch

    from .analysis.analyze import AnalyzeSettings, analyze
    from .analysis.report import save_report

    if padding_side not in (None, "left", "right"):
        raise UserError(f"--padding-side must be left or right, got {padding_side!r}")
    _check_padded(padding)
    if output:
        check_output_file(output, overwrite)
    cfg = _data_config(dataset, split, text_column, text_pair_column, label_column, padding, max_length,
                       padding_side, batch_size, max_samples, seed)
    settings = AnalyzeSettings(max_batches=max_batches, target_modules=_patterns(targets),
                               exclude_modules=_patterns(exclude), quantile=quantile, margin=margin, tile=tile,
                               min_gap_decades=min_gap, reuse=reuse)
    torch.manual_seed(seed)
    progress, on_batch = batch_progress(err_console if as_json else console, "analyzing")
    with progress:
        report, _ = analyze(model, cfg, settings, task=task, device=device, progress=on_batch,
                            on_note=functools.partial(print_note, err_console if as_json else console))
    if output:
        path = save_report(report, output)
        (err_console if as_json else console).print(f"report written to {path}", highlight=False, soft_wrap=True)
    if as_json:
        import json

        print(json.dumps(report, indent=2))
    else:
        print_analysis(report, per_layer)


@app.command("heatmap")
@one_line_errors
def heatmap_cmd(
    model: str = typer.Argument("minilm", help=_MODEL_HELP),
    dataset: str = typer.Argument("tweets", help=_DATA_HELP),
    layer: str = typer.Option(..., "--layer", "-l", help="Layer name, suffix, glob ('*.0.attention.self.query') "
                              "or regex; at most 6 layers."),
    output: str = typer.Option("heatmap.png", "--output", "-o", help="Image file: .png, .pdf or .svg."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the --output file if it exists."),
    task: str = _TASK,
    split: str = _SPLIT,
    text_column: str = _TEXT,
    text_pair_column: str = _PAIR,
    label_column: str = _LABEL,
    padding: str = _PADDING,
    max_length: int = typer.Option(128, "--max-length"),
    padding_side: str = _PADDING_SIDE,
    batch_size: int = typer.Option(32, "--batch-size"),
    max_batches: int = typer.Option(4, "--max-batches", help="Batches behind the histogram/CDF panel."),
    min_gap: float = _MIN_GAP,
    device: str = _DEVICE,
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Draw |dL/dY| of chosen layers: heatmaps of the shortest and the longest sample (rows = tokens,
    columns = features, log colour, exact zeros grey) and the CDF with its knee and eps.

    Examples:

    - `sebp-probe heatmap minilm tweets --layer '*.0.attention.self.query' -o q0.png`
    - `sebp-probe heatmap minilm tweets --layer 'bert.encoder.layer.5.*' -o last.pdf` : the CLS-only layer
    - `sebp-probe heatmap smollm2 tweets --layer '*.3.self_attn.q_proj' --padding-side left --max-length 64`
    """
    import torch

    from .analysis.analyze import AnalyzeSettings
    from .analysis.heatmap import heatmaps
    from .analysis.plots import check_image_path, plot_heatmaps

    check_output_file(output, overwrite)
    check_image_path(output)
    if padding_side not in (None, "left", "right"):
        raise UserError(f"--padding-side must be left or right, got {padding_side!r}")
    _check_padded(padding)
    cfg = _data_config(dataset, split, text_column, text_pair_column, label_column, padding, max_length,
                       padding_side, batch_size, None, seed)
    settings = AnalyzeSettings(max_batches=max_batches, min_gap_decades=min_gap)
    torch.manual_seed(seed)
    progress, on_batch = batch_progress(console, "collecting")
    with progress:
        pictures, info = heatmaps(model, cfg, layer, settings, task=task, device=device, progress=on_batch,
                                  on_note=functools.partial(print_note, console))
    p = info["padding"]
    title = (f"{info['name']} on {info['data']}: |dL/dY|, padding {p['padding']} to {p['max_length']} "
             f"({p['padding_side']}), CDF over {max_batches} batches of {p['batch_size']}")
    path = plot_heatmaps(pictures, output, title)
    for pic in pictures:
        e = pic.eps
        console.print(f"{pic.name}: eps {e.eps:.3g} ({'knee at 1e%.2f' % e.knee if e.knee_found else e.reason})",
                      highlight=False, soft_wrap=True)
    console.print(f"heatmap written to {path}", highlight=False, soft_wrap=True)


def main() -> None:  # pragma: no cover - console entry for `python -m sebp_probe`
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
