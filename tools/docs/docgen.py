"""The engine of tools/docs/make_docs.py: pages, blocks, result files and the formatting the tables share.

A page holds generated markdown between two markers (``<!-- BEGIN generated:NAME -->`` ...
``<!-- END generated:NAME -->``); a generator is a small function decorated with ``@block("NAME")`` that takes a
:class:`Page` (which loads JSON from results/ and links to it from the page being written) and returns
markdown. Every table starts with a caption line (:func:`caption`) naming the GPU, the software versions, the
date and the command that the JSON file records. Standard library only.
"""
from __future__ import annotations

import html
import json
import os
import re
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!-- (BEGIN|END) generated:([A-Za-z0-9_.-]+) -->")

GENERATORS: dict[str, Callable[["Page"], str]] = {}


class DocsError(Exception):
    """A page or a result file that the blocks cannot be made from (one line)."""


FROM_CODE: set[str] = set()  # blocks made from the code (a registry), not measured: no results/ caption


def block(name: str, from_code: bool = False):
    """Register the decorated function as the generator of the blocks called ``name`` (``from_code``: its
    table describes the code, not a measurement)."""
    def register(fn):
        if name in GENERATORS:
            raise ValueError(f"two generators for the block {name!r}")
        GENERATORS[name] = fn
        if from_code:
            FROM_CODE.add(name)
        return fn
    return register


# ------------------------------------------------------------------------------------------ result files

class Source:
    """One JSON file under results/: ``rel`` its path there, ``data`` its content."""

    def __init__(self, rel: str, data: dict):
        self.rel = rel
        self.data = data

    def env(self) -> dict:
        """GPU, versions and date, whether the file keeps them under ``environment`` or at its top level."""
        env = self.data.get("environment")
        if isinstance(env, dict):
            return env
        versions = self.data.get("versions")  # a tool's JSON: the versions in a dict of their own
        return {**self.data, **versions} if isinstance(versions, dict) else self.data

    def rows(self, key: str = "rows") -> list:
        return self.data[key]


class Page:
    """What a generator sees: the results of the repository at ``root`` and the page it writes into."""

    def __init__(self, root: Path, doc: Path):
        self.root = root
        self.doc = doc
        self._cache: dict[str, Source] = {}

    def load(self, rel: str) -> Source:
        """One run of a results file: ``FAMILY.json#RUN`` is the run ``RUN`` of ``results/FAMILY.json`` (its
        ``runs``); a plain ``rel`` is the whole JSON file ``results/<rel>``."""
        if rel not in self._cache:
            name, _, run = rel.partition("#")
            path = self.root / "results" / name
            try:
                data = json.loads(path.read_text())
            except FileNotFoundError:
                raise DocsError(f"results/{name} does not exist") from None
            except json.JSONDecodeError as err:
                raise DocsError(f"results/{name} is not valid JSON: {err}") from None
            if run:
                if run not in data.get("runs", {}):
                    raise DocsError(f"results/{name} has no run {run!r}")
                data = data["runs"][run]
            self._cache[rel] = Source(rel, data)
        return self._cache[rel]

    def link(self, rel: str) -> str:
        """A markdown link from this page to ``results/<rel>`` (its file, for a run of a family)."""
        rel = rel.partition("#")[0]
        target = os.path.relpath(self.root / "results" / rel, self.doc.parent)
        return f"[`results/{rel}`]({Path(target).as_posix()})"


def add_run(root: Path, family: str, run: str, path: Path) -> None:
    """Put the measurement JSON at ``path`` into ``results/<family>`` as run ``run`` (a new family file if there
    is none); the run must record its command and its environment's date, as every table's caption reads them."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DocsError(f"{path}: not a readable JSON file ({err})") from None
    src = Source(run, data)
    if not (data.get("command") or src.env().get("command")) or not src.env().get("date"):
        raise DocsError(f"{path}: records no command or no date; a results run needs both")
    target = root / "results" / family
    doc = json.loads(target.read_text()) if target.exists() else {"family": target.stem, "runs": {}}
    doc["runs"][run] = data
    target.write_text(json.dumps(doc, indent=1) + "\n")


def entry_key(r: dict) -> tuple:
    """A whole-model bench entry's identity across runs: (layout, method, head, timing)."""
    return r["layout"], r["method"], r["head"], r["timing"]


# ------------------------------------------------------------------------------------- shared formatting

def command(text: str) -> str:
    """The recorded command as a reader runs it: output paths of the device machine (and the per-run folders
    results/ had before its family files) become ``OUT/<name>``, a bare script path gets its ``python``, and the probes recorded under ``scripts/`` are named where they are
    now, ``benchmarks/``."""
    words = [("OUT/" + re.sub(r"^s\d+[a-z]?_", "", w.rsplit("/", 1)[-1]))  # a run's number is no part of it
             if w.startswith("/") or (w.startswith("results/") and "/" in w[8:]) else
             "benchmarks/" + w[len("scripts/"):] if w.startswith("scripts/") else w for w in text.split()]
    if words and words[0].endswith(".py"):
        words.insert(0, "python")
    return " ".join(words)


def _setting(src: Source) -> str:
    env = src.env()
    parts = [env.get("gpu") or env.get("device") or env.get("cpu") or "unknown device"]
    versions = [f"{name} {env[key]}" for key, name in (("torch", "torch"), ("triton", "triton"), ("cuda", "CUDA"),
                                                        ("transformers", "transformers")) if env.get(key)]
    date = str(env.get("date", ""))[:10]
    return f"{parts[0]} ({', '.join(versions)}), {date}" if versions else f"{parts[0]}, {date}"


def _switches(src: Source) -> str:
    """The SEBP_* environment variables a run had set (the bench records them), as a command's prefix."""
    env = src.env().get("sebp_env") or {}
    return "".join(f"{k}={v} " for k, v in sorted(env.items()))


def caption(page: Page, *sources: Source) -> str:
    """The caption of a table: one conditions line per GPU / versions / date, naming the results file(s), then
    the commands that wrote them folded away in a ``<details>`` block."""
    groups: dict[str, list[Source]] = {}
    for src in sources:
        groups.setdefault(_setting(src), []).append(src)
    lines = []
    for setting, group in groups.items():
        links = ", ".join(dict.fromkeys(page.link(s.rel) for s in group))
        lines.append(f"*Measured on {setting} → {links}.*")
    esc = lambda lines: html.escape("\n".join(dict.fromkeys(lines)), quote=False).replace("\n", "<br>")  # noqa: E731
    ran = esc(f"{_switches(s)}{command(s.data.get('command') or s.env().get('command', '?'))}" for s in sources)
    again = esc(s.data["reproduce"] for s in sources if s.data.get("reproduce"))
    merged = any(w in ran for w in (".tgz", "_session.sh", "_collect.py"))  # read from run archives: the step alone
    probe = next((s.data["probe"] for s in sources if s.data.get("probe")), None)  # a script outside the suite
    if again:
        body = f"<pre>{again}</pre>" if merged else f"To run it again:<pre>{again}</pre>As it ran:<pre>{ran}</pre>"
    elif probe:
        body = f"From {probe}, as it ran:<pre>{ran}</pre>"
    else:
        body = f"<pre>{ran}</pre>"
    return "\n".join(lines) + f"\n<details><summary>Command</summary>{body}</details>"


def table(header: list[str], rows: list[list[str]], align: str) -> str:
    """A markdown table; ``align`` has one letter per column, ``l`` or ``r``."""
    if len(align) != len(header) or any(len(r) != len(header) for r in rows):
        raise ValueError("a table row, the header and the alignment differ in length")
    rule = ["---" if a == "l" else "---:" for a in align]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [header, rule, *rows])


def captioned(page: Page, sources: list[Source], body: str) -> str:
    return f"{caption(page, *sources)}\n\n{body}"


def f2(x: float) -> str:
    return f"{x:.2f}"


def f1(x: float) -> str:
    return f"{x:.1f}"


def f3(x: float) -> str:
    return f"{x:.3f}"


def times(x: float) -> str:
    return f"{x:.2f}x"


def slash(values) -> str:
    return " / ".join(values)


def span(values, fmt=f2) -> str:
    """``lo-hi`` of ``values`` (one number when they agree after formatting)."""
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def dens(d: float) -> str:
    return f"{d:g}"


def size(n_bytes: int) -> str:
    return f"{n_bytes / 1024:.1f} KiB" if n_bytes >= 1024 else f"{n_bytes} B"


def short_gpu(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``H100``: the model number, where the name has one."""
    found = re.search(r"\b([A-Z]+\d{2,4}[A-Za-z]?)\b", name)
    return found.group(1) if found else name



# ---------------------------------------------------------------------------------------- the pages

def pages(root: Path) -> list[Path]:
    """The pages whose blocks are generated: README.md and docs/*.md."""
    found = [root / "README.md"] if (root / "README.md").exists() else []
    return found + sorted((root / "docs").glob("*.md"))


def render(text: str, page: Page, label: str) -> tuple[str, list[str]]:
    """``text`` with every block regenerated, and the names of the blocks whose body changed."""
    out, changed, pos = [], [], 0
    marks = list(MARKER.finditer(text))
    if len(marks) % 2:
        raise DocsError(f"{label}: a generated block has no matching END marker")
    for begin, end in zip(marks[::2], marks[1::2]):
        name = begin.group(2)
        if begin.group(1) != "BEGIN" or end.group(1) != "END" or end.group(2) != name:
            raise DocsError(f"{label}: markers out of order near 'generated:{name}' "
                            f"(line {text.count(chr(10), 0, begin.start()) + 1})")
        generator = GENERATORS.get(name)
        if generator is None:
            raise DocsError(f"{label}: unknown generated block {name!r} (line "
                            f"{text.count(chr(10), 0, begin.start()) + 1}); known: {', '.join(sorted(GENERATORS))}")
        try:
            body = "\n" + generator(page).strip("\n") + "\n"
        except DocsError as err:
            raise DocsError(f"{label}: block {name!r}: {err}") from None
        if text[begin.end():end.start()] != body:
            changed.append(name)
        out += [text[pos:begin.end()], body]
        pos = end.start()
    out.append(text[pos:])
    return "".join(out), changed


