"""The local tier: each process's own part of a step on its own host's disk or RAM disk.

Layout, under the manager's ``local=`` directory (a path or ``file://`` URL; ``/dev/shm`` works)::

    process_<p>/step_<N>/<save_id>.data      this process's boxes (objckpt.core.format.local)
    process_<p>/step_<N>/manifest.json       written last: no manifest, no step
    process_<p>/peer/process_<q>/step_<N>/   the same, for process q's step, held as its peer copy

Each process reads and writes only ``process_<p>/`` under its own index: retention,
the clean-up of torn saves and the manager's ``gc`` never touch another process's
directory (on a pod each host has its own disk anyway; on one machine several
processes share the path).

A save has two phases, like :func:`objckpt.save_async`:
:func:`~objckpt.saving.local_snapshot.snapshot` (the caller's thread) copies every box this process's devices hold, each once, off the devices into
one buffer objckpt owns, so the caller may donate its arrays at once; :meth:`LocalTier.write`
(a background thread) writes the data file, syncs it, checksums each box (crc32c), and
renames the manifest into place. A step saved again (a restarted run reaching it)
replaces the old one atomically: the new manifest is renamed over the old, then the
old data file goes.

A step is this manager's only if its manifest names the manager's root and this process and
is sealed under the key its run left in that root (:meth:`LocalTier.steps`,
:meth:`LocalTier.held`, :mod:`objckpt.locations.run_keys`): a ``local=`` directory another
job left behind, a peer copy that names another process, or an edited manifest is not a
step here (logged, never read).

Nothing in the tier is reached through a symbolic link that leads out of it: every directory
written, read or deleted and every file read is resolved first and refused
(:class:`~objckpt.errors.StorePermissionError`) when it lies outside ``local=``, and files are
opened without following a link in their last component.
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import stat
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from objckpt.core.checksum import crc32c
from objckpt.core.format.local import (
    MANIFEST,
    LocalManifest,
    authentic,
    check_whole,
    parse_local_manifest,
)
from objckpt.errors import FormatError, StorePermissionError
from objckpt.roots.step_names import STEP_DIR, step_dir
from objckpt.saving.local_snapshot import Snapshot

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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_step(
    directory: Path, manifest: LocalManifest, data: Any, *, key: bytes, checksum: bool = True
) -> LocalManifest:
    """Write a step's data file, then its manifest (sealed under ``key``, its run's key; renamed into
    place); return the manifest written.

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
    commit_manifest(directory, manifest, key)
    return manifest


def commit_manifest(directory: Path, manifest: LocalManifest, key: bytes) -> None:
    """Rename ``manifest`` (sealed under ``key``) into place (its data file is written and synced), then
    drop older data files."""
    tmp = directory / f".{MANIFEST}.{manifest.save_id}.tmp"
    with open(tmp, "wb") as f:
        f.write(manifest.to_json(key))
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


KeyOf = Callable[[str], "bytes | None"]


def read_manifest(
    directory: Path,
    *,
    root: str | None = None,
    process_index: int | None = None,
    within: Path | None = None,
    key_of: KeyOf | None = None,
) -> LocalManifest:
    """The manifest of the step in ``directory``, checked against its data file.

    ``root`` and ``process_index``, when given, must be the ones the manifest names (the
    manager's root; the process whose step it is); ``within``: the tier's directory, which
    ``directory`` must resolve inside; ``key_of``: the key of a run by its save id (from the
    root), under which the manifest must be sealed.

    Raises:
        FileNotFoundError: no manifest (a torn or absent step).
        FormatError: a damaged manifest, a data file missing or of another size.
        ForeignStepError: another root's or another process's step, or a run whose key the root
            does not hold.
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
    if key_of is not None:
        key = key_of(manifest.save_id)
        if key is None:
            raise ForeignStepError(f"{path}: {root or manifest.root} holds no key of its run {manifest.save_id}")
        if not authentic(raw, key):
            raise FormatError(f"{path}: not sealed under its run's key (an edited or forged manifest)")
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
    base: Path,
    *,
    root: str | None = None,
    process_index: int | None = None,
    within: Path | None = None,
    key_of: KeyOf | None = None,
) -> dict[int, LocalManifest]:
    """The complete steps under ``base`` (a manifest that parses, its data file whole, and
    ``root``'s and ``process_index``'s when given: :func:`read_manifest`), by step."""
    out = {}
    for step, directory in step_dirs(base).items():
        try:
            out[step] = read_manifest(directory, root=root, process_index=process_index, within=within, key_of=key_of)
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

    def __init__(
        self, root: Path, process_index: int, process_count: int, keep_last: int, *, url: str, key_of: KeyOf
    ) -> None:
        """``root``: the ``local=`` directory; ``url``: the manager root whose steps it holds; ``key_of``:
        the key of a run of that root by its save id (:class:`objckpt.locations.run_keys.RunKeys`)."""
        if keep_last < 1:
            raise ValueError(f"local_keep_last must be at least 1, got {keep_last}")
        self.root = root
        self.url = url
        self.key_of = key_of
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
        return read_manifest(directory, **self._whose(owner))

    def data(self, directory: Path, manifest: LocalManifest) -> np.ndarray:
        """The data file of the step in ``directory`` as bytes: a private mapping of its pages (no
        copy; copy-on-write, so neither the restored arrays nor the file change the other). Data
        files are never written again once their manifest is in place: a step saved again gets a
        new file. A data file that is a link is never read (OSError)."""
        if manifest.data_size == 0:
            return np.zeros(0, np.uint8)
        path = self.inside(directory) / manifest.data
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            if os.fstat(fd).st_size != manifest.data_size:
                raise FormatError(f"{path} is not {manifest.data_size} bytes long, as its manifest says")
            # writable (a donated buffer may be written in place), never populated: populating
            # a writable private mapping would copy every page; reading faults them in shared
            mapped = mmap.mmap(fd, manifest.data_size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return np.frombuffer(mapped, np.uint8)

    def steps(self) -> dict[int, LocalManifest]:
        return complete_steps(self.own, **self._whose(self.process_index))

    def _whose(self, owner: int) -> dict[str, Any]:
        return {"root": self.url, "process_index": owner, "within": self.root, "key_of": self.key_of}

    def key(self, save_id: str) -> bytes:
        """The key of the run ``save_id``, to seal a manifest with (FormatError: the root holds none)."""
        key = self.key_of(save_id)
        if key is None:
            raise FormatError(f"local tier: {self.url} holds no key of run {save_id}")
        return key

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
                steps = complete_steps(entry, **self._whose(owner))
                if steps:
                    out[owner] = steps
        return out

    def write(self, snap: Snapshot) -> LocalManifest:
        """The background phase of a local save, then retention of this process's own steps."""
        directory = self.inside(self.step_dir(snap.manifest.step))
        manifest = write_step(directory, snap.manifest, snap.buffer, key=self.key(snap.manifest.save_id))
        self.retain()
        return manifest

    def retain(self) -> list[int]:
        """Keep the newest ``keep_last`` steps here and of each peer copy held; drop torn ones."""
        deleted = retain(self.inside(self.own), self.keep_last, **self._whose(self.process_index))
        for owner in self.held():
            retain(self.inside(self.held_dir(owner)), self.keep_last, **self._whose(owner))
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
