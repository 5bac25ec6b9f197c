"""The generated blocks of README.md and docs/*.md are what tools/docs/make_docs.py makes from results/."""
from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
from tests.helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def make_docs():
    yield load_benchmark("make_docs", folder="tools/docs")
    sys.modules.pop("make_docs", None)


def _page(root: Path, text: str) -> Path:
    (root / "docs").mkdir(parents=True, exist_ok=True)
    page = root / "docs" / "page.md"
    page.write_text(text)
    return page


def test_docs_match_the_results(make_docs, capsys):
    """Docs and results cannot drift: every block equals what its generator makes from the committed JSON."""
    assert make_docs.main(["--check"]) == 0, capsys.readouterr().err
    used = {m.group(2) for p in make_docs.pages(ROOT) for m in make_docs.MARKER.finditer(p.read_text())}
    assert {"layers_share_h100", "layers_share_h200", "read_hide", "layouts_summary",
            "head_h100", "finetune_cpu", "families"} <= used


def test_unknown_block_fails_clearly(make_docs, tmp_path, capsys):
    _page(tmp_path, "text\n<!-- BEGIN generated:no_such_table -->\n<!-- END generated:no_such_table -->\n")
    for args in (["--check"], []):
        assert make_docs.main([*args, "--root", str(tmp_path)]) == 1
        err = capsys.readouterr().err
        assert "docs/page.md" in err and "unknown generated block 'no_such_table'" in err
        assert len(err.strip().splitlines()) == 1


def test_stale_block_is_named_then_rewritten(make_docs, tmp_path, capsys):
    shutil.copytree(ROOT / "results" / "norms_h100", tmp_path / "results" / "norms_h100")
    page = _page(tmp_path, "# t\n\n<!-- BEGIN generated:norms_h100 -->\n| old | table |\n"
                           "<!-- END generated:norms_h100 -->\n\nafter\n")
    assert make_docs.main(["--check", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "docs/page.md:norms_h100" in err and len(err.strip().splitlines()) == 1
    assert "| old | table |" in page.read_text()  # --check changes nothing

    assert make_docs.main(["--root", str(tmp_path)]) == 0
    text = page.read_text()
    assert "| old | table |" not in text and text.endswith("\n\nafter\n") and text.startswith("# t\n\n")
    assert "norm_bench.py" in text and "(../results/norms_h100/norm_bench.json)" in text  # caption and link
    assert make_docs.main(["--check", "--root", str(tmp_path)]) == 0


def test_unpaired_markers_and_missing_results_fail(make_docs, tmp_path, capsys):
    _page(tmp_path, "<!-- BEGIN generated:norms_h100 -->\nno end\n")
    assert make_docs.main(["--check", "--root", str(tmp_path)]) == 1
    assert "no matching END" in capsys.readouterr().err
    _page(tmp_path, "<!-- BEGIN generated:norms_h100 -->\n<!-- END generated:norms_h100 -->\n")
    assert make_docs.main(["--check", "--root", str(tmp_path)]) == 1
    assert "results/norms_h100/norm_bench.json does not exist" in capsys.readouterr().err


def test_captions_name_gpu_versions_date_and_command(make_docs):
    """Every generated table sits under a caption naming the machine, the versions, the date, the command and
    the JSON it came from (but the tables that describe the code, such as the model families)."""
    for name, generator in make_docs.GENERATORS.items():
        if name in make_docs.FROM_CODE:
            continue
        text = generator(make_docs.Page(ROOT, ROOT / "docs" / "benchmarks.md"))
        assert "/root/" not in text, name  # the device machine's paths become OUT/
        if "---" not in text:  # prose drawn from the data, no table of its own
            continue
        captions = [line for line in text.splitlines() if line.startswith("*Measured on ")]
        assert captions, name
        for line in captions:
            assert "torch " in line and re.search(r"20\d\d-\d\d-\d\d", line), (name, line)
            assert "`" in line and "results/" in line, (name, line)

def _command(path: Path) -> str | None:
    """The command a result file records: ``command`` at the top of a JSON or in its ``environment``, or a
    ``.txt`` header line naming the script."""
    if path.suffix == ".json":
        doc = json.loads(path.read_text())
        return doc.get("command") or (doc.get("environment") or {}).get("command")
    if path.suffix == ".txt":
        return next((line for line in path.read_text().splitlines()[:6] if ".py" in line), None)
    return None


def test_every_result_is_in_the_readme_with_the_command_that_made_it():
    """results/README.md lists every folder (and every tuning file), and every file there records its command:
    a figure is drawn from the JSON beside it, raw/ folders hold the run files that the README describes."""
    readme = (ROOT / "results" / "README.md").read_text()
    rows = [line.split(" | ")[0] for line in readme.splitlines() if line.startswith("| `")]
    listed = {name for row in rows for name in re.findall(r"`([\w.-]+)/?`", row)}
    folders = {p.name for p in (ROOT / "results").iterdir() if p.is_dir()}
    tuning = {p.name for p in (ROOT / "results" / "tuning").iterdir()}
    assert folders | tuning <= listed, (folders | tuning) - listed
    for path in sorted((ROOT / "results").rglob("*")):
        rel = path.relative_to(ROOT / "results")
        if path.is_dir() or path.name == "README.md" or "raw" in rel.parts:
            continue
        if path.suffix == ".png":
            assert path.with_suffix(".json").exists(), rel
            continue
        assert _command(path), f"results/{rel} records no command"
