"""The ``finetune`` command: its options, grouped into help panels, and the call."""
from __future__ import annotations

import typer

from .cli_common import (EXIT_INTERRUPTED, _DATA_HELP, _LABEL, _MODEL_HELP, _TASK, _TEXT, UserError, err_console,
                         in_panel, one_line_errors, parse_budget)
from .config import padding_help
from .tables import console, finetune_progress, print_finetune_summary

# The help panels of finetune's options (the arguments come first; every option has a default).
DATA, MODEL, METHOD, SPEED, RUN = "Data", "Model", "Method", "Speed", "Run"


def _compile_setting(given: str | None, padding: str, cuda_graphs: bool) -> str | None:
    """finetune's --compile: ``off`` is eager (None); unset, ``auto`` on a GPU under --padding auto (compile
    where it pays), else eager (on a CPU compiling takes long: ask for it)."""
    if given == "off":
        return None
    if given is None:
        import torch

        return "auto" if padding == "auto" and not cuda_graphs and torch.cuda.is_available() else None
    return given



@one_line_errors
def finetune_cmd(
    model: str = typer.Argument("minilm", help=_MODEL_HELP),
    dataset: str = typer.Argument("tweets", help=_DATA_HELP),
    # Data
    split: str = typer.Option(None, "--split", rich_help_panel=DATA, help="Training split (default train)."),
    eval_split: str = typer.Option(None, "--eval-split", rich_help_panel=DATA, help="Held-out split (default: "
                                   "test for tweets, else 10% of train)."),
    text_column: str = in_panel(_TEXT, DATA),
    label_column: str = in_panel(_LABEL, DATA),
    max_samples: int = typer.Option(None, "--max-samples", rich_help_panel=DATA, help="Use at most this many "
                                    "training examples."),
    eval_samples: int = typer.Option(1000, "--eval-samples", rich_help_panel=DATA, help="Evaluate on at most "
                                     "this many examples."),
    padding: str = typer.Option("auto", "--padding", rich_help_panel=DATA, help=padding_help(auto=True)),
    max_length: int = typer.Option(64, "--max-length", rich_help_panel=DATA),
    batch_size: int = typer.Option(16, "--batch-size", rich_help_panel=DATA, help="Per process (and per "
                                   "micro-batch)."),
    # Model
    task: str = in_panel(_TASK, MODEL),
    lora: bool = typer.Option(False, "--lora", rich_help_panel=MODEL, help="Train LoRA adapters (peft); SEBP on "
                              "the frozen base layers computes no dW."),
    lora_r: int = typer.Option(8, "--lora-r", rich_help_panel=MODEL),
    head: str = typer.Option("labelled", "--head", rich_help_panel=MODEL, help="labelled: the loss without the "
                             "rows no loss reaches (LM head and last layer on the labelled rows; a classifier's "
                             "last layer on [CLS]) where that is exact, and under --padding auto timed against the "
                             "model's own head (and, on a GPU where cut-cross-entropy imports, against cce) | "
                             "full: the model's own loss | cce: a causal LM's backbone, then Cut-Cross-Entropy on "
                             "the labelled rows."),
    # Method
    method: str = typer.Option("sebp", "--method", rich_help_panel=METHOD, help="dense | sebp | resprop "
                               "(gradient reuse: approximate, see --reuse)."),
    compare: bool = typer.Option(False, "--compare", rich_help_panel=METHOD, help="Train dense, then SEBP, same "
                                 "seed and data order."),
    sebp_first: bool = typer.Option(False, "--sebp-first", rich_help_panel=METHOD, help="With --compare: train "
                                    "SEBP first, then dense (run both orders to see how much the host's speed "
                                    "drifts)."),
    mode: str = typer.Option(None, "--mode", rich_help_panel=METHOD, help="exact | threshold | topk | sampled "
                             "(approximate, experimental: unbiased row sampling, see --budget) (default: from the "
                             "other options)."),
    budget: str = typer.Option(None, "--budget", rich_help_panel=METHOD, help="sampled mode: auto (the "
                               "default: per layer, the fewest rows whose added variance in dW stays under "
                               "--variance-tau of the SGD variance) or a fixed share of each layer's non-zero rows of dL/dY kept "
                               "for dW in expectation, in (0, 1] (rescaled: unbiased)."),
    sample_dx: bool = typer.Option(False, "--sample-dx", rich_help_panel=METHOD, help="sampled mode: dX from the "
                                   "sample too (default: dX exact; at --budget 0.3 it lost 10 points of held-out "
                                   "accuracy on MiniLM/tweets, docs/method.md)."),
    variance_tau: float = typer.Option(0.025, "--variance-tau", rich_help_panel=METHOD, help="sampled mode, "
                                       "--budget auto: each layer's variance budget, a share of the SGD variance "
                                       "of its dW (VCAS's 0.025; larger keeps fewer rows)."),
    sample_warmup: int = typer.Option(10, "--sample-warmup", rich_help_panel=METHOD, help="sampled mode: exact "
                                      "optimizer steps first."),
    guard_every: int = typer.Option(50, "--guard-every", rich_help_panel=METHOD, help="sampled mode: the first "
                                    "sampled step and every Nth after it also compute the exact dW: cosine and "
                                    "relative error per layer in metrics.jsonl; a layer over its variance budget "
                                    "keeps more rows."),
    auto_eps: bool = typer.Option(False, "--auto-eps", rich_help_panel=METHOD, help="Run the analysis first and "
                                  "use its per-layer eps/N."),
    report: str = typer.Option(None, "--report", rich_help_panel=METHOD, help="Use the per-layer settings of "
                               "this analysis report."),
    eps: float = typer.Option(None, "--eps", rich_help_panel=METHOD, help="One threshold for every layer "
                              "(threshold mode)."),
    top_n: int = typer.Option(None, "--top-n", rich_help_panel=METHOD, help="Rows kept per layer (topk mode)."),
    reuse: float = typer.Option(0.9, "--reuse", rich_help_panel=METHOD, help="resprop: share of the rows of "
                                "dL/dY - P reused from the previous step instead of computed (0 = exact)."),
    targets: str = typer.Option(None, "--targets", rich_help_panel=METHOD, help="Comma-separated "
                                "layers/patterns to patch (default: attention + MLP projections); 'all-linear' "
                                "works."),
    sebp_acts: bool = typer.Option(False, "--sebp-acts", rich_help_panel=METHOD, help="Also run the MLP "
                                   "activations (SwiGLU, GELU) as SEBP activations (exact; the linears before "
                                   "them skip their row selection)."),
    sebp_norms: bool = typer.Option(False, "--sebp-norms", rich_help_panel=METHOD, help="Also give the "
                                    "LayerNorms/RMSNorms the SEBP backward (exact; calibrated together with the "
                                    "linear layers)."),
    dense_fallback: float = typer.Option(0.9, "--dense-fallback", rich_help_panel=METHOD, help="Layers with "
                                         "more active rows than this share run dense."),
    always_sebp: bool = typer.Option(False, "--always-sebp", rich_help_panel=METHOD, help="Keep SEBP even where "
                                     "calibration measures it slower than dense."),
    calib_budget: float = typer.Option(0.05, "--calib-budget", metavar="FRACTION", rich_help_panel=METHOD,
                                       help="Calibration (--padding auto's timing, then SEBP's) takes at most "
                                       "this share (0-1] of the run's estimated time; what it cannot afford is "
                                       "skipped and named (a very short run: the least padding, untimed)."),
    # Speed
    bf16: bool = typer.Option(False, "--bf16", rich_help_panel=SPEED, help="bfloat16 autocast."),
    fp16: bool = typer.Option(False, "--fp16", rich_help_panel=SPEED, help="float16 autocast with loss scaling "
                              "(GPU)."),
    compile_mode: str = typer.Option(None, "--compile", metavar="MODE", rich_help_panel=SPEED, help="torch.compile "
                                     "the training model in this mode: default | reduce-overhead (CUDA graphs; "
                                     "the fast one on a GPU) | max-autotune | max-autotune-no-cudagraphs | auto "
                                     "(with --padding auto: time eager and compiled, compile where the whole "
                                     "run's estimate, compile time included, says it pays; the default on a GPU "
                                     "with --padding auto) | off (eager; the default otherwise)."),
    compile_scope: str = typer.Option("layers", "--compile-scope", rich_help_panel=SPEED, help="With --compile: "
                                      "what compiles: layers (each transformer layer in place; the embeddings, "
                                      "head and loss run eagerly; one layer's compile, seconds) | model (the "
                                      "whole model, and with the labelled-rows head the whole step; minutes for "
                                      "a 1B model)."),
    cuda_graphs: bool = typer.Option(False, "--cuda-graphs", rich_help_panel=SPEED, help="Replay each "
                                     "micro-step's forward and backward as CUDA graphs, one pair per batch shape "
                                     "(one GPU): no host launch overhead, in calibration too; with --compile "
                                     "default, each layer compiled and then replayed."),
    graph_bucket: int = typer.Option(32, "--graph-bucket", rich_help_panel=SPEED, help="With --cuda-graphs and "
                                     "--padding longest: pad each batch to a multiple of this many tokens (fewer "
                                     "shapes to capture)."),
    # Run
    max_steps: int = typer.Option(None, "--max-steps", rich_help_panel=RUN, help="Optimizer steps (default 200 "
                                  "unless --epochs)."),
    epochs: float = typer.Option(None, "--epochs", rich_help_panel=RUN),
    lr: float = typer.Option(5e-5, "--lr", rich_help_panel=RUN),
    warmup_ratio: float = typer.Option(0.06, "--warmup-ratio", rich_help_panel=RUN),
    grad_accum: int = typer.Option(1, "--grad-accum", rich_help_panel=RUN, help="Micro-batches per optimizer "
                                   "step."),
    eval_steps: int = typer.Option(None, "--eval-steps", rich_help_panel=RUN, help="Evaluate every N steps "
                                   "(default: steps // 4, at least 1) and at the last step."),
    probe_every: int = typer.Option(None, "--probe-every", rich_help_panel=RUN, help="Gradient statistics of "
                                    "analyze on the backward of step 1 and every Nth step after it (rows by "
                                    "cause, rows holding 90/99% of the energy): metrics.jsonl, summary.json; "
                                    "`sebp-probe grad-stats RUN_DIR` draws them."),
    save_steps: int = typer.Option(None, "--save-steps", rich_help_panel=RUN, help="Checkpoint every N steps "
                                   "(default: at the end, and on Ctrl-C/SIGTERM)."),
    output_dir: str = typer.Option("runs/finetune", "--output-dir", "-o", rich_help_panel=RUN),
    resume: bool = typer.Option(False, "--resume", rich_help_panel=RUN, help="Continue the run in --output-dir "
                                "from its last checkpoint."),
    overwrite: bool = typer.Option(False, "--overwrite", rich_help_panel=RUN, help="Replace the run in "
                                   "--output-dir."),
    seed: int = typer.Option(0, "--seed", rich_help_panel=RUN),
    deterministic: bool = typer.Option(False, "--deterministic", rich_help_panel=RUN, help="torch's "
                                       "deterministic algorithms (slower): a resumed run computes the "
                                       "uninterrupted run's bits, and so does a second run of the same command "
                                       "where nothing is chosen by timing (--padding and --compile other than "
                                       "auto, --always-sebp)."),
    as_json: bool = typer.Option(False, "--json", rich_help_panel=RUN, help="Print the summary as JSON instead "
                                 "of a table."),
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
        eps=eps, top_n=top_n, budget=parse_budget(budget), sample_dx=sample_dx, sample_warmup=sample_warmup,
        guard_every=guard_every, variance_tau=variance_tau,
        auto_eps=auto_eps, report=report,
        targets=tuple(t.strip() for t in targets.split(",") if t.strip()) if targets else None,
        dense_fallback=dense_fallback, fallback_if_slower=not always_sebp, calib_budget=calib_budget,
        sebp_norms=sebp_norms, sebp_acts=sebp_acts, head=head,
        cuda_graphs=cuda_graphs, graph_bucket=graph_bucket,
        compile=_compile_setting(compile_mode, padding, cuda_graphs), compile_scope=compile_scope,
        deterministic=deterministic,
        max_steps=max_steps, epochs=epochs, lr=lr, warmup_ratio=warmup_ratio,
        grad_accum=grad_accum, precision="bf16" if bf16 else "fp16" if fp16 else "fp32", lora=lora, lora_r=lora_r,
        eval_steps=eval_steps, probe_every=probe_every, eval_samples=eval_samples, save_steps=save_steps, seed=seed)
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
