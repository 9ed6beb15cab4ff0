"""The package's folders are its layers, and imports go one way: down.

A module imports modules of its own folder and of the folders below it, never of one above, not
even for type annotations under TYPE_CHECKING: it is handed an object to call instead, typed with
a Protocol of its own (docs/design.md, "Layers and invariants"). Within a folder, imports form no
cycle, so each folder reads bottom-up too. Modules are named by their path in the package
(`scopes.scope`); the package's own modules (`api`, `patches`) are the folder "".
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "offtensor"

# Bottom to top: one rule each, "imports only its own folder and those before it".
FOLDERS = [
    "",  # api.py (Policy, the state enums, the reports), formats.py (the frozen formats), patches.py
    "storage",  # the bytes of masters: host memory, compressed formats, files, the staging ring, shm
    "dispatch",  # one parameter: ParamSlot, OffloadedParameter and what an op on it gets
    "scopes",  # Scope, its states and parts: streams, loads, host masters, device buffer, experts
    "budget",  # the VRAM budget and its timed layout
    "engine",  # Engine of one model: schedule, gradients to the host, hooks
    "optim",  # backward_and_step: the optimizer overlapped with backward
    "model",  # wrap, unwrap, load, summary, controls: a whole model
    "distributed",  # data_parallel: shared masters, sharded loads, gradient averaging
]


def _modules() -> set[str]:
    """Every module of the package but the package files (`__init__.py`)."""
    return {".".join(p.relative_to(PACKAGE).with_suffix("").parts) for p in PACKAGE.rglob("*.py")
            if p.name != "__init__.py"}


def _folder(module: str) -> str:
    return module.rpartition(".")[0]


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
            for alias in node.names:  # `from ..engine import engine` names a module, not a name in one
                sub = f"{target}.{alias.name}" if target else alias.name
                found.add(sub if sub in known else target)
    return found & known


def test_every_module_is_in_a_folder_of_the_layers():
    folders = {_folder(m) for m in _modules()}
    assert folders == set(FOLDERS), f"folders not in FOLDERS: {folders - set(FOLDERS)}; gone: {set(FOLDERS) - folders}"


@pytest.mark.parametrize("module", sorted(_modules()))
def test_a_module_imports_only_its_folder_and_those_below(module):
    allowed = set(FOLDERS[: FOLDERS.index(_folder(module)) + 1])
    upward = sorted(m for m in _imports(module) if _folder(m) not in allowed)
    assert not upward, (
        f"offtensor/{module.replace('.', '/')}.py imports {upward}, from a folder above its own in "
        f"{FOLDERS}: hand it an object to call instead (docs/design.md, Layers and invariants)"
    )


@pytest.mark.parametrize("folder", FOLDERS)
def test_a_folder_has_no_import_cycle(folder):
    inside = {m for m in _modules() if _folder(m) == folder}
    edges = {m: {i for i in _imports(m) if i in inside and i != m} for m in inside}
    order: list[str] = []  # modules whose imports inside the folder are all in `order` already
    while len(order) < len(inside):
        ready = sorted(m for m in inside if m not in order and edges[m] <= set(order))
        assert ready, f"offtensor/{folder}: these modules import each other in a cycle: {sorted(inside - set(order))}"
        order.extend(ready)
