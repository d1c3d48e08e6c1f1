"""The local tier: each process's own part of a step on its own host's disk or RAM disk.

Layout, under the manager's ``local=`` directory (a path or ``file://`` URL; ``/dev/shm`` works)::

    process_<p>/step_<N>/<save_id>.data      this process's boxes (objckpt.manager.local_format)
    process_<p>/step_<N>/manifest.json       written last: no manifest, no step
    process_<p>/peer/process_<q>/step_<N>/   the same, for process q's step, held as its peer copy

Each process reads and writes only ``process_<p>/`` under its own index: retention,
the clean-up of torn saves and the manager's ``gc`` never touch another process's
directory (on a pod each host has its own disk anyway; on one machine several
processes share the path).

A save has two phases, like :func:`objckpt.save_async`: :func:`snapshot` (the caller's
thread) copies every box this process's devices hold, each once, off the devices into
one buffer objckpt owns, so the caller may donate its arrays at once; :meth:`LocalTier.write`
(a background thread) writes the data file, syncs it, checksums each box (crc32c), and
renames the manifest into place. A step saved again (a restarted run reaching it)
replaces the old one atomically: the new manifest is renamed over the old, then the
old data file goes.

A step is this manager's only if its manifest names the manager's root and this process
(:meth:`LocalTier.steps`, :meth:`LocalTier.held`): a ``local=`` directory another job left
behind, or a peer copy that names another process, is not a step here (logged, never read).
Nothing in the tier is reached through a symbolic link that leads out of it: every directory
written, read or deleted and every file read is resolved first and refused
(:class:`~objckpt.errors.StorePermissionError`) when it lies outside ``local=``, and files are
opened without following a link in their last component.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import stat
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jax
import numpy as np

from objckpt.core.boxes import index_to_box
from objckpt.core.checksum import crc32c
from objckpt.core.dtypes import dtype_name
from objckpt.core.items import Json, PerProcess, encode_value, is_item, json_document, state_of
from objckpt.core.metadata import to_json_value
from objckpt.core.tree import flatten
from objckpt.errors import DeletedArrayError, FormatError, StorePermissionError
from objckpt.manager.local_format import (
    MANIFEST,
    LocalBox,
    LocalLeaf,
    LocalManifest,
    aligned,
    check_whole,
    parse_local_manifest,
)
from objckpt.roots.layout import STEP_DIR, step_dir
from objckpt.transfer.buffers import host_buffer

log = logging.getLogger("objckpt")

#: The largest local manifest read (a damaged file must not exhaust memory).
MANIFEST_LIMIT = 64 << 20


def local_path(url_or_path: str | os.PathLike[str]) -> Path:
    """The directory a ``local=`` argument names: a path, or a ``file://`` URL.

    Raises:
        ValueError: another scheme (the local tier is this host's own disk or RAM disk).
    """
    text = os.fspath(url_or_path)
    if text.startswith("file://"):
        text = text[len("file://") :]
    elif "://" in text:
        raise ValueError(f"local={text!r}: the local tier is a directory on this host (a path or file:// URL)")
    return Path(text).expanduser().absolute()


def inside(base: Path, path: Path) -> Path:
    """``path``, once it is known to resolve inside ``base`` (``local=``; itself may be a link).

    Raises:
        StorePermissionError: a symbolic link under ``base`` leads ``path`` out of it.
    """
    real_base, real = os.path.realpath(base), os.path.realpath(path)
    if real != real_base and not real.startswith(real_base.rstrip(os.sep) + os.sep):
        raise StorePermissionError(
            f"local tier: {path} resolves to {real}, outside {base} (a symbolic link leads out of it); refused"
        )
    return path


def read_regular(path: Path, limit: int) -> bytes:
    """At most ``limit`` + 1 bytes of the regular file ``path``, its last component never followed."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise FormatError(f"{path}: not a regular file")
        return f.read(limit + 1)


class ForeignStepError(FormatError):
    """A whole local step that is not this manager's: another root's, or another process's."""


def new_save_id() -> str:
    return uuid.uuid4().hex


@dataclass
class Snapshot:
    """A local save's blocking phase done: the manifest without checksums, and the bytes."""

    manifest: LocalManifest
    buffer: np.ndarray
    seconds: float = 0.0


class _Layout:
    """Places boxes in the data file and remembers what to copy into each."""

    def __init__(self) -> None:
        self.size = 0
        self.copies: list[tuple[int, int, Any]] = []  # (offset, length, source array)

    def box(self, start: tuple[int, ...], source: Any, dtype: np.dtype) -> LocalBox:
        shape = tuple(int(n) for n in source.shape)
        length = math.prod(shape) * dtype.itemsize
        offset = aligned(self.size)
        self.size = offset + length
        self.copies.append((offset, length, source))
        return LocalBox(start, shape, offset, length)


def _host_leaf(path: str, kind: str, data: np.ndarray, layout: _Layout, value: Any = None) -> LocalLeaf:
    box = layout.box((0,) * data.ndim, data, data.dtype) if data.size else None
    return LocalLeaf(path, kind, dtype_name(data.dtype), tuple(data.shape), value, (box,) if box else ())


def _array_leaf(path: str, array: jax.Array, layout: _Layout) -> LocalLeaf:
    """Every box this process's devices hold, each once (replicas on several local devices too)."""
    prng = None
    if jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key):
        prng = str(jax.random.key_impl(array))
        array = jax.random.key_data(array)
    dtype = np.dtype(array.dtype)
    seen: set[tuple[int, ...]] = set()
    boxes = []
    for shard in array.addressable_shards:
        start = tuple(int(n) for n in index_to_box(shard.index, tuple(array.shape))[0])
        if start in seen:
            continue
        seen.add(start)
        shard.data.copy_to_host_async()
        boxes.append(layout.box(start, shard.data, dtype))
    sharding = None if prng else sharding_record(array.sharding)
    return LocalLeaf(path, "array", dtype_name(dtype), tuple(array.shape), None, tuple(boxes), prng, sharding)


def sharding_record(sharding: Any) -> dict[str, Any] | None:
    """A ``NamedSharding`` as the local manifest records it (None: another kind of sharding, or a
    spec this record cannot hold); :func:`objckpt.manager.local_restore.saved_sharding` reads it."""
    if not isinstance(sharding, jax.sharding.NamedSharding) or not isinstance(sharding.mesh, jax.sharding.Mesh):
        return None
    spec: list[Any] = []
    for entry in sharding.spec:
        if entry is None or isinstance(entry, str):
            spec.append(entry)
        elif isinstance(entry, tuple) and all(isinstance(n, str) for n in entry):
            spec.append(list(entry))
        else:  # an unconstrained or otherwise special entry
            return None
    mesh = sharding.mesh
    return {
        "mesh": [int(n) for n in mesh.devices.shape],
        "axes": [str(a) for a in mesh.axis_names],
        "types": [t.name for t in mesh.axis_types],
        "devices": [int(d.id) for d in mesh.devices.flat],
        "spec": spec,
    }


def _leaf(path: str, value: Any, layout: _Layout) -> LocalLeaf:
    if value is None:
        return LocalLeaf(path, "none")
    if is_item(value):
        if type(value) is PerProcess:
            data, encoding = encode_value(value.value, path)
            return _host_leaf(path, "per_process", np.frombuffer(data, np.uint8), layout, {"encoding": encoding})
        if type(value) is Json:
            return LocalLeaf(path, "json", value=json_document(state_of(value.value, path), path)[0])
        state = state_of(value, path)
        if isinstance(state, (bytes, bytearray, memoryview)):
            return _host_leaf(path, "bytes", np.frombuffer(bytes(state), np.uint8), layout)
        return LocalLeaf(path, "json", value=json_document(state, path)[0])
    if isinstance(value, bool):
        return LocalLeaf(path, "bool", value=value)
    if isinstance(value, int):
        return LocalLeaf(path, "int", value=value)
    if isinstance(value, float):
        return LocalLeaf(path, "float", value=to_json_value(value, path))
    if isinstance(value, jax.Array):
        if value.is_deleted():
            raise DeletedArrayError(f"leaf {path}: the jax.Array was donated or deleted, so it cannot be saved")
        return _array_leaf(path, value, layout)
    if isinstance(value, str):
        return _host_leaf(path, "str", np.frombuffer(value.encode(), np.uint8), layout)
    if isinstance(value, bytes):
        return _host_leaf(path, "bytes", np.frombuffer(value, np.uint8), layout)
    if isinstance(value, (np.ndarray, np.generic)):
        return _host_leaf(path, "ndarray", np.asarray(value), layout)
    raise TypeError(f"leaf {path}: cannot checkpoint a {type(value).__module__}.{type(value).__qualname__}")


def snapshot(
    tree: Any,
    *,
    root: str,
    step: int,
    save_id: str,
    process_index: int,
    process_count: int,
    metadata: dict[str, Any],
) -> Snapshot:
    """The blocking phase of a local save: this process's boxes copied into one owned buffer.

    ``root``: the manager root the step belongs to (recorded, and checked on every read).
    """
    leaves, skeleton = flatten(tree)
    layout = _Layout()
    records = tuple(_leaf(leaf.path, leaf.value, layout) for leaf in leaves)
    buffer = host_buffer(layout.size)
    for offset, length, source in layout.copies:
        if length:
            host = np.asarray(source)
            np.copyto(buffer[offset : offset + length].view(host.dtype).reshape(host.shape), host)
    manifest = LocalManifest(
        root=root,
        step=step,
        save_id=save_id,
        process_index=process_index,
        process_count=process_count,
        data=f"{save_id}.data",
        data_size=layout.size,
        tree=skeleton,
        leaves=records,
        metadata=metadata,
    )
    return Snapshot(manifest, buffer)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_step(directory: Path, manifest: LocalManifest, data: Any, *, checksum: bool = True) -> LocalManifest:
    """Write a step's data file, then its manifest (renamed into place); return the manifest written.

    ``checksum``: compute each box's crc32c from ``data`` (a received peer copy already has them).
    """
    directory.mkdir(parents=True, exist_ok=True)
    view = memoryview(data).cast("B")
    if checksum:
        leaves = tuple(
            replace(
                leaf, boxes=tuple(replace(b, crc32c=crc32c(view[b.offset : b.offset + b.length])) for b in leaf.boxes)
            )
            for leaf in manifest.leaves
        )
        manifest = replace(manifest, leaves=leaves)
    with open(directory / manifest.data, "wb") as f:
        f.write(view[: manifest.data_size])
        f.flush()
        os.fsync(f.fileno())
    commit_manifest(directory, manifest)
    return manifest


def commit_manifest(directory: Path, manifest: LocalManifest) -> None:
    """Rename ``manifest`` into place (its data file is written and synced), then drop older data files."""
    tmp = directory / f".{MANIFEST}.{manifest.save_id}.tmp"
    with open(tmp, "wb") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)
    _fsync_dir(directory)
    for other in directory.iterdir():
        if other.name not in (MANIFEST, manifest.data):
            _remove(other)


def _remove(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()
    except FileNotFoundError:
        pass


def read_manifest(
    directory: Path, *, root: str | None = None, process_index: int | None = None, within: Path | None = None
) -> LocalManifest:
    """The manifest of the step in ``directory``, checked against its data file.

    ``root`` and ``process_index``, when given, must be the ones the manifest names (the
    manager's root; the process whose step it is); ``within``: the tier's directory, which
    ``directory`` must resolve inside.

    Raises:
        FileNotFoundError: no manifest (a torn or absent step).
        FormatError: a damaged manifest, a data file missing or of another size.
        ForeignStepError: another root's or another process's step.
        StorePermissionError: ``directory`` leads out of ``within`` through a link.
    """
    if within is not None:
        inside(within, directory)
    path = directory / MANIFEST
    raw = read_regular(path, MANIFEST_LIMIT)
    if len(raw) > MANIFEST_LIMIT:
        raise FormatError(f"{path}: over {MANIFEST_LIMIT} bytes")
    manifest = parse_local_manifest(raw)
    if root is not None and manifest.root != root:
        raise ForeignStepError(f"{path}: a step of the root {manifest.root}, not of {root}")
    if process_index is not None and manifest.process_index != process_index:
        raise ForeignStepError(f"{path}: process {manifest.process_index}'s step, not process {process_index}'s")
    check_whole(manifest)
    try:
        size = os.stat(directory / manifest.data, follow_symlinks=False).st_size
    except FileNotFoundError:
        raise FormatError(f"{path}: its data file {manifest.data} is missing") from None
    if size != manifest.data_size:
        raise FormatError(f"{path}: its data file is {size} bytes, not {manifest.data_size}")
    if STEP_DIR.match(directory.name) and int(STEP_DIR.match(directory.name).group(1)) != manifest.step:  # type: ignore[union-attr]
        raise FormatError(f"{path}: names step {manifest.step}, not the directory's")
    return manifest


def step_dirs(base: Path) -> dict[int, Path]:
    """The step directories under ``base``, complete or not, by step."""
    try:
        entries = list(base.iterdir())
    except FileNotFoundError:
        return {}
    out = {}
    for entry in entries:
        match = STEP_DIR.match(entry.name)
        if match and entry.is_dir() and not entry.is_symlink():  # a linked step is never a step here
            out[int(match.group(1))] = entry
    return out


def complete_steps(
    base: Path, *, root: str | None = None, process_index: int | None = None, within: Path | None = None
) -> dict[int, LocalManifest]:
    """The complete steps under ``base`` (a manifest that parses, its data file whole, and
    ``root``'s and ``process_index``'s when given: :func:`read_manifest`), by step."""
    out = {}
    for step, directory in step_dirs(base).items():
        try:
            out[step] = read_manifest(directory, root=root, process_index=process_index, within=within)
        except FileNotFoundError:
            continue
        except (FormatError, OSError) as e:
            log.warning("objckpt local tier: %s is not a usable step, not read: %s", directory, e)
    return out


def retain(
    base: Path, keep_last: int, *, keep: frozenset[int] = frozenset(), within: Path | None = None, **whose: Any
) -> list[int]:
    """Delete all but the newest ``keep_last`` complete steps under ``base``, and every torn or
    damaged step except those in ``keep``; manifest first, so a step stops existing at once.
    A step of another root or process (``whose``: :func:`complete_steps`) is left alone: it
    is not this manager's to delete. Returns the steps deleted. ``within``: the tier's
    directory; a step directory that resolves outside it is never deleted."""
    complete = sorted(complete_steps(base, within=within, **whose))
    doomed = set(complete[: max(0, len(complete) - keep_last)])
    for step, directory in step_dirs(base).items():
        if step not in complete and step not in keep and not _foreign(directory, within, whose):
            doomed.add(step)
    for step in sorted(doomed):
        directory = base / step_dir(step)
        if within is not None:
            inside(within, directory)
        _remove(directory / MANIFEST)
        _remove(directory)
    return sorted(doomed)


def _foreign(directory: Path, within: Path | None, whose: dict[str, Any]) -> bool:
    try:
        read_manifest(directory, within=within, **whose)
    except ForeignStepError:
        return True
    except (FormatError, OSError):
        return False
    return False


class LocalTier:
    """This process's directory in the local tier: its own steps and the peer copies it holds."""

    def __init__(self, root: Path, process_index: int, process_count: int, keep_last: int, *, url: str) -> None:
        """``root``: the ``local=`` directory; ``url``: the manager root whose steps it holds."""
        if keep_last < 1:
            raise ValueError(f"local_keep_last must be at least 1, got {keep_last}")
        self.root = root
        self.url = url
        self.process_index = process_index
        self.process_count = process_count
        self.keep_last = keep_last
        self.own = root / f"process_{process_index}"

    def step_dir(self, step: int) -> Path:
        return self.own / step_dir(step)

    def held_dir(self, owner: int) -> Path:
        """Where this process keeps process ``owner``'s steps (its peer copy)."""
        return self.own / "peer" / f"process_{owner}"

    def inside(self, path: Path) -> Path:
        """``path``, refused (StorePermissionError) if a link leads it out of ``local=``."""
        return inside(self.root, path)

    def read(self, directory: Path, owner: int | None = None) -> LocalManifest:
        """The manifest of the step in ``directory``, this manager's and ``owner``'s (default: this process's)."""
        owner = self.process_index if owner is None else owner
        return read_manifest(directory, root=self.url, process_index=owner, within=self.root)

    def steps(self) -> dict[int, LocalManifest]:
        return complete_steps(self.own, root=self.url, process_index=self.process_index, within=self.root)

    def held(self) -> dict[int, dict[int, LocalManifest]]:
        """The peer copies this process holds: ``{owner: {step: manifest}}``."""
        out = {}
        try:
            entries = list((self.own / "peer").iterdir())
        except FileNotFoundError:
            return {}
        for entry in entries:
            if entry.name.startswith("process_") and entry.name[8:].isdigit():
                owner = int(entry.name[8:])
                steps = complete_steps(entry, root=self.url, process_index=owner, within=self.root)
                if steps:
                    out[owner] = steps
        return out

    def write(self, snap: Snapshot) -> LocalManifest:
        """The background phase of a local save, then retention of this process's own steps."""
        manifest = write_step(self.inside(self.step_dir(snap.manifest.step)), snap.manifest, snap.buffer)
        self.retain()
        return manifest

    def retain(self) -> list[int]:
        """Keep the newest ``keep_last`` steps here and of each peer copy held; drop torn ones."""
        url, within = self.url, self.root
        deleted = retain(
            self.inside(self.own), self.keep_last, within=within, root=url, process_index=self.process_index
        )
        for owner in self.held():
            retain(self.inside(self.held_dir(owner)), self.keep_last, within=within, root=url, process_index=owner)
        return deleted

    def nbytes(self) -> int:
        total = 0
        for dirpath, _, files in os.walk(self.own):
            for name in files:
                try:
                    total += os.stat(os.path.join(dirpath, name)).st_size
                except FileNotFoundError:
                    pass
        return total
