"""Orbax's layout, as :func:`objckpt.layouts.registry.open_checkpoint` opens it.

The layouts registry names :func:`open_orbax` by its dotted path
(``objckpt.orbax.reader:open_orbax``) and calls it on a prefix that holds no
objckpt manifest; the engine (restore, inspect, verify) never imports this
package. What it finds there (:func:`~objckpt.orbax.composite.orbax_checkpoint_at`): an
Orbax item directory, or a ``CheckpointManager`` step holding one item (besides
its metrics) or a ``default`` one. An :class:`OrbaxReader` of that item then
describes, verifies and restores it with this package's tensorstore readers
(:mod:`objckpt.orbax.inspect`, :mod:`objckpt.orbax.verify`,
:mod:`objckpt.orbax.restore`). A step of several items (a Composite) is read
item by item (:mod:`objckpt.orbax.composite`,
:class:`~objckpt.orbax.composite_reader.OrbaxCompositeReader`).
"""

from __future__ import annotations

from typing import Any

from objckpt.layouts.base import CheckpointInfo, OpenRequest, VerifyReport
from objckpt.options import Options
from objckpt.orbax.composite import OrbaxComposite, orbax_checkpoint_at
from objckpt.orbax.composite_reader import FORMAT, OrbaxCompositeReader
from objckpt.orbax.layout import OrbaxItem
from objckpt.progress import ProgressArg
from objckpt.storage import Store, from_url
from objckpt.transfer.retries import close_store
from objckpt.transfer.stats import TransferStats


class OrbaxReader:
    """One Orbax item, opened: what ``inspect``, ``verify`` and ``restore`` do with it.

    Orbax's arrays are zarr arrays that tensorstore reads through its own
    connections, so the reader keeps the caller's storage options for them.
    """

    format = FORMAT
    version = 0  # Orbax's files carry no format version objckpt reads

    def __init__(self, item: OrbaxItem, storage_options: dict[str, Any] | None, options: Options) -> None:
        self.item = item
        self.storage_options = storage_options
        self.options = options

    @property
    def url(self) -> str:
        """The item's URL (a step's item: ``<step>/<item>``)."""
        return self.item.url

    def info(self) -> CheckpointInfo:
        """Leaves, dtypes, shapes and saved shardings, from the metadata and the zarr headers."""
        from objckpt.orbax.inspect import inspect_orbax  # tensorstore and JAX load when arrays are read

        return inspect_orbax(self.item, self.storage_options, self.options)

    def verify(self, options: Options, stats: TransferStats, progress: ProgressArg) -> VerifyReport:
        """Every chunk of every array read and decoded (Orbax stores no checksums to compare)."""
        from objckpt.orbax.verify import verify_orbax

        return verify_orbax(self.item, self.storage_options, options, stats, progress)

    def restore(self, target: Any, *, partial: bool, options: Options, stats: TransferStats, cast: str) -> Any:
        """The item's tree, or the ``target``'s part of it (arguments as :func:`objckpt.restore`'s)."""
        from objckpt.orbax.restore import restore_orbax

        return restore_orbax(
            self.item,
            target,
            storage_options=self.storage_options,
            partial=partial,
            options=options,
            stats=stats,
            cast=cast,
        )


def open_orbax(store: Store, request: OpenRequest) -> OrbaxReader | OrbaxCompositeReader | None:
    """The reader of the Orbax item or Composite step at ``store``, or None when nothing Orbax wrote is there.

    With ``request.look_above`` the prefix one level up is read too, so that an item
    directory written by a handler other than a pytree one (a step's JSON item) is a
    :class:`~objckpt.errors.FormatError` naming it rather than "not found".

    Raises:
        FormatError: Orbax metadata is there and cannot be read, or names an item objckpt does not read.
    """
    parent = _parent_store(request.url, request.storage_options) if request.look_above else None
    try:
        item = orbax_checkpoint_at(store, parent)
    finally:
        if parent is not None:
            close_store(parent)
    if isinstance(item, OrbaxComposite):
        return OrbaxCompositeReader(item, request.storage_options, request.options)
    return None if item is None else OrbaxReader(item, request.storage_options, request.options)


def _parent_store(url: str, storage_options: dict[str, Any] | None) -> Store | None:
    """The store one level above ``url`` (for Orbax's step metadata), or None at a bucket's root."""
    head, sep, tail = url.rstrip("/").rpartition("/")
    if not sep or not tail or head.endswith(":/") or head.endswith(":"):
        return None
    try:
        return from_url(head, **(storage_options or {}))
    except (ValueError, OSError):
        return None
