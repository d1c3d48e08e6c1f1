"""The manifest: the one JSON document that makes a checkpoint exist.

``manifest.json`` is written last, with create-if-absent, so its presence is the
commit. :mod:`~objckpt.core.format.schema` holds what every version shares (the
records, the strict field rules), :mod:`~objckpt.core.format.v1` and
:mod:`~objckpt.core.format.v2` one version each (v2's root module reads version 3's
root too), :mod:`~objckpt.core.format.index` version 2's per-process index objects,
:mod:`~objckpt.core.format.index3` version 3's (a head, then frames read in part),
and :mod:`~objckpt.core.format.manifest` turns bytes into a :class:`Manifest` by the version they name (and back). See
``docs/FORMAT.md``. No I/O.

This package re-exports the names most callers need; its modules import each
other directly, never this package.
"""

from objckpt.core.format.manifest import manifest_from_doc, manifest_to_json, parse_manifest
from objckpt.core.format.schema import (
    ARRAY_KINDS,
    FORMAT_NAME,
    FORMAT_VERSION,
    INLINE_KINDS,
    ITEM_KINDS,
    MANIFEST_KEY,
    PRNG_IMPLS,
    READ_VERSIONS,
    BlobEntry,
    IndexRef,
    LeafEntry,
    Manifest,
    check_blob_key,
)
from objckpt.core.pieces import Piece

__all__ = [
    "ARRAY_KINDS",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INLINE_KINDS",
    "ITEM_KINDS",
    "MANIFEST_KEY",
    "PRNG_IMPLS",
    "READ_VERSIONS",
    "BlobEntry",
    "IndexRef",
    "LeafEntry",
    "Manifest",
    "Piece",
    "check_blob_key",
    "manifest_from_doc",
    "manifest_to_json",
    "parse_manifest",
]
