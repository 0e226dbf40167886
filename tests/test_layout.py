"""The library's import structure: no cycles between its modules, formats reads only the configuration, and nothing
in the library imports the demo distribution (the CLI verbs that use it import it by name, when they run)."""

import ast
import sys
from importlib.metadata import packages_distributions, requires
from pathlib import Path

from packaging.requirements import Requirement

import adaflash_hf

LIBRARY = Path(adaflash_hf.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(LIBRARY.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module an `import` statement in ``path`` names, wherever the statement is (top level or a function)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[: len(base) - node.level + 1] if node.level else []
            stem = ".".join([*base, node.module] if node.module else base)
            names.add(stem)
            names.update(f"{stem}.{alias.name}" for alias in node.names)  # `from . import x` may name a module
    return names


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in LIBRARY.rglob("*.py")}
    return {name: {i for i in _imports(path) if i in paths and i != name} for name, path in paths.items()}


def test_no_import_cycle_between_library_modules():
    graph = _graph()
    # A package's __init__ re-exports its submodules; an edge from a submodule to its own package's __init__ would
    # be the cycle, so __init__ modules stay in the graph like any other module.
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for child in sorted(graph[node]):
            if state.get(child) == "open":
                raise AssertionError("import cycle: " + " -> ".join([*path[path.index(child) :], child]))
            if child not in state:
                visit(child, [*path, child])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_formats_reads_only_the_configuration():
    assert {m for m in _graph()["adaflash_hf.formats"]} <= {
        "adaflash_hf.configuration",
        "adaflash_hf.dflash2",
        "adaflash_hf.draft_vocab_rows",
        "adaflash_hf.schema",
        "adaflash_hf.utils",
    }


def test_the_schema_is_below_configuration_and_formats():
    # both build on it, so it imports neither (nor anything of the library but the DFlash 2 constants)
    assert {m for m in _graph()["adaflash_hf.schema"]} <= {"adaflash_hf.dflash2"}


def test_the_library_never_imports_the_demo():
    offenders = sorted(
        _module_name(p) for p in LIBRARY.rglob("*.py") if any(i.startswith("adaflash_demo") for i in _imports(p))
    )
    assert offenders == []


def test_declared_dependencies_cover_every_third_party_import():
    """The wheel's metadata names every distribution the library imports (matplotlib in its `plot` extra), so a plain
    `pip install adaflash-hf` brings what the code needs."""
    declared = {Requirement(r).name.lower().replace("_", "-") for r in requires("adaflash-hf")}
    providers = packages_distributions()
    imported = {
        name.split(".")[0]
        for path in LIBRARY.rglob("*.py")
        for name in _imports(path)
        if not name.startswith("adaflash_hf") and name.split(".")[0] not in sys.stdlib_module_names
    }
    undeclared = {
        module: providers.get(module)
        for module in imported
        if not {d.lower().replace("_", "-") for d in providers.get(module, [module])} & declared
    }
    assert not undeclared, undeclared
