"""Orbax's arrays through tensorstore: the kvstore of a URL, and one zarr array per leaf.

Orbax writes its arrays with tensorstore (zarr v2 or v3 arrays, usually in
an OCDBT database), so objckpt reads them with tensorstore too: each read
asks for one box of one array, and tensorstore fetches and decodes only the
chunks that box touches, concurrently.

Where the store is comes from the URL and the same ``storage_options`` objckpt
takes elsewhere:

* ``file://`` or a path: the ``file`` kvstore, once no link under the item
  leads out of it (:func:`~objckpt.orbax.containment.check_local_tree`);
* ``s3://``: the ``s3`` kvstore, with ``endpoint_url``/``client_kwargs`` for a
  custom endpoint and region. Keys given in the options are handed over in a
  private credentials file (tensorstore takes no keys in a spec) that lives
  only while the checkpoint is open; otherwise tensorstore's default AWS chain
  (environment, profile, container, instance metadata);
* ``gs://``: the ``gcs`` kvstore with Google's default credentials; an
  emulator is reached through ``TENSORSTORE_GCS_HTTP_URL``, which the user sets
  (objckpt changes no process environment), and an ``endpoint_url`` option that
  disagrees with it is an error rather than a read from the wrong place.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from objckpt.errors import FormatError, StoreError, StoreNotAvailableError
from objckpt.orbax.containment import check_local_tree

log = logging.getLogger("objckpt")

EXTRA = "orbax"
#: Chunks one tensorstore read may touch (a larger box is read in parts): ~1.4 KB of
#: tensorstore's bookkeeping per chunk, so ~23 MB per read whatever the chunks hold.
READ_CHUNKS = 1 << 14
#: Chunk grids up to this many chunks are read whatever their chunks' size; beyond it,
#: chunks must average :data:`MIN_CHUNK_BYTES` (tensorstore's per-chunk cost stays a
#: fraction of the bytes). Orbax writes a chunk per saved shard, so its grids pass.
GRID_FREE = 1 << 16
MIN_CHUNK_BYTES = 4 << 10
#: A cache for the OCDBT database's own nodes (its manifest and B-tree), shared by every leaf
#: read through one context; array chunks stay uncached (they are read once). Without it
#: each leaf's reads fetch the same nodes again (docs/PERFORMANCE.md).
OCDBT_CACHE = ("cache_pool#ocdbt", 32 << 20)
#: Reads of one OCDBT data file issued within 1 ms of each other, less than 1 MB apart, go
#: as one ranged GET of at most 64 MiB: an Orbax data file packs many chunks, and the
#: boxes a restore reads at once are often neighbours in it. (Orbax merges without a cap;
#: the cap keeps a merged read's buffer within the restore's window.)
COALESCING = {
    "experimental_read_coalescing_threshold_bytes": 1_000_000,
    "experimental_read_coalescing_merged_bytes": 64 << 20,
    "experimental_read_coalescing_interval": "1ms",
}


def import_tensorstore() -> Any:
    """tensorstore, or an error saying which extra brings it."""
    try:
        import tensorstore
    except ImportError as exc:
        raise StoreNotAvailableError(
            f"reading Orbax checkpoints needs tensorstore: pip install 'objckpt[{EXTRA}]'"
        ) from exc
    return tensorstore


@contextmanager
def kvstore_for(url: str, options: dict[str, Any] | None) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(kvstore spec, context spec) for the directory ``url``; credentials files it made are removed on exit."""
    options = dict(options or {})
    parsed = urllib.parse.urlsplit(url)
    scheme = parsed.scheme.lower()
    path = parsed.path.lstrip("/")
    if path and not path.endswith("/"):
        path += "/"
    cache = {OCDBT_CACHE[0]: {"total_bytes_limit": OCDBT_CACHE[1]}}
    if scheme in ("", "file"):
        local = url if scheme == "" else urllib.parse.unquote(parsed.path)
        check_local_tree(url)  # tensorstore follows links: none may lead out of the item
        yield {"driver": "file", "path": os.path.abspath(local).rstrip("/") + "/"}, cache
        return
    if scheme in ("gs", "gcs"):
        endpoint = options.get("endpoint_url")
        env = os.environ.get("TENSORSTORE_GCS_HTTP_URL")
        if endpoint and (env or "").rstrip("/") != str(endpoint).rstrip("/"):
            raise FormatError(
                f"reading the Orbax checkpoint {url} at the GCS endpoint {endpoint}: tensorstore reaches "
                f"a GCS endpoint only through TENSORSTORE_GCS_HTTP_URL (set it to {endpoint})"
            )
        context: dict[str, Any] = dict(cache)
        if options.get("token") == "anon" or endpoint:
            context["gcs_request_retries"] = {"max_retries": 5}
        yield {"driver": "gcs", "bucket": parsed.netloc, "path": path}, context
        return
    if scheme in ("s3", "s3a"):
        client = dict(options.get("client_kwargs") or {})
        spec: dict[str, Any] = {"driver": "s3", "bucket": parsed.netloc, "path": path}
        endpoint = options.get("endpoint_url") or client.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL_S3")
        endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            spec["endpoint"] = str(endpoint).rstrip("/")
        region = client.get("region_name") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region or endpoint:
            spec["aws_region"] = region or "us-east-1"
        key = options.get("key") or client.get("aws_access_key_id")
        secret = options.get("secret") or client.get("aws_secret_access_key")
        if options.get("anon"):
            yield spec, {**cache, "aws_credentials": {"type": "anonymous"}}
            return
        if key and secret:
            with _credentials_file(key, secret, options.get("token") or client.get("aws_session_token")) as files:
                credentials = {"type": "profile", "profile": "objckpt", **files}
                yield spec, {**cache, "aws_credentials": credentials}
            return
        yield spec, {**cache, "aws_credentials": {"type": "default"}}
        return
    raise FormatError(f"reading Orbax checkpoints from {scheme}:// URLs is not supported (file, s3, gs)")


@contextmanager
def _credentials_file(key: str, secret: str, token: str | None) -> Iterator[dict[str, str]]:
    """Shared credentials and (empty) config files only this user can read, in a private
    directory removed when the block ends: their paths as tensorstore's profile options."""
    directory = tempfile.mkdtemp(prefix="objckpt-ts-")  # mode 0700
    files = {
        "credentials_file": os.path.join(directory, "credentials"),
        "config_file": os.path.join(directory, "config"),
    }
    text = f"[objckpt]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n"
    if token:
        text += f"aws_session_token = {token}\n"
    try:
        for path, content in ((files["credentials_file"], text), (files["config_file"], "[profile objckpt]\n")):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(content)
        yield files
    finally:
        for path in files.values():
            if os.path.exists(path):
                os.remove(path)
        os.rmdir(directory)


def array_spec(kvstore: dict[str, Any], name: str, *, use_ocdbt: bool, use_zarr3: bool) -> dict[str, Any]:
    """The tensorstore spec of the parameter ``name`` of an item at ``kvstore``."""
    driver = "zarr3" if use_zarr3 else "zarr"
    # A checkpoint does not change while it is read: what one open validated (the OCDBT
    # manifest, an array's metadata) is not fetched again by the next.
    fixed = {"recheck_cached_data": False, "recheck_cached_metadata": False}
    if use_ocdbt:
        ocdbt = {"driver": "ocdbt", "base": kvstore, "cache_pool": OCDBT_CACHE[0], **COALESCING}
        return {"driver": driver, "kvstore": ocdbt, "path": name, **fixed}
    return {"driver": driver, "kvstore": {**kvstore, "path": kvstore["path"] + name + "/"}, **fixed}


def describe_kvstore(kvstore: dict[str, Any]) -> str:
    """Where tensorstore sends the requests of ``kvstore``, in words (for waits and timeouts)."""
    driver = kvstore.get("driver")
    if driver == "file":
        return f"local files under {kvstore.get('path')}"
    if driver == "s3":
        return f"S3 bucket {kvstore.get('bucket')} at {kvstore.get('endpoint') or 'the AWS endpoint of its region'}"
    if driver == "gcs":
        env = os.environ.get("TENSORSTORE_GCS_HTTP_URL")
        if env:
            return f"GCS bucket {kvstore.get('bucket')} at {env} (TENSORSTORE_GCS_HTTP_URL)"
        return (
            f"GCS bucket {kvstore.get('bucket')} at https://storage.googleapis.com"
            " (an emulator is reached only through TENSORSTORE_GCS_HTTP_URL)"
        )
    return str(driver)


class Waiter:
    """Waits on tensorstore futures under objckpt's request timeout.

    tensorstore retries on its own and has no deadline of ours, so a read whose
    requests go nowhere (a wrong endpoint, an address that never answers) would block
    for ever. A wait gives up, cancelling the future, once ``timeout`` seconds pass
    with neither it nor any of ``others()`` (the reads in flight beside it) completing:
    a :class:`~objckpt.errors.StoreError` saying what it waited for and where. At a
    quarter of that it logs a warning saying the same, so a command that waits says why.
    """

    def __init__(self, timeout: float, where: str, others: Callable[[], Iterable[Any]] = tuple) -> None:
        self.timeout = timeout
        self.where = where
        self.others = others

    def wait(self, future: Any, what: str) -> Any:
        """``future.result()``, within the timeout; ``what`` says what it is (``reading leaf …``)."""
        tick = max(0.01, min(1.0, self.timeout / 8))
        quiet_since = time.monotonic()
        done: int | None = None  # reads beside it completed, counted from the first tick (not per wait)
        warned = False
        while True:
            try:
                return future.result(timeout=tick)
            except TimeoutError:
                if future.done():  # tensorstore's own error, not our wait's
                    raise
            now, finished = time.monotonic(), self._done()
            if done is not None and finished > done:  # a read beside it completed: the store answers
                quiet_since = now
            done = finished
            quiet = now - quiet_since
            if quiet >= self.timeout:
                future.cancel()
                raise StoreError(
                    f"tensorstore gave no answer in {quiet:.0f} s (Options.request_timeout) while {what}:"
                    f" its requests go to {self.where}"
                )
            if not warned and quiet >= self.timeout / 4:
                warned = True
                log.warning(
                    "objckpt: still waiting for tensorstore after %.0f s: %s from %s (gives up at %.0f s)",
                    quiet,
                    what,
                    self.where,
                    self.timeout,
                )

    def _done(self) -> int:
        return sum(1 for future in self.others() if future.done())


def chunk_shape(array: Any) -> tuple[int, ...]:
    """The shape of the chunks tensorstore reads and decodes whole for ``array`` (its
    read chunk: a zarr chunk, or a zarr3 shard's inner chunk); the array's own shape
    along a dimension the layout leaves open."""
    shape = tuple(int(n) for n in array.shape)
    try:
        chunk = tuple(array.chunk_layout.read_chunk.shape)
    except Exception:  # no layout known: one chunk
        return tuple(max(1, n) for n in shape)
    if len(chunk) != len(shape):
        return tuple(max(1, n) for n in shape)
    return tuple(max(1, int(c)) if c else max(1, n) for c, n in zip(chunk, shape, strict=True))


def chunks_in(bounds: Sequence[tuple[int, int]], chunk: Sequence[int]) -> int:
    """How many chunks of the grid ``chunk`` the box ``bounds`` ((start, stop) per dimension) touches."""
    return math.prod(
        (stop - 1) // c - start // c + 1 if stop > start else 0 for (start, stop), c in zip(bounds, chunk, strict=True)
    )


def split_box(
    bounds: tuple[tuple[int, int], ...], chunk: tuple[int, ...], limit: int
) -> Iterator[tuple[tuple[int, int], ...]]:
    """The box cut along chunk boundaries into boxes touching at most ``limit`` chunks each
    (a box within one chunk stays whole), outer dimensions first, generated as needed."""
    if not bounds or chunks_in(bounds, chunk) <= limit:
        yield bounds
        return
    (start, stop), rest = bounds[0], bounds[1:]
    inner = chunks_in(rest, chunk[1:])
    step = max(1, limit // inner) * chunk[0] if inner <= limit else chunk[0]
    a = start
    while a < stop:
        b = min(stop, (a // chunk[0]) * chunk[0] + step)
        if inner <= limit:
            yield ((a, b), *rest)
        else:
            for sub in split_box(rest, chunk[1:], limit):
                yield ((a, b), *sub)
        a = b


def check_array(item: Any, leaf: Any, array: Any) -> tuple[int, ...]:
    """The chunk shape of an opened leaf, once its sizes are known to be readable.

    Sizes are counted in Python integers: a zarr header can declare any shape, and
    numpy's int64 products wrap. Refused with a :class:`~objckpt.errors.FormatError`
    naming the leaf: a leaf or chunk of 2^63 bytes or more (no array holds it), and a
    chunk grid out of proportion to the bytes: more than :data:`GRID_FREE` chunks
    averaging under :data:`MIN_CHUNK_BYTES` each (tensorstore spends ~1.4 KB and ~13 µs
    per chunk a read touches, whatever the chunk holds).
    """
    from objckpt.orbax.layout import numpy_dtype

    shape = tuple(int(n) for n in array.shape)
    itemsize = numpy_dtype(array.dtype).itemsize
    nbytes = math.prod(shape) * itemsize
    chunk = chunk_shape(array)
    where = f"Orbax checkpoint {item.url}: leaf {leaf.path} ({leaf.name}, shape {list(shape)})"
    if nbytes >= 1 << 63 or math.prod(chunk) * itemsize >= 1 << 63:
        raise FormatError(f"{where}: {nbytes} bytes, chunks of {list(chunk)}: more than any array can hold")
    chunks = math.prod(-(-n // c) for n, c in zip(shape, chunk, strict=True))
    if chunks > GRID_FREE and chunks * MIN_CHUNK_BYTES > nbytes:
        raise FormatError(
            f"{where}: {chunks} chunks of {list(chunk)} for {nbytes} bytes, under {MIN_CHUNK_BYTES} bytes"
            f" a chunk: out of proportion (objckpt reads grids of up to {GRID_FREE} chunks of any size)"
        )
    return chunk


def open_leaf(ts: Any, item: Any, leaf: Any, kvstore: dict[str, Any], context: Any, waiter: Waiter) -> Any:
    """The opened tensorstore array of ``leaf`` (an :class:`~objckpt.orbax.layout.OrbaxLeaf`) of
    ``item``, its sizes checked (:func:`check_array`); what tensorstore cannot open (a
    missing array, an unknown codec) is a :class:`~objckpt.errors.FormatError` naming
    the checkpoint and the leaf, and an open that gets no answer a StoreError (``waiter``)."""
    spec = array_spec(kvstore, leaf.name, use_ocdbt=item.use_ocdbt, use_zarr3=item.use_zarr3)
    future = ts.open(spec, open=True, read=True, context=context)
    try:
        array = waiter.wait(future, f"opening leaf {leaf.path} ({leaf.name}) of the Orbax checkpoint {item.url}")
    except StoreError:
        raise
    except Exception as exc:  # tensorstore raises ValueError for every failure
        raise FormatError(f"Orbax checkpoint {item.url}: cannot open leaf {leaf.path} ({leaf.name}): {exc}") from exc
    check_array(item, leaf, array)
    return array


class BoxRead:
    """One box of a tensorstore array read into a 64-byte-aligned host buffer of ours.

    tensorstore's own ``read()`` returns a 16-byte-aligned buffer that ``jax.device_put``
    must copy; a buffer aligned as XLA's CPU client wants is adopted as the device
    array (no second host copy on CPU, one host→device copy on accelerators), and its
    memory goes back when the array does instead of lingering in tensorstore's heap.

    A box touching more than :data:`READ_CHUNKS` chunks is read as several boxes cut
    along chunk boundaries (:func:`split_box`), into views of the one buffer, the next
    issued as the previous ones land: what one read asks of tensorstore stays bounded
    however many chunks the box spans. ``chunks`` is at most that bound.
    """

    ALIGN = 64

    def __init__(
        self,
        ts: Any,
        array: Any,
        box: tuple[slice, ...],
        dtype: Any,
        batch: Any = None,
        *,
        chunk: tuple[int, ...] | None = None,
    ) -> None:
        import numpy as np

        bounds = tuple((int(s.start), int(s.stop)) for s in box)
        shape = tuple(b - a for a, b in bounds)
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        raw = np.empty(nbytes + self.ALIGN, np.uint8)
        offset = (-raw.ctypes.data) % self.ALIGN
        self.buffer = raw[offset : offset + nbytes].view(dtype).reshape(shape)
        self.nbytes = nbytes
        self._ts, self._array, self._origin = ts, array, tuple(a for a, _ in bounds)
        self._chunk = chunk or tuple(max(1, n) for n in shape)
        self.chunks = min(chunks_in(bounds, self._chunk), READ_CHUNKS)
        self._parts = split_box(bounds, self._chunk, READ_CHUNKS)
        self._next: tuple[tuple[int, int], ...] | None = next(self._parts, None)
        self._futures: collections.deque[tuple[Any, int]] = collections.deque()  # (future, chunks)
        self._issue(batch)

    @property
    def futures(self) -> list[Any]:
        """The tensorstore reads of this box now in flight."""
        return [future for future, _ in self._futures]

    def _issue(self, batch: Any) -> None:
        in_flight = sum(n for _, n in self._futures)
        while self._next is not None:
            part = self._next
            n = chunks_in(part, self._chunk)
            if self._futures and in_flight + n > READ_CHUNKS:
                return
            index = tuple(slice(a - o, b - o) for (a, b), o in zip(part, self._origin, strict=True))
            view = self.buffer[index] if index else self.buffer  # a 0-d array indexed by () is a scalar
            source = self._array[tuple(slice(a, b) for a, b in part)]
            self._futures.append((self._ts.array(view, copy=False, write=True).write(source, batch=batch), n))
            in_flight += n
            self._next = next(self._parts, None)

    def result(self, item: Any, leaf: Any, waiter: Waiter) -> Any:
        """The box as a numpy array once read; a failed read is a StoreError naming the leaf
        and the checkpoint, and one that gets no answer within ``waiter``'s timeout too."""
        what = f"reading leaf {leaf.path} ({leaf.name}) of the Orbax checkpoint {item.url}"
        try:
            while self._futures:
                waiter.wait(self._futures[0][0], what)
                self._futures.popleft()
                self._issue(None)
        except StoreError:
            self.cancel()
            raise
        except Exception as exc:  # tensorstore: ValueError for a failed read or decode
            self.cancel()
            raise StoreError(f"{what} failed: {exc}") from exc
        return self.buffer

    def cancel(self) -> None:
        """Cancel the reads still in flight and issue no more."""
        for future, _ in self._futures:
            future.cancel()
        self._futures.clear()
        self._next = None
