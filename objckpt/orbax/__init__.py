"""Orbax checkpoints, read as they are: restore, inspect and convert them without Orbax.

:mod:`objckpt.orbax.layout` reads what an Orbax item holds from its metadata
files; :mod:`objckpt.orbax.tensorstore_io` opens its arrays with tensorstore
(``pip install 'objckpt[orbax]'``), which is what Orbax wrote them with;
:mod:`objckpt.orbax.restore` restores them onto any target.
:mod:`objckpt.orbax.reader` is Orbax's layout as :mod:`objckpt.layouts` opens it:
``objckpt.restore``, ``objckpt.inspect`` and ``objckpt.verify`` read an Orbax
checkpoint through it when a URL holds one rather than an objckpt one.
"""

from __future__ import annotations

from objckpt.orbax.layout import OrbaxItem, OrbaxLeaf

__all__ = ["OrbaxItem", "OrbaxLeaf"]
