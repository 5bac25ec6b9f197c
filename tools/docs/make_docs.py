#!/usr/bin/env python3
"""Fill the generated blocks of README.md and docs/*.md from the JSON files under results/.

Every measured number in the documentation comes from a committed JSON file through this script; nothing
measured is typed into the prose. A page holds generated markdown between two markers:

    <!-- BEGIN generated:NAME -->
    ...what the generator registered as NAME returns...
    <!-- END generated:NAME -->

    python tools/docs/make_docs.py            # rewrite every block in place
    python tools/docs/make_docs.py --check    # exit 1 with one line naming the stale blocks
    python tools/docs/make_docs.py --add model_compiled.json NAME OUT.json   # a new run into a family file

The engine is :mod:`docgen`; the generators are in :mod:`blocks_kernels` (docs/kernels.md),
:mod:`blocks_results` (README.md, docs/benchmarks.md, docs/finetune.md) and :mod:`blocks_families` (the model
families of docs/finetune.md, from sebp_probe's registry rather than results/). Each results/FAMILY.json holds one
family's ``runs``, and a generator loads one as ``FAMILY.json#RUN``. To document a new table: add its run to a
family (``--add``), write a ``@block("NAME")`` generator, and put the markers in the page.
Standard library only, but for the families block, which imports sebp_probe (and so torch).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # docgen and the block modules beside this file

import blocks_families  # noqa: E402,F401  (registers its blocks)
import blocks_kernels  # noqa: E402,F401
import blocks_compiled  # noqa: E402,F401
import blocks_results  # noqa: E402,F401
import blocks_grad_stats  # noqa: E402,F401
import blocks_sampled  # noqa: E402,F401
from docgen import FROM_CODE, GENERATORS, MARKER, ROOT, DocsError, Page, add_run, pages, render  # noqa: E402,F401


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is stale")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this script's)")
    parser.add_argument("--add", nargs=3, metavar=("FAMILY", "RUN", "JSON"),
                        help="put the measurement JSON into results/FAMILY as run RUN (replacing one of that name)")
    args = parser.parse_args(argv)
    stale = []
    try:
        if args.add:
            family, run, path = args.add
            add_run(args.root, family, run, Path(path))
            print(f"make_docs: results/{family} run {run!r} is {path}")
            return 0
        for path in pages(args.root):
            label = path.relative_to(args.root).as_posix()
            text = path.read_text()
            new, changed = render(text, Page(args.root, path), label)
            stale += [f"{label}:{name}" for name in changed]
            if changed and not args.check:
                path.write_text(new)
    except DocsError as err:
        print(f"make_docs: {err}", file=sys.stderr)
        return 1
    if args.check and stale:
        print(f"make_docs: stale generated block(s) {', '.join(stale)}: run python tools/docs/make_docs.py",
              file=sys.stderr)
        return 1
    if not args.check and stale:
        print(f"make_docs: rewrote {', '.join(stale)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
