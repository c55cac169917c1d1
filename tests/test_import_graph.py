"""The package layering, read from the source: no import cycle between modules; kernels/ imports nothing above it
(quant/, engine/, service/), quant/ nothing of engine/ or service/, engine/ nothing of service/; the engine core
(engine/*.py, the request path) imports no host tuning (engine/host/); the front ends (service/v1, service/openai,
service/router) are siblings over service/core and import neither each other nor the composition root. Imports
inside functions count too: a deferred import hides a cycle, it does not remove it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kernels", "quant", "engine", "service")
# package -> packages it must never import
FORBIDDEN = {"kernels": ("quant", "engine", "service"), "quant": ("engine", "service"), "engine": ("service",)}
FRONT_ENDS = ("pagedserve.service.v1", "pagedserve.service.openai", "pagedserve.service.router")
SERVICE_CORE = "pagedserve.service.core"
# service/'s top-level modules: the composition root (cli, entry, server, config) that builds the front ends.
COMPOSITION_ROOT = ("pagedserve.service.cli", "pagedserve.service.entry", "pagedserve.service.server")
ENGINE_HOST = "pagedserve.engine.host"
# The offline `LLM` is an entry like `pagedserve serve`: it tunes the host before it builds the engine.
ENGINE_ENTRIES = ("pagedserve.engine.llm",)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["pagedserve", *parts])


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_of(name: str, is_package: bool, source: str, known: set[str]) -> set[str]:
    """The known modules that module `name` (source text `source`) imports; `from pkg import submodule` counts as
    the submodule."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path.name == "__init__.py", path.read_text(), known) for name, path in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_walk_sees_the_packages():
    graph = import_graph()
    assert "pagedserve.kernels.paged_attention" in graph and "pagedserve.service.v1.servicer" in graph
    assert "pagedserve.kernels.attention" in graph["pagedserve.kernels.paged_attention"]
    assert "pagedserve.engine.models.layers" in graph["pagedserve.engine.models.llama"]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_lower_layers_never_import_higher_ones():
    bad = []
    for name, deps in import_graph().items():
        layer = name.split(".")[1]
        for dep in deps:
            if dep.split(".")[1] in FORBIDDEN.get(layer, ()):
                bad.append(f"{name} imports {dep}")
    assert not bad, "\n".join(sorted(bad))


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def engine_core(module: str) -> bool:
    """engine/*.py itself (not its subpackages host/, loading/, models/), entries excluded."""
    parts = module.split(".")
    return parts[:2] == ["pagedserve", "engine"] and len(parts) == 3 and module not in ENGINE_ENTRIES


def layering_breaks(graph: dict[str, set[str]]) -> list[str]:
    """Every import the sibling and core rules forbid, as 'a imports b'."""
    bad = []
    for name, deps in graph.items():
        for dep in deps:
            front = next((f for f in FRONT_ENDS if within(name, f)), None)
            if front and any(within(dep, other) for other in FRONT_ENDS if other != front):
                bad.append(f"{name} imports {dep} (another front end)")
            if (front or within(name, SERVICE_CORE)) and dep in COMPOSITION_ROOT:
                bad.append(f"{name} imports {dep} (the composition root)")
            if within(name, SERVICE_CORE) and any(within(dep, f) for f in FRONT_ENDS):
                bad.append(f"{name} imports {dep} (a front end, from the core)")
            if engine_core(name) and (within(dep, ENGINE_HOST) or within(dep, "pagedserve.service")):
                bad.append(f"{name} imports {dep} (the engine core imports no host tuning or service)")
    return bad


def test_front_ends_are_siblings_and_the_engine_core_imports_no_host_tuning():
    graph = import_graph()
    assert any(within(m, f) for m in graph for f in FRONT_ENDS) and any(engine_core(m) for m in graph)
    bad = layering_breaks(graph)
    assert not bad, "\n".join(sorted(bad))


def test_the_checks_catch_what_they_look_for():
    # The detectors themselves, on graphs with a known defect: a test that cannot fail proves nothing.
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    code = "def f():\n    from pagedserve.engine.loading.model_store import cache_root\nfrom . import kv_cache\nimport os\n"
    known = {"pagedserve.engine.loading.model_store", "pagedserve.kernels.kv_cache"}
    assert imports_of("pagedserve.kernels.paged_attention", False, code, known) == known
    broken = {
        "pagedserve.service.openai.openai_api": {
            "pagedserve.service.v1.servicer", "pagedserve.service.core.stream"},
        "pagedserve.service.core.stream": {"pagedserve.service.router.kv_events"},
        "pagedserve.engine.llm_engine": {"pagedserve.engine.host.tuning", "pagedserve.engine.loading.tokenizer"},
        "pagedserve.engine.llm": {"pagedserve.engine.host.tuning"},
        "pagedserve.service.v1.servicer": {"pagedserve.service.server"},
    }
    assert sorted(layering_breaks(broken)) == sorted([
        "pagedserve.service.openai.openai_api imports pagedserve.service.v1.servicer (another front end)",
        "pagedserve.service.core.stream imports pagedserve.service.router.kv_events (a front end, from the core)",
        "pagedserve.engine.llm_engine imports pagedserve.engine.host.tuning "
        "(the engine core imports no host tuning or service)",
        "pagedserve.service.v1.servicer imports pagedserve.service.server (the composition root)",
    ])
