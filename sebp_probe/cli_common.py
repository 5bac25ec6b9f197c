"""What the commands of the command line share: the one-line errors and exit codes, the notes on stderr, the
options that several commands declare alike."""
from __future__ import annotations

import copy
import functools
import logging

import typer
from rich.console import Console

from .config import padding_help
from .tables import print_note

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



def parse_budget(value: str | None) -> float | str | None:
    """``--budget``: ``auto`` or a share of the non-zero rows in (0, 1]; None where not given."""
    if value is None:
        return None
    if value.strip().lower() == "auto":
        return "auto"
    try:
        share = float(value)
    except ValueError:
        share = None
    if share is None or not 0 < share <= 1:
        raise UserError(f"--budget must be a share in (0, 1] or auto, got {value!r}")
    return share


def in_panel(option, panel: str):
    """A copy of a shared ``option`` listed under the help panel ``panel`` (the command's own grouping)."""
    option = copy.copy(option)
    option.rich_help_panel = panel
    return option
