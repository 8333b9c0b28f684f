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
