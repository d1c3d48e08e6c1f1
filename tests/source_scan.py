"""Reading the library's own source as syntax trees, for tests that check what it imports."""

from __future__ import annotations

import ast


def parse_source(source: str, filename: str) -> ast.Module:
    """``ast.parse``, tried again on CPython 3.11's "AST constructor recursion depth mismatch".

    That SystemError is a race inside the interpreter (its AST-to-object conversion keeps one
    recursion counter for all threads), hit when another thread formats a traceback (3.11's
    tracebacks parse source lines to place their carets) while this one parses: under
    pytest-xdist a background thread left by an earlier test in the same worker can log one.
    """
    for attempt in range(5):
        try:
            return ast.parse(source, filename=filename)
        except SystemError as e:
            if "recursion depth mismatch" not in str(e) or attempt == 4:
                raise
    raise AssertionError("unreachable")
