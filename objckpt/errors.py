"""The errors objckpt raises.

Each error inherits both :class:`ObjckptError` (so callers can catch everything
of ours at once) and the built-in exception a Python user would already expect
(``FileNotFoundError`` for a missing checkpoint, ``ValueError`` for bad input),
the way zarr's ``NodeNotFoundError`` does.
"""

from __future__ import annotations


class ObjckptError(Exception):
    """Base class of every error objckpt raises on purpose."""


class CheckpointNotFoundError(ObjckptError, FileNotFoundError):
    """No committed checkpoint at the URL (blobs without a manifest count as none)."""


class CheckpointExistsError(ObjckptError, FileExistsError):
    """A committed checkpoint already exists at the URL; it was left intact."""


class SaveInProgressError(ObjckptError, RuntimeError):
    """A delete (``rm``, ``CheckpointManager.delete``) found a live save's marker under the
    checkpoint prefix and left the save's objects alone (:mod:`objckpt.saving.live_markers`)."""


class IntegrityError(ObjckptError):
    """Bytes read back do not match what was saved (checksum mismatch, short read)."""


class ChecksumMismatchError(IntegrityError):
    """A piece's bytes do not match its crc32c on every read of it (a mismatch that a
    re-read cures was a bit flipped in flight, and is retried, not raised)."""


class HostMemoryError(ObjckptError, MemoryError):
    """A restore would need more host memory than the machine has; refused before any read."""


class FormatError(ObjckptError, ValueError):
    """The manifest is malformed, hostile, or of an unsupported version."""


class PartialCopyError(ObjckptError, LookupError):
    """A copy of part of a checkpoint (a local-tier step, a peer copy: one process's boxes) does
    not hold what the restore asks of it; the caller reads the next location."""


class TargetMismatchError(ObjckptError, ValueError):
    """The restore target does not match the checkpoint (leaves, shapes, shardings)."""


class DeletedArrayError(ObjckptError, ValueError):
    """A leaf to save is a ``jax.Array`` that was donated (to a jitted step) or deleted."""


class StoreError(ObjckptError, OSError):
    """A storage operation failed for good (after retries, or not retryable)."""


class TransientStoreError(StoreError):
    """A storage operation failed in a way worth retrying (429/5xx, reset, timeout)."""


class ThrottledError(TransientStoreError):
    """The store asked the client to slow down (HTTP 429, 503 SlowDown): retried, and the
    transfer engine lowers how many requests it keeps in flight (:mod:`objckpt.transfer.throttle`)."""


class StoreNotAvailableError(ObjckptError, ImportError):
    """No store is registered for a URL scheme, or its package is not installed."""


class CoordinationError(ObjckptError, TimeoutError):
    """Multi-host coordination failed: a barrier timed out or a peer reported failure."""


class PeerCopyUnavailableError(ObjckptError, RuntimeError):
    """A peer copy cannot run in this job: one process only, or JAX's transfer server
    (``jax.experimental.transfer``) does not start on this process's devices."""


class ObjectNotFoundError(StoreError, FileNotFoundError):
    """One object (blob, manifest) is missing from the store."""


class ObjectExistsError(StoreError, FileExistsError):
    """A create-if-absent put found the object already there."""


class StorePermissionError(StoreError, PermissionError):
    """The store refused the request (HTTP 401/403, missing credentials); not worth retrying."""


class BucketNotFoundError(StoreError, FileNotFoundError):
    """The bucket (or container) of a URL does not exist (S3 ``NoSuchBucket``, a GCS 404 on
    the bucket): a setting to fix, not worth retrying, and never read as "no checkpoint
    there yet" (it is no :class:`ObjectNotFoundError`)."""


class StorageOptionError(ObjckptError, ValueError):
    """A storage option the URL's store does not take (misspelt, or another filesystem's):
    refused when the store opens, naming the option, before a client library sees it."""


class EndpointRefusedError(StoreError, ConnectionRefusedError):
    """The endpoint a store was configured with (``endpoint_url``, ``AWS_ENDPOINT_URL``,
    ``STORAGE_EMULATOR_HOST``...) refuses TCP connections before it ever answered: a setting
    to fix (no server listens at that host and port), not retried; the message names the
    endpoint and the setting it came from."""


class ChecksumsUnavailableError(ObjckptError, ValueError):
    """``verify(read_data=False)`` has nothing to compare: the store keeps no checksum of its
    own (``file://``, ``memory://``, a plugin), or the checkpoint records none (another
    layout's). The message names the store; ``read_data=True`` (the default) reads every byte."""
