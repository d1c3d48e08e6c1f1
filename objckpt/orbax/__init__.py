"""Orbax checkpoints, read as they are: restore, inspect and convert them without Orbax.

:mod:`objckpt.orbax.layout` reads what an Orbax item holds from its metadata
files; :mod:`objckpt.orbax.tensorstore_io` opens its arrays with tensorstore
(``pip install 'objckpt[orbax]'``), which is what Orbax wrote them with;
:mod:`objckpt.orbax.restore` restores them onto any target.
``objckpt.restore`` and ``objckpt.inspect`` come here on their own when a URL
holds an Orbax checkpoint rather than an objckpt one.
"""

from __future__ import annotations

from typing import Any

from objckpt.errors import CheckpointNotFoundError
from objckpt.orbax.layout import OrbaxItem, OrbaxLeaf, describe_sharding
from objckpt.transfer import runtime

__all__ = ["OrbaxItem", "OrbaxLeaf", "describe_sharding", "orbax_item_at"]


def orbax_item_at(store: Any, parent: Any = None) -> OrbaxItem | None:
    """The Orbax item at ``store`` (an objckpt store, or one wrapping it as ``.inner``),
    or None when nothing Orbax wrote is there; ``parent``, the store one level up,
    lets an item that is no pytree be named as such (see :func:`~objckpt.orbax.layout.read_item`)."""
    from objckpt.orbax.layout import read_item

    inner = getattr(store, "inner", store)
    try:
        return runtime.run_sync(read_item(inner, inner.url, parent))
    except CheckpointNotFoundError:
        return None
