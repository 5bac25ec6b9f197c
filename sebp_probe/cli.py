"""The sebp-probe command line: parse, call, print. Errors become one clear line and a non-zero exit.

The app and the small commands (analyze, heatmap) live here; ``finetune`` and ``bench`` in
:mod:`.cli_finetune` and :mod:`.cli_bench`; what they share in :mod:`.cli_common`."""
from __future__ import annotations

import functools
import sys

import typer

from .cli_bench import bench_cmd
from .cli_common import (EXIT_ERROR, EXIT_INTERRUPTED, _DATA_HELP, _DEVICE, _LABEL, _MIN_GAP, _MODEL_HELP,
                         _PADDING, _PADDING_SIDE, _PAIR, _SPLIT, _TASK, _TEXT, UserError, err_console,
                         one_line_errors)
from .cli_finetune import finetune_cmd
from .cli_grad_stats import grad_stats_cmd
from .layouts import PADDED
from .outputs import check_output_file
from .tables import batch_progress, console, print_note
from .tables_analysis import print_analysis

__all__ = ["EXIT_ERROR", "EXIT_INTERRUPTED", "UserError", "app", "main"]

app = typer.Typer(
    name="sebp-probe",
    help="Find and exploit gradient sparsity in Transformer fine-tuning (SEBP).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
app.command("finetune")(finetune_cmd)
app.command("bench")(bench_cmd)
app.command("grad-stats")(one_line_errors(grad_stats_cmd))  # a finetune --probe-every run's statistics


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


# ------------------------------------------------------------------------------------------ analyze, heatmap


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
    max_length: int = typer.Option(128, "--max-length"),
    padding: str = _PADDING,
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
