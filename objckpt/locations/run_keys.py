"""The keys that make a local step its manager root's: one per manager run, kept in the root.

A manager with ``local=`` draws a random key for each run (named by the run's save id, the id
every local manifest of the run carries). Its primary writes the key to the root, at
``local_tier/<save_id>.key`` (create-if-absent), in the background, done before its first local
save (a restart does not wait for it); every process gets
it through the coordination service. Each local manifest is sealed under its run's key
(:func:`objckpt.core.format.local.seal`), and a reader fetches the key from the root by
the save id the manifest names (:class:`RunKeys`). So a local step or peer copy is read only
when the root it names still holds the key of the run that saved it: another job's step,
a step of a root wiped and reused, or a manifest edited or forged by someone who can write
the local disk but not read the root is not authentic, and is never read.

The keys are a few dozen bytes per run. ``gc`` and retention act on ``step_*/`` only, so they
stay while the root does; ``objckpt rm --recursive`` of the root removes them with it. A key
is never logged.
"""

from __future__ import annotations

import concurrent.futures
import logging
import secrets

from objckpt.errors import ObjectNotFoundError, StoreError
from objckpt.storage.base import Store
from objckpt.transfer import runtime

log = logging.getLogger("objckpt")

#: Where a root keeps its local-tier keys.
KEYS_DIR = "local_tier"
KEY_BYTES = 32


def key_name(save_id: str) -> str:
    """The key of the run ``save_id``'s object, relative to the root."""
    if not save_id.isalnum():
        raise ValueError(f"local tier: {save_id!r} is not a save id")
    return f"{KEYS_DIR}/{save_id}.key"


class RunKeys:
    """The run keys of one root: created once per run by the primary, fetched (once each) by save id."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._keys: dict[str, bytes | None] = {}
        self._writing: concurrent.futures.Future[None] | None = None

    def create(self, save_id: str) -> bytes:
        """A new key for the run ``save_id``; its write to the root (create-if-absent) runs in the
        background, so a restart never waits for it: :meth:`written` does, before a local save."""
        key = secrets.token_bytes(KEY_BYTES)
        self._writing = runtime.submit(self.store.put(key_name(save_id), key, mode="create"))
        self._keys[save_id] = key
        return key

    def written(self) -> None:
        """Wait for the write :meth:`create` started here, if any; raise its error (StoreError)."""
        if self._writing is not None:
            self._writing.result()

    def known(self, save_id: str, key: bytes) -> None:
        """The run ``save_id``'s key, as the primary sent it."""
        self._keys[save_id] = key

    def __call__(self, save_id: str) -> bytes | None:
        """The key of the run ``save_id`` (None: the root holds none, or it could not be read)."""
        if save_id in self._keys:
            return self._keys[save_id]
        if not save_id.isalnum():
            return None
        try:
            key: bytes | None = runtime.run_sync(self.store.get(key_name(save_id)))
        except (ObjectNotFoundError, FileNotFoundError):
            key = None
        except (StoreError, OSError) as e:  # not remembered: the next look may find it
            log.warning(
                "objckpt local tier: the key of run %s could not be read from %s: %s", save_id, self.store.url, e
            )
            return None
        if key is not None and len(key) != KEY_BYTES:
            log.warning(
                "objckpt local tier: the key of run %s in %s is not %d bytes", save_id, self.store.url, KEY_BYTES
            )
            key = None
        self._keys[save_id] = key
        return key
