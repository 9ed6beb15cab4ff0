"""The library's imports go one way: each module imports only modules below it.

A lower layer never imports a higher one, not even for type annotations under TYPE_CHECKING:
it is handed an object to call instead. The order is the one drawn in docs/design.md,
"Layers and invariants". Modules are named by their path in the package (`core.scope`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "offtensor"

# Bottom to top. A module may import any module before it in this list, none after it.
LAYERS = ["api", "patches", "weights.kernels", "weights.compress", "weights.files", "weights.checkpoint", "core.memory",
          "core.progress", "weights.file_masters", "weights.staging", "distributed.shm", "distributed.matching",
          "distributed.wrappers", "dispatch.compile", "core.calls", "core.slot", "dispatch.masters", "dispatch.metadata", "dispatch.writes",
          "dispatch.ops", "dispatch.autograd", "dispatch.param", "dispatch.function_apply", "dispatch.optimizer_step",
          "core.streams", "core.write_tracking", "core.host_masters", "core.device_buffer", "core.loading",
          "core.old_grads", "core.scope", "core.expert_cache", "core.experts", "core.grad_calls", "budget.layout", "budget.timed",
          "budget.vram", "budget.shared", "core.schedule", "core.grads", "core.transforms", "core.access", "core.writes", "core.threads",
          "core.engine", "core.hooks", "weights.quantized", "optim.report", "optim.views", "optim.pieces",
          "optim.device_steps", "optim.piece_queue", "optim.calls", "optim.fenced_state", "optim.clipping",
          "optim.checks", "optim.worker", "optim.step", "optim.overlap", "planning", "guards", "wrapping",
          "reporting", "components", "controls", "distributed.shared_masters", "distributed.sharded_loads", "distributed.reducer",
          "distributed.agreement", "distributed.data_parallel", "weights.load"]


def _modules() -> set[str]:
    """Every module of the package but the package files (`__init__.py`)."""
    return {".".join(p.relative_to(PACKAGE).with_suffix("").parts) for p in PACKAGE.rglob("*.py")
            if p.name != "__init__.py"}


def _resolve(module: str, level: int, name: str | None) -> str:
    """The package module a relative import names, from inside `module`."""
    parts = module.split(".")[:-1]
    base = parts[: len(parts) - (level - 1)]
    return ".".join([*base, *(name.split(".") if name else [])])


def _imports(module: str) -> set[str]:
    """The package modules `module` imports, anywhere in it (TYPE_CHECKING blocks included)."""
    known = _modules()
    found: set[str] = set()
    path = PACKAGE.joinpath(*module.split(".")).with_suffix(".py")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            target = _resolve(module, node.level, node.module)
            for alias in node.names:  # `from .core import scope` names a module, not a name in one
                sub = f"{target}.{alias.name}" if target else alias.name
                found.add(sub if sub in known else target)
    return found & known


def test_every_module_is_in_a_layer():
    assert _modules() == set(LAYERS)


@pytest.mark.parametrize("module", LAYERS)
def test_a_module_imports_only_modules_below_it(module):
    below = set(LAYERS[: LAYERS.index(module)])
    upward = {m for m in _imports(module) if m not in below and m != module}
    assert not upward, (
        f"offtensor/{module.replace('.', '/')}.py imports {sorted(upward)}, above it in the layers "
        f"{LAYERS}: hand it an object to call instead (docs/design.md, Layers and invariants)"
    )
