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
    (tmp_path / "results").mkdir()
    shutil.copy(ROOT / "results" / "kernels.json", tmp_path / "results" / "kernels.json")
    page = _page(tmp_path, "# t\n\n<!-- BEGIN generated:norms_h100 -->\n| old | table |\n"
                           "<!-- END generated:norms_h100 -->\n\nafter\n")
    assert make_docs.main(["--check", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "docs/page.md:norms_h100" in err and len(err.strip().splitlines()) == 1
    assert "| old | table |" in page.read_text()  # --check changes nothing

    assert make_docs.main(["--root", str(tmp_path)]) == 0
    text = page.read_text()
    assert "| old | table |" not in text and text.endswith("\n\nafter\n") and text.startswith("# t\n\n")
    assert "norm_bench.py" in text and "(../results/kernels.json)" in text  # caption and link
    assert "<details><summary>Command</summary>" in text  # the command folded under the conditions line
    assert make_docs.main(["--check", "--root", str(tmp_path)]) == 0


def test_unpaired_markers_and_missing_results_fail(make_docs, tmp_path, capsys):
    _page(tmp_path, "<!-- BEGIN generated:norms_h100 -->\nno end\n")
    assert make_docs.main(["--check", "--root", str(tmp_path)]) == 1
    assert "no matching END" in capsys.readouterr().err
    _page(tmp_path, "<!-- BEGIN generated:norms_h100 -->\n<!-- END generated:norms_h100 -->\n")
    assert make_docs.main(["--check", "--root", str(tmp_path)]) == 1
    assert "results/kernels.json does not exist" in capsys.readouterr().err


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
    """The command a tuning file records: ``command`` at the top of a JSON or in its ``environment``, or a
    ``.txt`` header line naming the script."""
    if path.suffix == ".json":
        doc = json.loads(path.read_text())
        return doc.get("command") or (doc.get("environment") or {}).get("command")
    return next((line for line in path.read_text().splitlines()[:6] if ".py" in line), None)


def test_every_result_is_in_the_readme_with_the_command_that_made_it():
    """results/README.md lists every family file (and the tuning folder); every run of a family records its
    command, its date and where it was first committed, and every tuning sweep its command."""
    readme = (ROOT / "results" / "README.md").read_text()
    rows = [line.split(" | ")[0] for line in readme.splitlines() if line.startswith("| `")]
    listed = {name for row in rows for name in re.findall(r"`([\w.-]+)/?`", row)}
    found = {p.name for p in (ROOT / "results").iterdir() if p.name != "README.md"}
    assert found == listed, found ^ listed
    for path in sorted((ROOT / "results").glob("*.json")):
        runs = json.loads(path.read_text())["runs"]
        assert runs, path.name
        for name, run in runs.items():
            src = make_docs_source(path.name, run)
            assert run.get("command") or src.env().get("command"), f"{path.name}#{name} records no command"
            assert re.match(r"20\d\d-\d\d-\d\d", str(src.env().get("date", ""))), f"{path.name}#{name}: no date"
            assert run.get("recorded_in"), f"{path.name}#{name}: no commit"
    for path in sorted((ROOT / "results" / "tuning").iterdir()):
        assert _command(path), f"results/tuning/{path.name} records no command"


def make_docs_source(rel: str, data: dict):
    sys.path.insert(0, str(ROOT / "tools" / "docs"))
    try:
        from docgen import Source
    finally:
        sys.path.pop(0)
    return Source(rel, data)


def test_add_puts_a_run_into_a_family_and_refuses_one_without_a_command(make_docs, tmp_path, capsys):
    (tmp_path / "results").mkdir()
    run = {"command": "python benchmarks/norm_bench.py OUT.json", "environment": {"date": "2026-12-01", "torch": "2"},
           "rows": [1]}
    (tmp_path / "run.json").write_text(json.dumps(run))
    args = ["--root", str(tmp_path), "--add", "kernels.json", "norms"]
    assert make_docs.main([*args, str(tmp_path / "run.json")]) == 0
    assert json.loads((tmp_path / "results" / "kernels.json").read_text())["runs"]["norms"] == run
    (tmp_path / "bad.json").write_text(json.dumps({"rows": []}))
    assert make_docs.main([*args, str(tmp_path / "bad.json")]) == 1
    assert "records no command" in capsys.readouterr().err
