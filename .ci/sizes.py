"""Size limits that keep the code readable (issue 33): no class over 300 lines, no function over
80, no file over 600, no Note over 20. Run from the repository root: `python .ci/sizes.py [paths]`
(default: offtensor and benchmarks). Prints each violation and exits 1 if there is one."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

LIMITS = {"file": 600, "class": 300, "function": 80, "note": 20}
NOTE = re.compile(r"^\s*# Note \[[^\]]+\]\s*$")


def notes(lines: list[str]) -> list[tuple[int, str, int]]:
    """(line, heading, length) of each Note. A Note is a `# Note [name]` heading and what follows
    it: in a comment block, the block's lines; in a docstring, the lines up to a blank line or
    the closing quotes. A comment block's lone `#` lines belong to it."""
    found = []
    for i, line in enumerate(lines):
        if not NOTE.match(line):
            continue
        in_comment = line.lstrip().startswith("#") and not _inside_docstring(lines, i)
        n = 1
        for nxt in lines[i + 1:]:
            s = nxt.strip()
            if NOTE.match(nxt) or (in_comment and not s.startswith("#")):
                break
            if not in_comment and (not s or '"""' in s):
                break
            n += 1
        found.append((i + 1, line.strip(), n))
    return found


def _inside_docstring(lines: list[str], i: int) -> bool:
    return sum(line.count('"""') for line in lines[:i]) % 2 == 1


def check(path: Path) -> list[str]:
    text = path.read_text()
    lines = text.splitlines()
    out = []
    if len(lines) > LIMITS["file"]:
        out.append(f"{path}: {len(lines)} lines (file limit {LIMITS['file']})")
    for node in ast.walk(ast.parse(text, str(path))):
        kind = ("class" if isinstance(node, ast.ClassDef) else
                "function" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None)
        if kind is None:
            continue
        size = node.end_lineno - node.lineno + 1  # type: ignore[operator]
        if size > LIMITS[kind]:
            out.append(f"{path}:{node.lineno}: {kind} {node.name} is {size} lines (limit {LIMITS[kind]})")
    for line, heading, size in notes(lines):
        if size > LIMITS["note"]:
            out.append(f"{path}:{line}: {heading} is {size} lines (limit {LIMITS['note']})")
    return out


def main(argv: list[str]) -> int:
    roots = [Path(a) for a in argv] or [p for p in (Path("offtensor"), Path("benchmarks")) if p.exists()]
    files = sorted(f for r in roots for f in ([r] if r.is_file() else r.rglob("*.py")))
    problems = [p for f in files for p in check(f)]
    print("\n".join(problems) if problems else f"sizes: {len(files)} files within the limits {LIMITS}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
