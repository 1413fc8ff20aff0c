"""The test tree imports the product and its own helpers, never benchmarks/, loadtest/ or tools/: those run
here only as subprocesses (`python -m …`), the way a developer runs them."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
FORBIDDEN = {"benchmarks", "loadtest", "tools"}


def _names_a_module(call: ast.Call) -> bool:
    """importlib.import_module("x") or __import__("x") with a literal name."""
    name = getattr(call.func, "id", getattr(call.func, "attr", ""))
    first = call.args[0] if call.args else None
    return name in ("import_module", "__import__") and isinstance(first, ast.Constant) and isinstance(first.value, str)


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and _names_a_module(node):
            roots.add(node.args[0].value.split(".")[0])
    return roots


def test_no_test_imports_benchmarks_loadtest_or_tools():
    offenders = {
        str(path.relative_to(TESTS)): sorted(imported_roots(path) & FORBIDDEN)
        for path in sorted(TESTS.rglob("*.py"))
        if imported_roots(path) & FORBIDDEN
    }
    assert not offenders, f"tests import {offenders}: run them as `python -m …` subprocesses instead"


def test_the_check_sees_every_import_form(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import tools.kernel_launches\nfrom loadtest import run_locust\n"
        "import importlib\nimportlib.import_module('benchmarks.common.trace')\n"
    )
    assert imported_roots(probe) & FORBIDDEN == FORBIDDEN
