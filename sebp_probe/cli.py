"""The sebp-probe command line: parse, call, print. Errors become one clear line and a non-zero exit."""
from __future__ import annotations

import functools
import sys

import typer
from rich.console import Console

app = typer.Typer(
    name="sebp-probe",
    help="Find and exploit gradient sparsity in Transformer fine-tuning (SEBP).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
console = Console()
err_console = Console(stderr=True)

# Exit codes: 0 ok, 1 bad input or a failed run (one line on stderr), 130 interrupted.
EXIT_ERROR = 1
EXIT_INTERRUPTED = 130


class UserError(Exception):
    """An error caused by the user's input; printed as one line without a traceback."""


def one_line_errors(fn):
    """Turn expected failures into one line on stderr and a meaningful exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
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

    return wrapper


@app.callback(invoke_without_command=True)
def _main(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", help="Print the version and exit."),
) -> None:
    """sebp-probe: where does your backward pass waste work, and how much of it can SEBP get back?"""
    if version:
        from . import __version__

        console.print(f"sebp-probe {__version__}")
        raise typer.Exit()
    if ctx.invoked_subcommand is None:
        console.print(ctx.get_help())
        raise typer.Exit()


# ------------------------------------------------------------------------------------------------ finetune


def _finetune_progress(console_):
    """A rich progress bar fed by finetune's events: one bar per run, live loss and backward speedup."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    progress = Progress(TextColumn("[bold]{task.description:>5}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[speed]}"),
                        TimeElapsedColumn(), TimeRemainingColumn(), console=console_, transient=False)
    tasks: dict[str, int] = {}

    def on_event(kind: str, p: dict) -> None:
        run = p.get("run", "")
        if kind == "calibrated":
            n, dense = len(p["layers"]), len(p["fallback_dense"])
            times = ""
            if p.get("dense_backward_ms") and p.get("sebp_backward_ms"):
                times = (f"; calibration backward: dense {p['dense_backward_ms']:.1f} ms, "
                         f"SEBP {p['sebp_backward_ms']:.1f} ms")
            why = p.get("fallback_reason") or "active rows above the fallback density"
            progress.console.print(f"{run}: SEBP on {n} layers, {dense} left dense ({why}){times}", highlight=False)
        elif kind == "start":
            tasks[run] = progress.add_task(run, total=p["total"], completed=p["step"], loss="-", speed="")
        elif kind == "step" and run in tasks:
            speed = f"backward x{p['speedup_backward']:.2f}" if "speedup_backward" in p else ""
            progress.update(tasks[run], completed=p["step"], loss=f"{p['loss']:.4f}", speed=speed)
        elif kind == "eval":
            vals = ", ".join(f"{k[5:]} {v:.4f}" for k, v in p.items() if k.startswith("eval_"))
            progress.console.print(f"{run} step {p['step']}: held-out {vals}", highlight=False)
        elif kind == "skipped":
            progress.console.print(f"{run}: already completed, kept", highlight=False)

    return progress, on_event


def _print_finetune_summary(summary: dict) -> None:
    from rich.table import Table

    runs = summary.get("runs") or {summary.get("method", "run"): summary}
    table = Table(title=f"fine-tuning: {summary['output_dir']}")
    for col in ("run", "status", "steps", "loss", "held-out", "bwd ms", "step ms", "MiB"):
        table.add_column(col, justify="left" if col in ("run", "status", "held-out") else "right", no_wrap=True)
    fmt = lambda v, f="{:.2f}": "-" if v is None else f.format(v)  # noqa: E731
    short = {"eval_accuracy": "acc", "eval_perplexity": "ppl", "eval_loss": "loss"}
    for name, s in runs.items():
        ev = s.get("final_eval", {})
        held = " ".join(f"{short.get(k, k)} {v:.4f}" for k, v in ev.items() if k != "eval_loss")
        table.add_row(name, s["status"], str(s.get("steps", 0)), fmt(s.get("final_train_loss"), "{:.4f}"), held,
                      fmt(s.get("mean_backward_ms")), fmt(s.get("mean_step_ms")), fmt(s.get("peak_mem_mb"), "{:.0f}"))
    console.print(table)
    cmp = summary.get("comparison")
    if cmp:
        parts = [f"backward x{cmp['speedup_backward']:.2f}" if "speedup_backward" in cmp else "",
                 f"step x{cmp['speedup_step']:.2f}" if "speedup_step" in cmp else "",
                 f"peak memory x{cmp['peak_mem_ratio']:.3f}" if "peak_mem_ratio" in cmp else "",
                 f"max |loss gap| {cmp['max_abs_loss_gap']:.2e}" if cmp.get("max_abs_loss_gap") is not None else ""]
        console.print("SEBP vs dense: " + ", ".join(p for p in parts if p), highlight=False)


@app.command("finetune")
@one_line_errors
def finetune_cmd(
    model: str = typer.Argument("minilm", help="Bundled name (minilm, smollm2), local directory or hub id."),
    dataset: str = typer.Argument("tweets", help="Bundled name (tweets), local CSV/JSON/JSONL/Parquet or hub name."),
    auto_eps: bool = typer.Option(False, "--auto-eps", help="Run the analysis first and use its per-layer eps/N."),
    report: str = typer.Option(None, "--report", help="Use the per-layer settings of this analysis report."),
    eps: float = typer.Option(None, "--eps", help="One threshold for every layer (threshold mode)."),
    top_n: int = typer.Option(None, "--top-n", help="Rows kept per layer (topk mode)."),
    mode: str = typer.Option(None, "--mode", help="exact | threshold | topk (default: from the other options)."),
    method: str = typer.Option("sebp", "--method", help="dense | sebp."),
    compare: bool = typer.Option(False, "--compare", help="Train dense, then SEBP, same seed and data order."),
    targets: str = typer.Option(None, "--targets", help="Comma-separated layers/patterns to patch (default: "
                                "attention + MLP projections); 'all-linear' works."),
    dense_fallback: float = typer.Option(0.9, "--dense-fallback", help="Layers with more active rows than "
                                         "this share run dense."),
    always_sebp: bool = typer.Option(False, "--always-sebp", help="Keep SEBP even where calibration measures "
                                     "it slower than dense."),
    task: str = typer.Option(None, "--task", help="classification | causal-lm (default: from the model)."),
    split: str = typer.Option(None, "--split", help="Training split (default train)."),
    eval_split: str = typer.Option(None, "--eval-split", help="Held-out split (default: test for tweets, "
                                   "else 10% of train)."),
    text_column: str = typer.Option(None, "--text-column"),
    label_column: str = typer.Option(None, "--label-column"),
    max_samples: int = typer.Option(None, "--max-samples", help="Use at most this many training examples."),
    eval_samples: int = typer.Option(1000, "--eval-samples", help="Evaluate on at most this many examples."),
    padding: str = typer.Option("max_length", "--padding", help="max_length | longest."),
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
    eval_steps: int = typer.Option(None, "--eval-steps", help="Evaluate every N steps (default: 4 times)."),
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

    - `sebp-probe finetune` : MiniLM on the bundled tweets, exact SEBP, 200 steps (CPU: minutes)
    - `sebp-probe finetune minilm tweets --auto-eps --compare -o runs/auto` : analysis, then dense vs SEBP
    - `sebp-probe finetune minilm tweets --report report.json --mode topk`
    - `sebp-probe finetune ./my-model data.csv --eps 1e-6 --bf16 --lora --epochs 1`
    - `accelerate launch --num_processes 2 -m sebp_probe.cli finetune minilm tweets --compare` : DDP

    Ctrl-C or SIGTERM writes a checkpoint and stops (exit 130); `--resume` continues it. Output: run_config.json,
    metrics.jsonl, summary.json, loss.png, eval.png, model/ (plain Hugging Face) and checkpoints/.
    """
    from .config import DataConfig, FinetuneConfig
    from .finetune import finetune

    if bf16 and fp16:
        raise UserError("--bf16 and --fp16 exclude each other")
    data = DataConfig(dataset=dataset, split=split, eval_split=eval_split, text_column=text_column,
                      label_column=label_column, padding=padding, max_length=max_length, batch_size=batch_size,
                      max_samples=max_samples, seed=seed)
    cfg = FinetuneConfig(
        model=model, data=data, output_dir=output_dir, task=task, method=method, compare=compare, mode=mode,
        eps=eps, top_n=top_n, auto_eps=auto_eps, report=report,
        targets=tuple(t.strip() for t in targets.split(",") if t.strip()) if targets else None,
        dense_fallback=dense_fallback, fallback_if_slower=not always_sebp, max_steps=max_steps, epochs=epochs, lr=lr, warmup_ratio=warmup_ratio,
        grad_accum=grad_accum, precision="bf16" if bf16 else "fp16" if fp16 else "fp32", lora=lora, lora_r=lora_r,
        eval_steps=eval_steps, eval_samples=eval_samples, save_steps=save_steps, seed=seed)
    progress, on_event = _finetune_progress(err_console if as_json else console)
    with progress:
        summary = finetune(cfg, resume=resume, overwrite=overwrite, on_event=on_event)
    if as_json:
        import json

        console.print_json(json.dumps(summary, default=str))
    else:
        _print_finetune_summary(summary)
    if summary["status"] == "interrupted":
        ckpt = next((s.get("checkpoint") for s in (summary.get("runs") or {"": summary}).values()
                     if s.get("status") == "interrupted"), None)
        err_console.print(f"interrupted: checkpoint {ckpt}; continue with the same command and --resume",
                          highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_INTERRUPTED)


# --------------------------------------------------------------------------------------------------- bench


def _bench_tables(result: dict) -> None:
    from rich.table import Table

    if result.get("layers"):
        table = Table(title=f"SEBP backward per layer ({result['dtype']}, {result['mode']}; "
                            f"median ms, speedup vs dense cuBLAS)")
        for col in ("layer", "density", "k", "dense", "ideal", "triton", "torch ref", "x ideal", "x triton",
                    "of ideal", "x torch ref", "peak MiB d/t"):
            table.add_column(col, justify="left" if col == "layer" else "right")
        for r in result["layers"]:
            ms, sp = r["ms"], r["speedup_vs_dense"]
            table.add_row(r["shape"]["name"], f"{r['density']:g}", str(r["k"]), f"{ms['dense']:.3f}",
                          f"{ms['ideal']:.3f}", f"{ms['triton']:.3f}", f"{ms['torch_ref']:.3f}",
                          f"{sp['ideal']:.2f}", f"{sp['triton']:.2f}", f"{r['triton_fraction_of_ideal_speedup']:.2f}",
                          f"{r['triton_vs_torch_ref']:.2f}",
                          f"{r['peak_extra_mib']['dense']:.0f}/{r['peak_extra_mib']['triton']:.0f}")
        console.print(table)
    for m in result.get("models", []):
        table = Table(title=f"{m['case']['name']} forward+backward, batch {m['case']['batch']} x {m['case']['seq']}"
                            f" (token density {m['token_density']:.3f}; median ms)")
        for col in ("run", "forward", "backward", "step", "peak GiB"):
            table.add_column(col, justify="left" if col == "run" else "right")
        labels = {"dense_padded": "dense, padded", "sebp_padded": "SEBP, padded",
                  "dense_trimmed": "dense, padding trimmed"}
        for key, label in labels.items():
            s = m["median"][key]
            table.add_row(label, f"{s['forward_ms']:.1f}", f"{s['backward_ms']:.1f}", f"{s['step_ms']:.1f}",
                          f"{s['peak_gib']:.2f}")
        console.print(table)
        console.print(f"SEBP vs dense on the padded batch: backward x{m['backward_speedup']:.2f}, step "
                      f"x{m['step_speedup']:.2f}, peak memory x{m['peak_memory_ratio']:.3f}; trimming the padding "
                      f"instead: step x{m['trimmed_step_speedup']:.2f}", highlight=False)


@app.command("bench")
@one_line_errors
def bench_cmd(
    model: str = typer.Argument("bert-base", help="Shape set (bert-base, llama-3.2-3b, llama-3.2-1b, "
                                "qwen2.5-1.5b, qwen2.5-0.5b), local model directory or hub id."),
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
    output: str = typer.Option(None, "--output", "-o", help="Write the results (with GPU, versions, date, "
                               "command) to this JSON file."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what would run and exit (no GPU needed)."),
) -> None:
    """Time the SEBP backward on the GPU against dense cuBLAS, the torch reference and the ideal.

    Examples:

    - `sebp-probe bench` : BERT-base layer shapes (16384 rows), densities 0.01 ... 1.0
    - `sebp-probe bench llama-3.2-3b --densities 0.1,0.2,0.5 -o results.json`
    - `sebp-probe bench --rows 8192 --in-features 4096 --out-features 11008`
    - `sebp-probe bench ./my-model --rows 8192 --seq 256` : shapes read from a local config
    - `sebp-probe bench bert-base --scope model` : whole model, padded vs SEBP vs padding trimmed
    - `sebp-probe bench llama-3.2-3b --scope all --dry-run` : show the plan only

    Per layer: dense = cuBLAS backward; ideal = cuBLAS on the k active rows already contiguous; triton = the
    fused SEBP backward (selection included); torch ref = the pure-torch SEBP. Exit code 1 without a GPU.
    """
    import json
    import shlex

    from . import bench

    if scope not in ("layers", "model", "all"):
        raise UserError(f"--scope must be layers, model or all, got {scope!r}")
    if dtype not in bench.DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(bench.DTYPES)}, got {dtype!r}")
    if mode not in ("exact", "threshold", "topk"):
        raise UserError(f"--mode must be exact, threshold or topk, got {mode!r}")
    if repeats < 1 or model_repeats < 1:
        raise UserError("--repeats and --model-repeats must be >= 1")
    dens = bench.parse_densities(densities)
    shapes = bench.resolve_shapes(model, rows, in_features, out_features, seq) if scope != "model" else []
    models = []
    if scope != "layers":
        if model.lower() not in bench.MODEL_CASES:
            raise UserError(f"no whole-model case for {model!r}; choose one of {', '.join(bench.MODEL_CASES)}")
        models = [model.lower()]
    if dry_run:
        console.print_json(json.dumps(bench.run_plan(shapes, dens, models)))
        return
    result = {"command": "sebp-probe " + shlex.join(sys.argv[1:]), "environment": bench.environment(),
              "dtype": dtype, "mode": mode, "densities": dens, "layers": [], "models": []}
    with console.status("benchmarking") as status:
        def progress(msg: str) -> None:
            status.update(msg)

        for s in shapes:
            for r in bench.bench_layer(s, dens, bench.DTYPES[dtype], mode, repeats, progress=progress):
                result["layers"].append(r.to_dict())
        for name in models:
            result["models"].append(bench.bench_model(bench.MODEL_CASES[name], bench.DTYPES[dtype],
                                                       model_repeats, mode=mode, progress=progress))
    _bench_tables(result)
    if output:
        from pathlib import Path

        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(result, indent=1) + "\n")
        console.print(f"results written to {output}", highlight=False)


def main() -> None:  # pragma: no cover - console entry for `python -m sebp_probe`
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
