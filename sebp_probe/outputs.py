"""Output files of ``analyze`` and ``heatmap``: checked before the work, with the rule ``finetune`` follows for its
output directory (something already there is replaced only with ``--overwrite``)."""
from __future__ import annotations

import os
from pathlib import Path


def check_output_file(path: str | os.PathLike, overwrite: bool = False, flag: str = "--output") -> Path:
    """The path, if a file can be written there; else a one-line ValueError naming ``flag``: a directory, an
    existing file without ``overwrite``, a folder on the way that is a file, or one this user cannot write."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory: name a file in it")
    if path.exists() and not overwrite:
        raise ValueError(f"{flag} {path} exists: pass --overwrite to replace it, or pick another name")
    folder = path.parent.absolute()
    while not folder.exists():  # the nearest folder that exists is where the missing ones are made
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag} {path}: no permission to write {path if path.exists() else 'into ' + str(folder)}")
    return path
