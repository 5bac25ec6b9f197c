"""docs/design.md's tables are the imports: every module of both packages is listed, each imports only modules of
a lower layer of its own package (so no import circle), sebp_probe's subpackages import only lower floors (so no
circle between themes either), and sebp_kernels imports neither transformers nor sebp_probe."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("sebp_kernels", "sebp_probe")


def _table(heading: str) -> dict[str, int]:
    """name -> number, from the table of the section of docs/design.md under ``heading``."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return {m: int(n) for m, n in re.findall(r"^\| `([\w.]+)` \| (\d+) \|", section, flags=re.M)}


def _layers(package: str) -> dict[str, int]:
    """module (relative to the package; the package itself by its name) -> layer, from its table."""
    return _table(f"`{package}`")


def _modules(package: str) -> dict[str, Path]:
    out = {}
    for f in sorted((ROOT / package).rglob("*.py")):
        parts = f.relative_to(ROOT / package).with_suffix("").parts
        name = ".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)
        out[name or package] = f
    return out


def _imports(package: str, name: str, path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(modules of ``package`` that ``name`` imports, top-level names of other packages it imports)."""
    own, other = set(), set()
    is_init = path.name == "__init__.py"
    here = [] if name == package else name.split(".")
    base = here if is_init else here[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            target = ".".join(base[: len(base) - (node.level - 1)] + ([node.module] if node.module else []))
            for alias in node.names:  # `from .data import assets` imports the module data.assets
                sub = ".".join(filter(None, [target, alias.name]))
                own.add(sub if sub in modules else target or package)
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
            for target in _imports(package, name, path, modules)[0]:
                assert layers[target] < layers[name], f"{package}.{name} (layer {layers[name]}) imports " \
                                                      f"{target} (layer {layers[target]})"


def _theme(name: str, floors: dict[str, int]) -> str | None:
    """The subpackage of sebp_probe a module belongs to; None for a top-level module."""
    head = name.split(".", 1)[0]
    return head if head in floors and name != "sebp_probe" else None


def test_subpackages_import_only_lower_floors():
    """A top-level module's floor is the highest it reads: 0 for the registries and settings every theme reads,
    above a subpackage for the modules that wire them (the CLI). Each import goes to a lower floor or stays in
    its own subpackage, so the subpackages and top-level modules form no circle."""
    floors, modules, layers = _table("Subpackages of `sebp_probe`"), _modules("sebp_probe"), _layers("sebp_probe")
    assert set(floors) == {n for n, p in modules.items() if p.name == "__init__.py" and n != "sebp_probe"}
    imports = {n: _imports("sebp_probe", n, p, modules)[0] for n, p in modules.items()}

    def floor(name: str) -> int:
        theme = _theme(name, floors)
        if theme is not None:
            return floors[theme]
        return max((floor(t) + (_theme(t, floors) is not None) for t in imports[name]), default=0)

    for name in sorted(modules, key=layers.__getitem__):
        theme = _theme(name, floors)
        for target in imports[name]:
            if theme is not None and _theme(target, floors) != theme:
                assert floor(target) < floors[theme], f"sebp_probe.{name} (floor {floors[theme]}) imports " \
                                                      f"{target} (floor {floor(target)})"


def test_kernels_know_nothing_of_models_or_the_probe():
    modules = _modules("sebp_kernels")
    for name, path in modules.items():
        _, other = _imports("sebp_kernels", name, path, modules)
        assert not other & {"transformers", "sebp_probe", "peft", "accelerate"}, (name, other)
