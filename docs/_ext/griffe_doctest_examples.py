"""Griffe extension for this site: make the framework's docstrings render as Markdown.

The framework writes docstrings in a Google/reST mix that Python's ``doctest``
and Sphinx's Napoleon accept, but that griffe's Google parser renders poorly,
or, in one case, in a way that fails ``mkdocs build --strict``:

* ``Example:`` (singular). Griffe only treats ``Examples:`` as an examples
  section. ``Example:`` becomes an admonition with a Markdown body, in which
  ``>>>`` lines turn into nested block quotes, and an output line such as
  ``[('torch.roll', 'function', 5)]`` is read as a reference link. That broken
  link is a strict-mode warning.
* A bare ``>>>`` block in a description, with no header at all.
* reST literal blocks (``Example::`` followed by an indented block) and reST
  roles (``:class:`~pkg.mod.Name```), which Markdown shows as literal text.

Before griffe parses a docstring, this extension rewrites it: singular headers
become ``Examples:``, bare doctests get an ``Examples:`` header, literal
blocks become fenced code, and roles become inline code. Only the copy used
for the site changes; the source files are not modified.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_SINGULAR_HEADER = re.compile(r"^(?P<indent>[ \t]*)Example:[ \t]*$", re.MULTILINE)
_ROLE = re.compile(r":(?:py:)?[a-z]+:`(?P<tilde>~?)(?P<target>[^`]+)`")


def _role_to_code(match: re.Match[str]) -> str:
    target = match["target"]
    return f"`{target.rsplit('.', 1)[-1] if match['tilde'] else target}`"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _fence_literal_blocks(lines: list[str]) -> list[str]:
    """Turn ``text::`` + blank line + indented block into ``text:`` + a fenced code block."""
    out: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        stripped = line.rstrip()
        if stripped.endswith("::") and index + 2 < len(lines) and not lines[index + 1].strip():
            base = _indent(line)
            end = index + 2
            while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > base):
                end += 1
            body = lines[index + 2 : end]
            while body and not body[-1].strip():
                body.pop()
            if body and _indent(body[0]) > base:
                depth = min(_indent(b) for b in body if b.strip())
                pad = " " * base
                out.append(stripped[:-1])
                out.append("")
                out.append(f"{pad}```python")
                out.extend(f"{pad}{b[depth:]}" if b.strip() else "" for b in body)
                out.append(f"{pad}```")
                out.extend("" for _ in range(end - index - 2 - len(body)))  # keep trailing blanks
                index = end
                continue
        out.append(line)
        index += 1
    return out


def _section_bare_doctests(lines: list[str]) -> list[str]:
    """Put each unindented ``>>>`` block (one that follows a blank line) under an ``Examples:`` header."""
    out: list[str] = []
    in_block = False
    for index, line in enumerate(lines):
        starts_block = line.startswith(">>>") and (index == 0 or not lines[index - 1].strip())
        if starts_block and not in_block:
            out.append("Examples:")
            in_block = True
        if in_block and not line.strip():
            in_block = False
        out.append(f"    {line}" if in_block else line)
    return out


def markdownify(text: str) -> str:
    """Apply every rewrite described in the module docstring to one docstring."""
    text = _ROLE.sub(_role_to_code, text)
    text = _SINGULAR_HEADER.sub(r"\g<indent>Examples:", text)
    lines = _fence_literal_blocks(text.splitlines())
    return "\n".join(_section_bare_doctests(lines))


class DoctestExamples(griffe.Extension):
    """Rewrite each docstring with :func:`markdownify` before griffe parses it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdownify(obj.docstring.value)
