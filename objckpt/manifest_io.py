"""Reading a checkpoint's manifest from a store (the one I/O step before any plan)."""

from __future__ import annotations

from objckpt.errors import CheckpointNotFoundError, FormatError
from objckpt.format import MANIFEST_KEY, Manifest, parse_manifest
from objckpt.storage import Store


async def read_manifest(store: Store, *, size_limit: int) -> Manifest:
    """Fetch, size-check and validate ``manifest.json``.

    Raises:
        CheckpointNotFoundError: no manifest (a prefix holding only blobs included).
        FormatError: the manifest is malformed or too large.
    """
    try:
        info = await store.head(MANIFEST_KEY)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no committed checkpoint at {store.url} (no {MANIFEST_KEY})") from None

    if info.size > size_limit:
        raise FormatError(f"manifest at {store.url} is {info.size} bytes, over the limit of {size_limit}")
    try:
        data = await store.get_range(MANIFEST_KEY, start=0, end=info.size)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no committed checkpoint at {store.url} (no {MANIFEST_KEY})") from None
    return parse_manifest(data, size_limit=size_limit)
