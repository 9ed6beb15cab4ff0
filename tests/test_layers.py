"""The core's imports go one way: each module imports only modules below it.

A lower layer never imports a higher one, not even for type annotations under TYPE_CHECKING:
it is handed an object to call instead. The order is the one drawn in docs/design.md,
"Layers and invariants".
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "offtensor"

# Bottom to top. A module may import any module before it in this list, none after it.
LAYERS = ["_api", "_kernels", "_compress", "_host_memory", "_file_masters", "_shm", "_distributed", "_compile", "_slot",
          "_param", "_streams", "_device_steps", "_scope", "_plan", "_schedule", "_grads", "_engine", "_hooks",
          "_quantized", "_overlap", "_wrap", "_shared_masters", "_sharded_loads", "_data_parallel", "_load"]


def _imports(module: str) -> set[str]:
    """The package modules `module` imports, anywhere in it (TYPE_CHECKING blocks included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse((PACKAGE / f"{module}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found


def test_every_core_module_is_in_a_layer():
    modules = {p.stem for p in PACKAGE.glob("_*.py") if p.stem != "__init__"}
    assert modules == set(LAYERS)


@pytest.mark.parametrize("module", LAYERS)
def test_a_module_imports_only_modules_below_it(module):
    below = set(LAYERS[: LAYERS.index(module)])
    upward = {m for m in _imports(module) if m in LAYERS and m not in below}
    assert not upward, (
        f"offtensor/{module}.py imports {sorted(upward)}, above it in the layers "
        f"{LAYERS}: hand it an object to call instead (docs/design.md, Layers and invariants)"
    )
