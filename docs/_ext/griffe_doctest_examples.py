"""Griffe extension for this site: render the framework's doctests as code.

The framework's docstrings include doctests in two forms that Napoleon and
``doctest`` accept but griffe's Google parser does not treat as examples:

* an ``Example:`` header (singular). Griffe only recognises ``Examples:`` as
  an examples section and turns ``Example:`` into an admonition whose body is
  Markdown. There the ``>>>`` lines become nested block quotes, and an output
  line such as ``[('torch.roll', 'function', 5)]`` is read as a reference link,
  which fails ``mkdocs build --strict``;
* a bare ``>>>`` block in the description, with no header at all.

Before griffe parses a docstring, this extension renames the header, or adds
an ``Examples:`` header in front of a bare, unindented doctest block. It
changes only the copy of the text used for the site; the source files are
not modified.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_SINGULAR_HEADER = re.compile(r"^(?P<indent>[ \t]*)Example:[ \t]*$", re.MULTILINE)


def _section_bare_doctests(text: str) -> str:
    """Put each unindented ``>>>`` block (one that follows a blank line) under an ``Examples:`` header."""
    lines = text.splitlines()
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
    return "\n".join(out)


class DoctestExamples(griffe.Extension):
    """Treat ``Example:`` like ``Examples:`` and give bare doctests a header."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        docstring = obj.docstring
        if docstring is None or ">>>" not in docstring.value:
            return
        value = _SINGULAR_HEADER.sub(r"\g<indent>Examples:", docstring.value)
        docstring.value = _section_bare_doctests(value)
