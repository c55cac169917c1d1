"""Every repository file or folder and every `pagedserve.x.y` module the docs name exists: docs/*.md, README.md,
deploy/README.md, and the docstrings and comments of engine/, service/, kernels/ and quant/.

Only what is clearly a path counts: in Markdown, a backticked token or a link target holding a '/' that starts
with one of the repository's top folders or ends in a known extension; in Python sources, such a token with a known
top folder. Paths are resolved from the repository root, then from the naming file's own folder (deploy/README.md
says `k8s/`); modules through pyproject.toml's package-dir, so the test follows the code when files move.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOP_FOLDERS = tuple(sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")))
EXTENSIONS = ("py", "md", "c", "h", "sh", "json", "yaml", "yml", "tmpl", "toml", "proto", "txt", "jinja", "go",
              "java", "xml", "tensors", "gguf", "safetensors", "jsonl", "csv")
_TOKEN = r"[A-Za-z0-9_.\-/]+"
_PATH_IN_SOURCE = re.compile(rf"(?<![\w./-])((?:{'|'.join(map(re.escape, TOP_FOLDERS))})/{_TOKEN})")
_MODULE = re.compile(r"(?<![\w.])pagedserve(?:\.[a-z_][a-z0-9_]*)+")
_BACKTICKED = re.compile(r"`([^`\s]+)`")
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
# Placeholders and patterns, not paths.
_NOT_A_PATH = re.compile(r"[$<>*{}~|:@,]|^\.\.?/|^/|\.\.\.")


def _markdown_files() -> list[Path]:
    return sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "deploy" / "README.md"]


def _source_files() -> list[Path]:
    return sorted(p for folder in ("engine", "service", "kernels", "quant") for p in (ROOT / folder).rglob("*.py"))


def _clean(token: str) -> str | None:
    token = token.strip().rstrip(".,;:)")
    token = re.sub(r"[:#]\w*$", "", token)  # file.py:function or file.md#anchor
    if not token or _NOT_A_PATH.search(token) or "/" not in token:
        return None
    top = token.split("/", 1)[0]
    if top in TOP_FOLDERS or token.rsplit(".", 1)[-1] in EXTENSIONS:
        return token
    return None


def named_paths(path: Path) -> set[str]:
    # A how-to names the files a newcomer creates as "`path` (new)" (tests/test_docs_howto.py checks their folder).
    text = re.sub(r"`[^`]+` \(new\)", "", path.read_text())
    if path.suffix == ".md":
        tokens = _BACKTICKED.findall(text) + [t for t in _LINK.findall(text) if "://" not in t]
    else:  # prose in code says "engine/server": only a file name with its extension, or a folder with its '/'
        tokens = [t for t in _PATH_IN_SOURCE.findall(text) if t.endswith("/") or "." in t.rsplit("/", 1)[-1]]
    return {cleaned for t in tokens if (cleaned := _clean(t))}


def named_modules(path: Path) -> set[str]:
    return set(_MODULE.findall(path.read_text()))


def path_exists(token: str, named_in: Path) -> bool:
    """`quant/onednn_dense.can_pack` names a function in quant/onednn_dense.py."""
    module, _, _ = token.rpartition(".")
    candidates = (token, f"{module}.py") if module and "/" in module else (token,)
    return any((base / c).exists() for base in (ROOT, named_in.parent) for c in candidates)


def _package_dirs() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return project["tool"]["setuptools"]["package-dir"]


def module_exists(module: str, package_dirs: dict[str, str]) -> bool:
    """pagedserve.a.b.c: the longest mapped package prefix, then folders/files (a trailing attribute, such as a
    class or function after the module, is allowed: `pagedserve.engine.LLM`)."""
    parts = module.split(".")
    for cut in range(len(parts), 1, -1):
        package = ".".join(parts[:cut])
        if package in package_dirs:
            folder = ROOT / package_dirs[package]
            rest = parts[cut:]
            break
    else:
        return module == "pagedserve"
    for i, name in enumerate(rest):
        if (folder / name).is_dir():
            folder = folder / name
        elif (folder / f"{name}.py").exists() or (folder / f"{name}.pyi").exists():
            return i >= len(rest) - 2  # the module, at most one attribute after it
        else:  # an attribute of the package itself, from its __init__
            init = folder / "__init__.py"
            return i == len(rest) - 1 and init.exists() and re.search(rf"\b{name}\b", init.read_text()) is not None
    return True


DOCUMENTS = _markdown_files() + _source_files()


@pytest.mark.parametrize("document", DOCUMENTS, ids=[str(p.relative_to(ROOT)) for p in DOCUMENTS])
def test_named_paths_and_modules_exist(document: Path):
    missing = sorted(t for t in named_paths(document) if not path_exists(t, document))
    dirs = _package_dirs()
    missing += sorted(m for m in named_modules(document) if not module_exists(m, dirs))
    assert not missing, f"{document.relative_to(ROOT)} names what does not exist: {missing}"


def test_the_extraction_sees_paths_and_modules():
    """The matcher itself: a known path, a known module and a known missing path are recognised."""
    arch = ROOT / "docs" / "architecture.md"
    assert "engine/runner/sampler.py" in named_paths(arch) and "tests/test_import_graph.py" in named_paths(arch)
    assert not path_exists("engine/no_such_module.py", arch)
    assert module_exists("pagedserve.engine.runner.sampler", _package_dirs())
    assert not module_exists("pagedserve.engine.no_such_module", _package_dirs())
    assert _clean("$PAGEDSERVE_CACHE/models/x.gguf") is None
    assert _clean("engine/gguf_file.py:34") == "engine/gguf_file.py"
