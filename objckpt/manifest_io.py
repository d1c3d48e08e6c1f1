"""Reading a checkpoint's manifest from a store (the one I/O step before any plan)."""

from __future__ import annotations

from objckpt.errors import CheckpointNotFoundError, FormatError
from objckpt.format import MANIFEST_KEY, Manifest, parse_manifest
from objckpt.storage import Store

# The first GET asks for this much. A shorter answer is the whole manifest, so
# a restore starts after one round trip instead of a HEAD and a GET (40 ms of
# every restore from another region). A longer manifest is sized with a HEAD,
# and refused if over the limit, before more than this is read.
FIRST_READ = 8 << 20


async def read_manifest(store: Store, *, size_limit: int) -> Manifest:
    """Fetch, size-check and validate ``manifest.json``.

    Raises:
        CheckpointNotFoundError: no manifest (a prefix holding only blobs included).
        FormatError: the manifest is malformed or too large.
    """
    first = min(FIRST_READ, size_limit + 1)
    try:
        data = await store.get_range(MANIFEST_KEY, start=0, end=first)
        if len(data) == first:  # maybe more: size it before reading the rest
            info = await store.head(MANIFEST_KEY)
            if info.size > size_limit:
                raise FormatError(f"manifest at {store.url} is {info.size} bytes, over the limit of {size_limit}")
            if info.size > first:
                data += await store.get_range(MANIFEST_KEY, start=first, end=info.size)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no committed checkpoint at {store.url} (no {MANIFEST_KEY})") from None
    return parse_manifest(data, size_limit=size_limit)
