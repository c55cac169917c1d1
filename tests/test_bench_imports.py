"""Every `from pagedserve... import name` in benchmarks/ resolves, including the ones inside functions that only a
benchmark run reaches: the step refactors moved modules, and a benchmark that fails at its first call is found here
instead of on the quiet host it was meant to measure."""

import ast
import functools
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@functools.cache  # once per session: each parametrized test reads it (parsing every benchmark took ~0.6 s a test)
def pagedserve_imports() -> tuple[tuple[str, str, str], ...]:
    found = []
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "pagedserve":
                found += [(str(path.relative_to(ROOT)), node.module, alias.name) for alias in node.names]
    return tuple(found)


def test_benchmarks_import_pagedserve():
    assert len(pagedserve_imports()) > 50


@pytest.mark.parametrize("module", sorted({m for _, m, _ in pagedserve_imports()}))
def test_imported_names_exist(module):
    loaded = importlib.import_module(module)
    missing = []
    for path, mod, name in pagedserve_imports():
        if mod != module or name == "*" or hasattr(loaded, name):
            continue
        try:
            importlib.import_module(f"{module}.{name}")
        except ImportError:
            missing.append(f"{path}: from {module} import {name}")
    assert not missing, missing
