"""The local tier: each process's own part of a step on its own host's disk or RAM disk.

docs/TIERS.md ("Saving") says what the manager's ``local=`` directory holds: per process
``process_<p>/step_<N>/``, a one-process checkpoint and its record ``part.json``, written last
(no record, no step), and ``process_<p>/peer/process_<q>/step_<N>/``, process q's step kept as
its peer copy; when a step is this manager's (its record names the root and the process, is
sealed under its run's key and pins the manifest beside it); and that nothing is reached
through a link out of ``local=``. Here: :meth:`LocalDir.write` is a local save's background
phase (into a new directory beside the step's, the record synced and renamed into place, the
directory moved to ``step_<N>``), :func:`read_record` the checks of a step's record
(:mod:`objckpt.core.format.local`), :func:`retain` and :meth:`LocalDir.retire` the retention
and the one line of steps. Each process touches only ``process_<p>/`` under its own index.
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import stat
import uuid
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from objckpt.core.format import MANIFEST_KEY
from objckpt.core.format.local import RECORD, PartRecord, authentic, parse_part_record, record_of
from objckpt.errors import FormatError, StorePermissionError
from objckpt.layouts.native import NativeCheckpoint
from objckpt.layouts.process_copy import open_part
from objckpt.options import Options
from objckpt.roots.step_names import STEP_DIR, step_dir
from objckpt.saving.local_snapshot import Snapshot, save_part
from objckpt.storage.in_memory import BufferStore
from objckpt.transfer import runtime

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


def _fsync(path: Path | str, flags: int = 0) -> None:
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_dir(directory: Path, root: str | None = None) -> Path:
    """A fresh directory beside ``directory`` (hidden from the step listing) to write a step into;
    named by ``root``, the manager root writing it, so that another job's retention in a shared
    ``local=`` leaves it alone (:func:`retain`)."""
    tmp = directory.parent / f".tmp-{directory.name}-{uuid.uuid4().hex[:8]}{_tag(root)}"
    tmp.mkdir(parents=True)
    return tmp


def write_step(directory: Path, snap: Snapshot, *, key: bytes, options: Options) -> PartRecord:
    """Write ``snap`` as the step in ``directory`` (its record sealed under ``key``, its run's key):
    the checkpoint by the save pipeline into a new directory, its record last, then the directory
    moved into place; return the record."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_dir(directory, snap.root)
    try:
        save_part(tmp.as_uri(), snap, options)
        manifest = read_regular(tmp / MANIFEST_KEY, MANIFEST_LIMIT)
        record = record_of(
            manifest,
            root=snap.root,
            step=snap.step,
            save_id=snap.save_id,
            process_index=snap.process_index,
            process_count=snap.process_count,
        )
        sync_files(tmp)
        commit_record(tmp, record, key)
        try:  # another job's (root's) or process's step is not this save's to replace
            read_record(directory, root=snap.root, process_index=snap.process_index)
        except ForeignStepError as e:
            raise ForeignStepError(f"{e}: another job's step, left as it is (give each job its own local=)") from None
        except (FormatError, OSError):
            pass
        place(tmp, directory)
    except BaseException:
        _remove(tmp)
        raise
    return record


def sync_files(directory: Path) -> None:
    """Flush every file under ``directory`` and the directories holding them to the disk, so a
    record written after them never names bytes a power loss could take (the store's writes
    are atomic renames, not synced)."""
    for dirpath, _dirs, files in os.walk(directory):
        for name in files:
            _fsync(os.path.join(dirpath, name), os.O_NOFOLLOW)
        _fsync(dirpath)


def commit_record(directory: Path, record: PartRecord, key: bytes) -> None:
    """Rename ``record`` (sealed under ``key``) into ``directory``, whose checkpoint is written, and sync."""
    tmp = directory / f".{RECORD}.tmp"
    with open(tmp, "wb") as f:
        f.write(record.to_json(key))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / RECORD)
    _fsync(directory)


def place(tmp: Path, directory: Path) -> None:
    """Move the complete step in ``tmp`` to ``directory``, replacing a step there (record first)."""
    if directory.exists() or directory.is_symlink():
        _remove(directory / RECORD)
        _remove(directory)
    os.replace(tmp, directory)
    _fsync(directory.parent)


def _remove(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()
    except FileNotFoundError:
        pass


KeyOf = Callable[[str], "bytes | None"]


def read_record(
    directory: Path,
    *,
    root: str | None = None,
    process_index: int | None = None,
    within: Path | None = None,
    key_of: KeyOf | None = None,
) -> PartRecord:
    """The record of the step in ``directory``, checked against the manifest beside it.

    ``root`` and ``process_index``, when given, must be the ones the record names (the
    manager's root; the process whose step it is); ``within``: the tier's directory, which
    ``directory`` must resolve inside; ``key_of``: the key of a run by its save id (from the
    root), under which the record must be sealed.

    Raises:
        FileNotFoundError: no record (a torn or absent step).
        FormatError: a damaged record, a manifest missing or other than the one it pins.
        ForeignStepError: another root's or another process's step, or a run whose key the root
            does not hold.
        StorePermissionError: ``directory`` leads out of ``within`` through a link.
    """
    if within is not None:
        inside(within, directory)
    path = directory / RECORD
    raw = read_regular(path, MANIFEST_LIMIT)
    if len(raw) > MANIFEST_LIMIT:
        raise FormatError(f"{path}: over {MANIFEST_LIMIT} bytes")
    record = check_record(raw, str(path), root=root, process_index=process_index, key_of=key_of)
    try:
        manifest = read_regular(directory / MANIFEST_KEY, MANIFEST_LIMIT)
    except FileNotFoundError:
        raise FormatError(f"{path}: its {MANIFEST_KEY} is missing") from None
    if not record.pins(manifest):
        raise FormatError(f"{path}: {MANIFEST_KEY} is not the one it pins (an edited or replaced step)")
    if STEP_DIR.match(directory.name) and int(STEP_DIR.match(directory.name).group(1)) != record.step:  # type: ignore[union-attr]
        raise FormatError(f"{path}: names step {record.step}, not the directory's")
    return record


def check_record(
    raw: bytes,
    where: str,
    *,
    root: str | None = None,
    process_index: int | None = None,
    key_of: KeyOf | None = None,
) -> PartRecord:
    """The record ``raw`` (``where`` it is, for messages), checked as :func:`read_record` says.

    Raises:
        FormatError: a damaged record, or one not sealed under its run's key.
        ForeignStepError: another root's or another process's step, or a run whose key the root
            does not hold.
    """
    record = parse_part_record(raw)
    if root is not None and record.root != root:
        raise ForeignStepError(f"{where}: a step of the root {record.root}, not of {root}")
    if process_index is not None and record.process_index != process_index:
        raise ForeignStepError(f"{where}: process {record.process_index}'s step, not process {process_index}'s")
    if key_of is not None:
        key = key_of(record.save_id)
        if key is None:
            raise ForeignStepError(f"{where}: {record.root} holds no key of its run {record.save_id}")
        if not authentic(raw, key):
            raise FormatError(f"{where}: not sealed under its run's key (an edited or forged record)")
    return record


def step_objects(directory: Path) -> dict[str, np.ndarray]:
    """Every regular file of the step in ``directory`` (its checkpoint's objects), by key, each a
    private mapping of its pages (no copy; copy-on-write, so neither the restored arrays nor the
    file change the other). Files are never written again once the step's record is in place:
    a step saved again is a new directory. A link is never followed (it is left out, and a
    restore that needs it fails and falls back)."""
    out: dict[str, np.ndarray] = {}
    for dirpath, _dirs, files in os.walk(directory):  # os.walk never descends into a linked directory
        for name in files:
            path = os.path.join(dirpath, name)
            key = os.path.relpath(path, directory).replace(os.sep, "/")
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                size = os.fstat(fd).st_size
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue
                if size == 0:
                    out[key] = np.zeros(0, np.uint8)
                    continue
                # writable (a donated buffer may be written in place), never populated: populating
                # a writable private mapping would copy every page; reading faults them in shared
                mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            out[key] = np.frombuffer(mapped, np.uint8)
    return out


def step_dirs(base: Path) -> dict[int, Path]:
    """The step directories under ``base``, complete or not, by step."""
    out = {}
    for entry in _entries(base):
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
) -> dict[int, PartRecord]:
    """The complete steps under ``base`` (a record that parses and pins its manifest, and
    ``root``'s and ``process_index``'s when given: :func:`read_record`), by step."""
    out = {}
    for step, directory in step_dirs(base).items():
        try:
            out[step] = read_record(directory, root=root, process_index=process_index, within=within, key_of=key_of)
        except FileNotFoundError:
            continue
        except (FormatError, OSError) as e:
            log.warning("objckpt local tier: %s is not a usable step, not read: %s", directory, e)
    return out


def retain(
    base: Path,
    keep_last: int,
    *,
    keep: frozenset[int] = frozenset(),
    within: Path | None = None,
    above: int | None = None,
    **whose: Any,
) -> list[int]:
    """Delete all but the newest ``keep_last`` complete steps under ``base`` (``above``: the step
    just saved; the steps above it, of a line the job left, go first), and every torn or damaged
    step except those in ``keep``; record first, so a step stops existing at once.
    A step of another root or process (``whose``: :func:`complete_steps`) is left alone: it
    is not this manager's to delete. Returns the steps deleted. ``within``: the tier's
    directory; a step directory that resolves outside it is never deleted."""
    complete = sorted(complete_steps(base, within=within, **whose))
    line = [s for s in complete if above is None or s <= above]
    doomed = set(complete) - set(line) | set(line[: max(0, len(line) - keep_last)])
    for step, directory in step_dirs(base).items():
        if step not in complete and step not in keep and not _foreign(directory, within, whose):
            doomed.add(step)
    remove_steps(base, doomed, within)
    ours = _tag(whose.get("root"))
    for entry in _entries(base):  # writes cut off before they were moved into place (this root's or unnamed)
        name = entry.name
        if name.startswith(".tmp-step_") and (name.count("-") < 3 or name.endswith(ours)) and not entry.is_symlink():
            _remove(entry)
    return sorted(doomed)


def _tag(root: str | None) -> str:  # a write in flight's mark of its root (tmp_dir)
    return "" if root is None else f"-{zlib.crc32(root.encode()):08x}"


def remove_steps(base: Path, steps: Iterable[int], within: Path | None) -> None:
    """Delete ``steps`` under ``base``, each record first (refused when a link leads out of ``within``)."""
    for step in sorted(steps):
        directory = base / step_dir(step)
        if within is not None:
            inside(within, directory)
        _remove(directory / RECORD)
        _remove(directory)


def _entries(base: Path) -> list[Path]:
    try:
        return list(base.iterdir())
    except (FileNotFoundError, NotADirectoryError):  # none, or a local= that cannot hold one
        return []


def _foreign(directory: Path, within: Path | None, whose: dict[str, Any]) -> bool:
    try:
        read_record(directory, within=within, **whose)
    except (FormatError, OSError) as e:
        return isinstance(e, ForeignStepError)
    return False


class LocalDir:
    """This process's directory in the local tier: its own steps and the peer copies it holds."""

    def __init__(
        self, root: Path, process_index: int, process_count: int, keep_last: int, *, url: str, key_of: KeyOf
    ) -> None:
        """``root``: the ``local=`` directory; ``url``: the manager root whose steps it holds; ``key_of``:
        the key of a run of that root by its save id (:class:`objckpt.locations.run_keys.RunKeys`)."""
        if keep_last < 1:
            raise ValueError(f"LocalCopies.keep_last must be at least 1, got {keep_last}")
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

    def read(self, directory: Path, owner: int | None = None) -> PartRecord:
        """The record of the step in ``directory``, this manager's and ``owner``'s (default: this process's)."""
        owner = self.process_index if owner is None else owner
        return read_record(directory, **self._whose(owner))

    def open(
        self, directory: Path, record: PartRecord, objects: dict[str, np.ndarray] | None = None
    ) -> NativeCheckpoint:
        """The step in ``directory`` (``objects``: its files already in memory, a copy brought back)
        as a checkpoint of its process's part, for the one restore. ``name`` in messages is the
        same on every process (a restore that reshards agrees on it).

        Raises:
            FormatError: the checkpoint is not the one the record pins, or fails its checks.
        """
        if objects is None:
            objects = step_objects(self.inside(directory))
        store = BufferStore(f"local tier of {self.url}, step {record.step}", objects)
        return runtime.run_sync(open_part(store, record, size_limit=MANIFEST_LIMIT))

    def steps(self) -> dict[int, PartRecord]:
        return complete_steps(self.own, **self._whose(self.process_index))

    def _whose(self, owner: int) -> dict[str, Any]:
        return {"root": self.url, "process_index": owner, "within": self.root, "key_of": self.key_of}

    def key(self, save_id: str) -> bytes:
        """The key of the run ``save_id``, to seal a record with (FormatError: the root holds none)."""
        key = self.key_of(save_id)
        if key is None:
            raise FormatError(f"local tier: {self.url} holds no key of run {save_id}")
        return key

    def held(self) -> dict[int, dict[int, PartRecord]]:
        """The peer copies this process holds: ``{owner: {step: record}}``."""
        out = {}
        for entry in _entries(self.own / "peer"):
            if entry.name.startswith("process_") and entry.name[8:].isdigit():
                owner = int(entry.name[8:])
                steps = complete_steps(entry, **self._whose(owner))
                if steps:
                    out[owner] = steps
        return out

    def write(self, snap: Snapshot, options: Options | None = None) -> PartRecord:
        """The background phase of a local save (``options``: the manager's), then retention of
        this process's own steps."""
        directory = self.inside(self.step_dir(snap.step))
        self.inside(directory.parent)
        record = write_step(directory, snap, key=self.key(snap.save_id), options=options or Options())
        self.retain(above=snap.step)
        return record

    def retain(self, above: int | None = None) -> list[int]:
        """Keep the newest ``keep_last`` steps here and of each peer copy held (``above``: the step
        just saved, none above it); drop torn ones."""
        deleted = retain(self.inside(self.own), self.keep_last, above=above, **self._whose(self.process_index))
        for owner in self.held():
            retain(self.inside(self.held_dir(owner)), self.keep_last, above=above, **self._whose(owner))
        return deleted

    def retire(self, above: int) -> list[int]:
        """Delete this manager's steps above ``above``, its own and the peer copies it holds (the
        job goes on from ``above``: they are of a line it left); its own steps deleted."""
        deleted = []
        for owner, base in [(self.process_index, self.own), *((o, self.held_dir(o)) for o in self.held())]:
            doomed = [s for s in complete_steps(base, **self._whose(owner)) if s > above]
            remove_steps(self.inside(base), doomed, self.root)
            deleted += doomed if owner == self.process_index else []
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
