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


def main() -> None:  # pragma: no cover - console entry for `python -m sebp_probe`
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
