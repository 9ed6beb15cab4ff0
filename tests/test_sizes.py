"""The size check CI runs (.ci/sizes.py) finds what it must: long files, classes, functions and
Notes, in comments and in docstrings."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("sizes", ROOT / ".ci" / "sizes.py")
assert _spec is not None and _spec.loader is not None
sizes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sizes)


def _check(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "m.py"
    path.write_text(text)
    return sizes.check(path)


def test_code_within_the_limits_passes(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(78))
    note = "# Note [short]\n" + "".join(f"# line {i}\n" for i in range(19))
    assert _check(tmp_path, f'"""Doc."""\n\n{note}\n\ndef f():\n{body}\n') == []


def test_a_long_function_class_and_file_are_reported(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(300))
    found = _check(tmp_path, f"class C:\n    def f(self):\n{body}\n" + "\n" * 300)
    assert any("class C is 302 lines" in f for f in found)
    assert any("function f is 301 lines" in f for f in found)
    assert any("file limit" in f for f in found)


def test_long_notes_are_reported_in_comments_and_in_docstrings(tmp_path):
    comment = "# Note [in a comment]\n" + "#\n".join(f"# line {i}\n" for i in range(21))
    doc = '"""Module.\n\n# Note [in a docstring]\n' + "".join(f"line {i}\n" for i in range(21)) + '"""\n'
    found = _check(tmp_path, doc + "\n" + comment)
    assert any("Note [in a comment]" in f for f in found)
    assert any("Note [in a docstring] is 22 lines" in f for f in found)


def test_a_note_ends_at_a_blank_line_of_its_docstring(tmp_path):
    doc = '"""Module.\n\n# Note [short]\nline\n\n' + "".join(f"other {i}\n" for i in range(30)) + '"""\n'
    assert _check(tmp_path, doc) == []
