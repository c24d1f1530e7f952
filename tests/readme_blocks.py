"""The README's fenced blocks, read the one way the tests and CI both use.

A block may carry a marker, an HTML comment on the line(s) just before its fence:
``<!-- command: NAME -->`` names one of the README's commands (CI runs it exactly as
written: ``python tests/readme_blocks.py NAME`` prints it), ``<!-- needs: mod, ... -->``
names the importable modules a Python block needs (its test skips, saying so, where one is
missing)."""
from __future__ import annotations

import pathlib
import re
import sys
from dataclasses import dataclass

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
_FENCE = re.compile(r"^```(\w*)\s*$")
_MARK = re.compile(r"^<!--\s*(command|needs):\s*(.*?)\s*-->\s*$")


@dataclass
class Block:
    lang: str
    code: str
    line: int                  # 1-based line of the opening fence
    command: str | None = None
    needs: tuple = ()


def blocks(text: str | None = None) -> list[Block]:
    """Every fenced block of the README (or of ``text``), with its markers."""
    lines = (README.read_text() if text is None else text).splitlines()
    out, i, marks = [], 0, {}
    while i < len(lines):
        m = _MARK.match(lines[i])
        if m:
            marks[m.group(1)] = m.group(2)
        f = _FENCE.match(lines[i])
        if f and f.group(1):
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            if j == len(lines):
                raise ValueError(f"README line {i + 1}: a ``` block is not closed")
            needs = tuple(n.strip() for n in marks.get("needs", "").split(",") if n.strip())
            out.append(Block(f.group(1), "\n".join(lines[i + 1:j]) + "\n", i + 1,
                             marks.get("command"), needs))
            marks, i = {}, j + 1
            continue
        if lines[i].strip() and not m:
            marks = {}             # a marker holds only for the block right after it
        i += 1
    return out


def command(name: str, text: str | None = None) -> str:
    """The one command block marked ``name``, as its single line of shell."""
    found = [b for b in blocks(text) if b.command == name]
    if len(found) != 1:
        raise ValueError(f"README has {len(found)} blocks marked 'command: {name}', expected 1")
    code = found[0].code.strip()
    if "\n" in code:
        raise ValueError(f"README command {name!r} is not one line")
    return code


if __name__ == "__main__":
    print(command(sys.argv[1]))
