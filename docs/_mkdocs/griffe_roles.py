"""A griffe extension for the API reference: objckpt's docstrings, written for Sphinx, read as Markdown.

The docstrings cross-reference with Sphinx roles (``:class:`~objckpt.options.Options```) and
introduce examples with ``::``. mkdocstrings renders Markdown, where a role would show as
its raw text, so this rewrites each role into an optional cross-reference: a link where the
reference documents the object, plain code where it does not (a private helper, JAX), never a
warning. ``~`` keeps the last name only, as in Sphinx. A paragraph ending in ``::`` ends in
``:``, the indented block after it being a code block in Markdown as well. An attribute
without a docstring takes the ``#:`` comment lines just above it, as Sphinx's autodoc does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|mod|meth|func|data|attr|exc|obj):`(~?)([^`<]+?)`")
LITERAL = re.compile(r"(\S)::$", re.MULTILINE)


def _identifier(obj: griffe.Object, target: str) -> str:
    """The full path of ``target`` as seen from ``obj``'s docstring, or ``target`` itself."""
    target = target.strip().rstrip("()")
    head, _, rest = target.partition(".")
    scope: griffe.Object | None = obj
    while scope is not None:
        try:
            full = scope.resolve(head)
        except (griffe.NameResolutionError, griffe.AliasResolutionError, KeyError, ValueError):
            scope = scope.parent
            continue
        return f"{full}.{rest}" if rest else full
    return target


def rewrite(obj: griffe.Object, text: str) -> str:
    """``text`` with its Sphinx roles as optional autorefs and its ``::`` as ``:``."""

    def role(match: re.Match[str]) -> str:
        short, target = match.group(1), match.group(2).strip()
        identifier = _identifier(obj, target)
        title = target.rsplit(".", 1)[-1] if short else target
        return f'<autoref identifier="{identifier}" optional>`{title}`</autoref>'

    return LITERAL.sub(r"\1:", ROLE.sub(role, text))


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring of a loaded package once the whole package is known."""

    def on_attribute_instance(self, *, attr: griffe.Attribute, **kwargs: Any) -> None:
        path = attr.filepath
        if attr.docstring is not None or attr.lineno is None or not isinstance(path, Path):
            return
        collection = attr.lines_collection
        lines = collection[path] if path in collection else None
        if not lines:
            return
        comment: list[str] = []
        index = attr.lineno - 2  # the line above the attribute's first line (lineno is 1-based)
        while index >= 0 and lines[index].strip().startswith("#:"):
            comment.insert(0, lines[index].strip()[2:].strip())
            index -= 1
        if comment:
            attr.docstring = griffe.Docstring("\n".join(comment), lineno=index + 2, parent=attr)

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for obj in _walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = rewrite(obj, obj.docstring.value)


def _walk(obj: griffe.Object) -> list[griffe.Object]:
    """``obj`` and every object defined inside it (aliases are left to their targets)."""
    found: list[griffe.Object] = []
    todo = [obj]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(m for m in current.members.values() if isinstance(m, griffe.Object))
    return found
