"""The ``objckpt`` command line: ``ls | inspect | verify | cp | gc | rm``.

Installed as the ``objckpt`` console script (also ``python -m objckpt.cli``).
Usage and examples: ``docs/CLI.md``.
"""

from objckpt.cli._main import build_parser, main

__all__ = ["build_parser", "main"]
