"""Small modules with one job: no source file over 450 lines, no function over 60.

Today's offenders are listed with their size (`ALLOWED`). The list only shrinks: an
entry fails the check when it grows, and when it is no longer over the limit (then
delete the entry). A new file or function over the limit fails at once: split it.

A function's size is its span, from `def` to its last line (decorators excluded); a
nested function counts inside its outer one and again on its own, named `outer.inner`
(methods: `Class.method`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("wire", "serving", "registry", "router", "engine_agent", "planner", "pdreg",
            "bench")
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 60

# "path" for a file (its lines), "path::qualified.name" for a function (its span).
ALLOWED: dict[str, int] = {
}


def oversized(source: str, path: str) -> dict[str, int]:
    """The file (if over MAX_FILE_LINES) and the functions (over MAX_FUNCTION_LINES) of
    one module's source, with their sizes."""
    found: dict[str, int] = {}
    lines = len(source.splitlines())
    if lines > MAX_FILE_LINES:
        found[path] = lines

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                span = (child.end_lineno or child.lineno) - child.lineno + 1
                if span > MAX_FUNCTION_LINES:
                    found[f"{path}::{prefix}{child.name}"] = span
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(ast.parse(source), "")
    return found


def tree_oversized() -> dict[str, int]:
    found: dict[str, int] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            found.update(oversized(path.read_text(), relative))
    return found


def _function(name: str, body_lines: int, decorated: bool = False) -> str:
    head = "@decorator\n" if decorated else ""
    return head + f"def {name}():\n" + "    x = 1\n" * body_lines


@pytest.mark.parametrize(("source", "expected"), [
    (_function("f", 59), {}),  # 60 lines with its def: at the limit
    (_function("f", 60), {"m.py::f": 61}),
    (_function("f", 60, decorated=True), {"m.py::f": 61}),  # the decorator is not counted
    ("class C:\n" + "\n".join("    " + line for line in _function("g", 70).splitlines()),
     {"m.py::C.g": 71}),
    (_function("outer", 0) + "    " + _function("inner", 61).replace("\n", "\n    "),
     {"m.py::outer": 63, "m.py::outer.inner": 62}),
    ("x = 1\n" * 451, {"m.py": 451}),
    ("x = 1\n" * 450, {}),
])
def test_what_counts_as_oversized(source: str, expected: dict[str, int]) -> None:
    assert oversized(source, "m.py") == expected


def test_no_new_file_or_function_is_over_the_limit() -> None:
    new = {name: size for name, size in tree_oversized().items() if name not in ALLOWED}
    assert new == {}, (f"over {MAX_FILE_LINES} lines a file or {MAX_FUNCTION_LINES} a "
                       f"function: split them ({new})")


def test_the_allowed_offenders_only_shrink() -> None:
    found = tree_oversized()
    grown = {name: (ALLOWED[name], size) for name, size in found.items()
             if name in ALLOWED and size > ALLOWED[name]}
    assert grown == {}, f"allowed (was, now): these grew ({grown})"
    gone = sorted(set(ALLOWED) - set(found))
    assert gone == [], f"no longer over the limit (or gone): delete from ALLOWED {gone}"
