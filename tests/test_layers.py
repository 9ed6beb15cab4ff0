"""The core's runtime imports go one way: each module imports only modules below it.

A lower layer never imports a higher one at run time (type-only imports under TYPE_CHECKING
are fine): the order is the one drawn in docs/design.md, "Layers and invariants".
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "offtensor"

# Bottom to top. A module may import any module before it in this list, none after it.
LAYERS = ["_api", "_host_memory", "_distributed", "_compile", "_param", "_scope", "_grads", "_overlap", "_transfer",
          "_wrap"]


def _runtime_imports(module: str) -> set[str]:
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found: set[str] = set()

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_only)
            return
        if isinstance(node, ast.ImportFrom) and node.level == 1 and not type_only:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child, type_only)

    visit(tree, False)
    return found


def test_every_core_module_is_in_a_layer():
    modules = {p.stem for p in PACKAGE.glob("_*.py") if p.stem != "__init__"}
    assert modules == set(LAYERS)


@pytest.mark.parametrize("module", LAYERS)
def test_a_module_imports_only_modules_below_it(module):
    below = set(LAYERS[: LAYERS.index(module)])
    upward = {m for m in _runtime_imports(module) if m in LAYERS and m not in below}
    assert not upward, (
        f"offtensor/{module}.py imports {sorted(upward)} at run time, above it in the layers "
        f"{LAYERS}: hand it an object to call instead (docs/design.md, Layers and invariants)"
    )
