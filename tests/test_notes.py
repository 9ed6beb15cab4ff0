"""Every `Note [name]` reference resolves: to exactly one Note of that name, and, where the
reference names a file ("Note [x] in engine/hooks.py", "Note [x] (rooflines.py)"), to that file.

A Note is defined by a heading alone on its line followed by its text:
- in a comment, `# Note [name]` and then comment lines (`#`) that continue it;
- in a docstring, `Note [name]` or `# Note [name]` and then a line of text.
A lone `# Note [name]` comment followed by code is a reference: it marks the place a Note
explains. Everything else that reads `Note [name]`, across line breaks and comment markers
included, is a reference.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEADING = re.compile(r"^\s*(#\s*)?Note \[([^\]]+)\]\s*$")
REFERENCE = re.compile(r"Note \[([^\]]+)\](?:\s*(?:in\s+|\()`?([\w./-]+\.py)\b)?")
# design.md describes the convention with the placeholder itself
PLACEHOLDER = "name"


def _sources() -> list[Path]:
    found = [*(ROOT / "offtensor").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py"),
             *(ROOT / "docs").glob("*.md"), ROOT / "README.md"]
    return sorted(p for p in found if p.exists())


def _inside_docstring(lines: list[str], i: int) -> bool:
    return sum(line.count('"""') for line in lines[:i]) % 2 == 1


def definitions(text: str) -> list[tuple[int, str]]:
    """(line, name) of each Note defined in a Python file's `text`."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        m = HEADING.match(line)
        if m is None or i + 1 >= len(lines):
            continue
        nxt = lines[i + 1].strip()
        if _inside_docstring(lines, i):
            defines = bool(nxt) and '"""' not in nxt[:3]
        else:
            defines = m.group(1) is not None and nxt.startswith("#") and not HEADING.match(nxt)
        if defines:
            found.append((i + 1, m.group(2)))
    return found


def references(text: str) -> list[tuple[str, str | None]]:
    """(name, file or None) of each `Note [name]` in `text`, read across line breaks and the
    comment markers that start continued lines."""
    flat = re.sub(r"\s*\n\s*(?:#+\s*)?", " ", text)
    return [(m.group(1), m.group(2)) for m in REFERENCE.finditer(flat)]


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _index() -> dict[str, list[str]]:
    """Note name -> the files (relative to the repository root) that define it, with the line."""
    index: dict[str, list[str]] = {}
    for path in _sources():
        if path.suffix == ".py":
            for line, name in definitions(path.read_text()):
                index.setdefault(name, []).append(f"{_rel(path)}:{line}")
    return index


def test_the_rule_tells_definitions_from_references():
    text = '\n'.join([
        '"""Module.', '', '# Note [in a docstring]', 'Text.', '', 'Note [bare heading]', 'Text.',
        'See Note [in a comment].', '"""', '', '# Note [in a comment]', '# Why it is so.', '',
        'def f():', '    # Note [in a comment]', '    return 1', '',
        '# see Note [across', '# lines] in core/x.py', ''])
    assert [n for _, n in definitions(text)] == ["in a docstring", "bare heading", "in a comment"]
    refs = references(text)
    assert ("in a comment", None) in refs and ("across lines", "core/x.py") in refs


def test_every_note_is_defined_once():
    twice = {name: where for name, where in _index().items() if len(where) > 1}
    assert not twice, f"Notes defined more than once: {twice}"


@pytest.mark.parametrize("path", _sources(), ids=_rel)
def test_every_note_reference_resolves(path):
    index = _index()
    problems = []
    for name, file in references(path.read_text()):
        if name == PLACEHOLDER:
            continue
        where = index.get(name)
        if not where:
            problems.append(f"Note [{name}] is defined nowhere")
        elif file is not None:
            definer = where[0].split(":")[0]
            if definer != file and not definer.endswith("/" + file):
                problems.append(f"Note [{name}] is said to be in {file}, but {definer} defines it")
    assert not problems, f"{_rel(path)}: " + "; ".join(problems)
