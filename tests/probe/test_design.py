"""docs/design.md's layer tables are the imports: every module of both packages is listed, each imports only
modules of a lower layer of its own package (so no import circle), and sebp_kernels imports neither
transformers nor sebp_probe."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("sebp_kernels", "sebp_probe")


def _layers(package: str) -> dict[str, int]:
    """module (relative to the package; the package itself by its name) -> layer, from its table."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split(f"## `{package}`", 1)[1].split("\n## ", 1)[0]
    return {m: int(n) for m, n in re.findall(r"^\| `([\w.]+)` \| (\d+) \|", section, flags=re.M)}


def _modules(package: str) -> dict[str, Path]:
    out = {}
    for f in sorted((ROOT / package).rglob("*.py")):
        parts = f.relative_to(ROOT / package).with_suffix("").parts
        name = ".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)
        out[name or package] = f
    return out


def _imports(package: str, name: str, path: Path) -> tuple[set[str], set[str]]:
    """(modules of ``package`` that ``name`` imports, top-level names of other packages it imports)."""
    own, other = set(), set()
    is_init = path.name == "__init__.py"
    here = [] if name == package else name.split(".")
    base = here if is_init else here[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            up = base[: len(base) - (node.level - 1)]
            target = ".".join(up + ([node.module] if node.module else []))
            if node.module is None:
                own |= {".".join(filter(None, [target, a.name])) for a in node.names}
            else:
                own.add(target or package)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            for n in names:
                other.add(n.split(".")[0])
    return own, other


def test_every_module_is_in_its_table_and_imports_downward():
    for package in PACKAGES:
        layers, modules = _layers(package), _modules(package)
        assert set(modules) == set(layers), (package, set(modules) ^ set(layers))
        for name, path in modules.items():
            own, _ = _imports(package, name, path)
            for target in own:
                target = target if target in layers else target.rsplit(".", 1)[0]  # `from . import x`
                target = target or package
                assert layers[target] < layers[name], f"{package}.{name} (layer {layers[name]}) imports " \
                                                      f"{target} (layer {layers[target]})"


def test_kernels_know_nothing_of_models_or_the_probe():
    for name, path in _modules("sebp_kernels").items():
        _, other = _imports("sebp_kernels", name, path)
        assert not other & {"transformers", "sebp_probe", "peft", "accelerate"}, (name, other)
