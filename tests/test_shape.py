"""The shape the code keeps: modules a reader can hold, functions that fit a screen, classes with one job, one
forward path, and the C boundary in two places only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "moestream"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_METHODS = 500, 80, 15
# the only modules that may load C code or take raw addresses: the kernels' wrappers and the C library's
C_BOUNDARY = ("compute/", "streaming/libc.py")


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _name(path: Path) -> str:
    return str(path.relative_to(PACKAGE))


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_module_function_and_class_sizes(path: Path):
    assert path.read_text().count("\n") <= MAX_MODULE_LINES, f"{_name(path)} is over {MAX_MODULE_LINES} lines"
    for node in ast.walk(_tree(path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            assert lines <= MAX_FUNCTION_LINES, f"{_name(path)}:{node.lineno} {node.name} has {lines} lines"
        if isinstance(node, ast.ClassDef):
            methods = [
                f.name
                for f in node.body
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                and not any(isinstance(d, ast.Name) and d.id == "property" for d in f.decorator_list)
            ]
            assert len(methods) <= MAX_METHODS, f"{_name(path)}: {node.name} has {len(methods)} methods"


def test_ctypes_only_at_the_c_boundary():
    for path in MODULES:
        if _name(path).startswith(C_BOUNDARY):
            continue
        for node in ast.walk(_tree(path)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "ctypes" for n in names), f"{_name(path)} imports ctypes"
            if isinstance(node, ast.Attribute) and node.attr == "data_ptr":
                pytest.fail(f"{_name(path)}:{node.lineno} takes a raw address (data_ptr)")


def test_one_forward_path():
    """The model's forward step lives in models/base.py alone: no architecture has a forward loop of its own."""
    for path in sorted((PACKAGE / "models").glob("*.py")):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.FunctionDef) and node.name in ("forward", "step", "forward_rows", "forward_batch"):
                assert path.name == "base.py", f"{_name(path)} defines {node.name}"
