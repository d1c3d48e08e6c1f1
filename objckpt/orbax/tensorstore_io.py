"""Orbax's arrays through tensorstore: the kvstore of a URL, and one zarr array per leaf.

Orbax writes its arrays with tensorstore (zarr v2 or v3 arrays, usually in
an OCDBT database), so objckpt reads them with tensorstore too: each read
asks for one box of one array, and tensorstore fetches and decodes only the
chunks that box touches, concurrently.

Where the store is comes from the URL and the same ``storage_options`` objckpt
takes elsewhere:

* ``file://`` or a path: the ``file`` kvstore;
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

import os
import tempfile
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from objckpt.errors import FormatError, StoreError, StoreNotAvailableError

EXTRA = "orbax"
#: A cache for the OCDBT database's own nodes (its manifest and B-tree), shared by every leaf
#: read through one context; array chunks stay uncached (they are read once). Without it
#: each leaf's reads fetch the same nodes again: a restore of 40 leaves from the GCS
#: emulator at 10 ms made 410 requests in 1.8 s, with it 370 in 1.4 s.
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


def open_leaf(ts: Any, item: Any, leaf: Any, kvstore: dict[str, Any], context: Any) -> Any:
    """The opened tensorstore array of ``leaf`` (an :class:`~objckpt.orbax.layout.OrbaxLeaf`) of
    ``item``; what tensorstore cannot open (a missing array, an unknown codec) is a
    :class:`~objckpt.errors.FormatError` naming the checkpoint and the leaf."""
    spec = array_spec(kvstore, leaf.name, use_ocdbt=item.use_ocdbt, use_zarr3=item.use_zarr3)
    try:
        return ts.open(spec, open=True, read=True, context=context).result()
    except Exception as exc:  # tensorstore raises ValueError for every failure
        raise FormatError(f"Orbax checkpoint {item.url}: cannot open leaf {leaf.path} ({leaf.name}): {exc}") from exc


class BoxRead:
    """One box of a tensorstore array read into a 64-byte-aligned host buffer of ours.

    tensorstore's own ``read()`` returns a 16-byte-aligned buffer that ``jax.device_put``
    must copy; a buffer aligned as XLA's CPU client wants is adopted as the device
    array (no second host copy on CPU, one host→device copy on accelerators), and its
    memory goes back when the array does instead of lingering in tensorstore's heap.
    """

    ALIGN = 64

    def __init__(self, ts: Any, array: Any, box: tuple[slice, ...], dtype: Any, batch: Any = None) -> None:
        import numpy as np

        shape = tuple(s.stop - s.start for s in box)
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        raw = np.empty(nbytes + self.ALIGN, np.uint8)
        offset = (-raw.ctypes.data) % self.ALIGN
        self.buffer = raw[offset : offset + nbytes].view(dtype).reshape(shape)
        self.nbytes = nbytes
        self.future = ts.array(self.buffer, copy=False, write=True).write(array[box], batch=batch)

    def result(self, item: Any, leaf: Any) -> Any:
        """The box as a numpy array once read; a failed read is a StoreError (as :func:`read_result`)."""
        read_result(self.future, item, leaf, value=False)
        return self.buffer


def read_result(future: Any, item: Any, leaf: Any, *, value: bool = True) -> Any:
    """The numpy array a tensorstore read of ``leaf`` of ``item`` gives; a read or decode that
    fails (a damaged chunk, a store error) is a :class:`~objckpt.errors.StoreError` naming both."""
    import numpy as np

    try:
        result = future.result()
        return np.asarray(result) if value else None
    except Exception as exc:  # tensorstore: ValueError for a failed read or decode
        raise StoreError(
            f"reading leaf {leaf.path} ({leaf.name}) of the Orbax checkpoint {item.url} failed: {exc}"
        ) from exc
