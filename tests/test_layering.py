"""The library never depends on the demo distribution, which depends on it: no module of `adaflash_hf` imports
`adaflash_demo`, neither statically (an import statement) nor by name (`importlib.import_module`, `__import__`, any
string naming it), and importing every module and running every command leaves `adaflash_demo` unimported."""

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

LIBRARY = Path(__file__).resolve().parents[1] / "adaflash_hf"
DEMO = "adaflash_demo"


def demo_references(source: str) -> list[str]:
    """Every import of the demo package, and every string naming it other than a docstring (a docstring may mention
    the demo; code cannot name it, so no `import_module(...)` can reach it)."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] == DEMO]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == DEMO:
            found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if DEMO in node.value or DEMO.replace("_", "-") + "." in node.value:
                found.append(f"string {node.value!r} (line {node.lineno})")
    return found


def test_the_scanner_finds_every_way_of_naming_the_demo():
    # negative controls: each of these is a dependency on the demo the test must catch
    sources = {
        "import adaflash_demo.cli": 1,
        "from adaflash_demo import demo": 1,
        "import importlib\nimportlib.import_module('adaflash_demo.bench.harness')": 1,
        "__import__(f'adaflash_demo.{name}')": 1,
        '"""Mentions adaflash_demo in a docstring only."""\nx = 1': 0,
        "def f():\n    '''The adaflash_demo package is separate.'''\n    return 1": 0,
    }
    for source, expected in sources.items():
        assert len(demo_references(source)) == expected, source


def test_no_library_module_names_the_demo():
    modules = sorted(LIBRARY.rglob("*.py"))
    assert len(modules) > 30  # the scan saw the library
    found = {str(p.relative_to(LIBRARY)): demo_references(p.read_text(encoding="utf-8")) for p in modules}
    assert {path: refs for path, refs in found.items() if refs} == {}


@pytest.mark.parametrize("command", [["--help"], ["train", "--help"], ["online", "--help"], None])
def test_importing_the_library_and_running_its_commands_never_imports_the_demo(command):
    # a finder that fails any import of the demo, even one hidden behind a computed name; `None` is the negative
    # control, a computed import of the demo, which the finder must stop
    control = command is None
    command = command or ["--help"]
    script = textwrap.dedent(
        f"""
        import importlib, pkgutil, sys

        class NoDemo:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == {DEMO!r}:
                    raise ImportError("the library imported " + name)

        sys.meta_path.insert(0, NoDemo())
        if {control!r}:
            importlib.import_module("adaflash_" + "demo.cli")
        import adaflash_hf
        for module in pkgutil.walk_packages(adaflash_hf.__path__, "adaflash_hf."):
            importlib.import_module(module.name)
        from adaflash_hf.cli import main
        try:
            main({command!r})
        except SystemExit as exit:
            assert exit.code == 0, exit.code
        assert not [name for name in sys.modules if name.startswith({DEMO!r})]
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    if control:
        assert result.returncode != 0 and "ImportError: the library imported adaflash_demo" in result.stderr
    else:
        assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
