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
