"""The layering rule: gr2model never imports orchestration; imports point flows -> tasks -> gr2model."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "gr2model": {"prefect", "mlflow", "dvc", "yaml", "tasks", "flows"},
    "tasks": {"prefect", "flows"},
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_does_not_import_upper_layers(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no python files under {package}/"
    bad = {str(f.relative_to(ROOT)): sorted(imported_modules(f) & FORBIDDEN[package]) for f in files}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"{package} must not import {sorted(FORBIDDEN[package])}: {bad}"


def test_checker_sees_forbidden_imports(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("import os\nfrom mlflow import log_metric\nimport prefect.flows\nfrom . import x\n")
    assert imported_modules(f) == {"os", "mlflow", "prefect"}


def private_imports(path: Path, package: str) -> list[str]:
    """Underscore names that `path` takes from another module of `package`: imported by name
    (`from package.x import _y`) or read off an imported module (`import package.x as m; m._y`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] == package:
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname and a.name.split(".")[0] == package})
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                found.append(f"{aliases[node.value.id]}.{node.attr}")
    return found


def test_library_modules_share_only_public_names() -> None:
    """A helper one gr2model module uses from another has a public name in its home module."""
    files = sorted((ROOT / "gr2model").rglob("*.py"))
    bad = {str(f.relative_to(ROOT)): private_imports(f, "gr2model") for f in files}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"private names imported across gr2model modules: {bad}"


def test_checker_sees_private_imports(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("from gr2model.a import _x, y\nimport gr2model.b as b\nb._z\nb.w\nb.__doc__\nfrom other import _q\n")
    assert private_imports(f, "gr2model") == ["gr2model.a._x", "gr2model.b._z"]
