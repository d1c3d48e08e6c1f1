"""Atomic whole-object writes on a local (POSIX) filesystem.

An object store never shows a half-written object, and objckpt relies on that:
a manifest that exists must be complete. On disk that takes a temporary file
in the destination directory and one atomic step at the end:

* overwrite: ``os.replace(tmp, final)``;
* create-if-absent: ``os.link(tmp, final)``, which fails with ``EEXIST``
  atomically if ``final`` exists (two racing creators: exactly one wins, and
  the loser never touches the winner's bytes).

Temporary files are named ``.objckpt-tmp-<random>`` so listings can hide
them; one left behind by a killed writer is garbage, never an object.

A store rooted at a directory never opens a path outside it. Keys are checked
lexically (no ``..``) before they get here, but a symbolic link inside the
directory (``ck/aa -> /elsewhere``) would still lead a hostile checkpoint's
manifest out of it. So:

* reads (:func:`open_regular`) resolve the key's real path and compare it with
  the root's real path (the root itself may be a link, e.g. ``/tmp`` on macOS),
  then open that resolved path one component at a time with ``O_NOFOLLOW``
  from a descriptor of the root: a link swapped in after the check fails the
  open rather than being followed, so the check cannot be raced;
* only regular files are read: the last component is opened ``O_NONBLOCK``
  (a FIFO would otherwise block ``open`` until a writer came) and ``fstat``-ed;
  a FIFO, socket or device is :class:`NotRegularFileError`;
* writes and deletes (:func:`resolve_parent`) resolve the key's parent
  directory and refuse one outside the root; they then act on the resolved
  path. Their last component is never followed (``rename``/``link``/``unlink``
  act on a link itself), so deleting a link inside the root removes the link.

A path that resolves outside is :class:`OutsideRootError` (a
``PermissionError``); the store reports it as a ``StorePermissionError``.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import uuid
from typing import Any, BinaryIO

from objckpt.storage.streaming import ReadSink, destination_of, piece_size

#: Prefix of in-flight temporary files; listings skip names starting with it.
TMP_PREFIX = ".objckpt-tmp-"


def _current_umask() -> int:
    """The process's umask, read without changing it where the OS allows
    (``/proc/self/status`` on Linux); elsewhere ``os.umask`` can only be read by
    setting it, so it is set back at once."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# Read once at import: temp files are created 0600 and get the mode a plain
# ``open(path, "wb")`` would have given them.
_UMASK = _current_umask()
_FILE_MODE = 0o666 & ~_UMASK

# Errors from os.link meaning "this filesystem has no hard links".
_NO_HARDLINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK}


def is_temp_name(path: str) -> bool:
    """Whether ``path``'s last component is one of our in-flight temp files."""
    return path.rsplit("/", 1)[-1].startswith(TMP_PREFIX)


class ParentNotDirectoryError(OSError):
    """A parent "directory" of the key exists as a file (object stores allow
    ``a`` and ``a/b`` side by side; a filesystem cannot)."""


class OutsideRootError(PermissionError):
    """A key's path resolves (through a symbolic link) outside the store's root directory."""

    def __init__(self, key: str, root: str, resolved: str) -> None:
        super().__init__(
            errno.EACCES,
            f"key {key!r} resolves to {resolved!r}, outside the store's root {root!r} "
            "(a symbolic link inside the root leads out of it); refused",
        )
        self.key = key
        self.root = root
        self.resolved = resolved


class NotRegularFileError(OSError):
    """The object's path is a FIFO, socket or device, not a regular file: never read."""

    def __init__(self, key: str, mode: int) -> None:
        super().__init__(errno.EINVAL, f"key {key!r} is {_kind_of_mode(mode)}, not a regular file; refused")
        self.key = key


def _kind_of_mode(mode: int) -> str:
    kinds = (
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISLNK, "a symbolic link"),
    )
    return next((name for test, name in kinds if test(mode)), "not a file")


_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
#: Whether a path can be walked component by component (``openat``) without following links.
_WALKS = bool(_O_NOFOLLOW and _O_DIRECTORY) and os.open in os.supports_dir_fd


def _inside(real_root: str, resolved: str) -> bool:
    return resolved == real_root or resolved.startswith(real_root.rstrip(os.sep) + os.sep)


def resolve_inside(root: str, key: str) -> tuple[str, str]:
    """``(real root, real path)`` of ``key`` under ``root``, refusing a path that leads out.

    Args:
        root: The store's root directory (it may itself be, or lie under, a link).
        key: A lexically clean relative ``/`` key.

    Raises:
        OutsideRootError: the key's real path is not under the root's real path.
    """
    real_root = os.path.realpath(root or os.sep)
    resolved = os.path.realpath(os.path.join(real_root, *key.split("/")))
    if not _inside(real_root, resolved):
        raise OutsideRootError(key, root or os.sep, resolved)
    return real_root, resolved


def resolve_parent(root: str, key: str) -> str:
    """The real path to write or delete ``key`` at: its parent resolved and checked, its name kept.

    Raises:
        OutsideRootError: the key's parent directory resolves outside the root.
    """
    head, _, name = key.rpartition("/")
    if not head:
        return os.path.join(os.path.realpath(root or os.sep), name)
    _, parent = resolve_inside(root, head)
    return os.path.join(parent, name)


def open_regular(root: str, key: str) -> BinaryIO:
    """Open ``key`` under ``root`` for reading: a regular file inside the root, links never followed.

    Raises:
        OutsideRootError: the key resolves outside the root (or a link appeared while opening).
        NotRegularFileError: a FIFO, socket or device (detected without blocking).
        IsADirectoryError, FileNotFoundError, NotADirectoryError: no such object.
    """
    real_root, resolved = resolve_inside(root, key)
    if resolved == real_root:
        raise IsADirectoryError(errno.EISDIR, "the store's root is not an object", key)
    flags = os.O_RDONLY | _O_NONBLOCK | _O_NOFOLLOW | _O_CLOEXEC
    try:
        fd = _walk_open(real_root, os.path.relpath(resolved, real_root), flags, key)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link swapped in after resolving: refuse, never follow
            raise OutsideRootError(key, root or os.sep, resolved) from exc
        raise
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "a prefix of other objects", key)
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(key, mode)
        if _O_NONBLOCK:
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", closefd=True)
    except BaseException:
        os.close(fd)
        raise


def _walk_open(real_root: str, rel: str, flags: int, key: str) -> int:
    """Open ``rel`` under ``real_root`` from a descriptor of the root, one component at a time,
    following no link; where ``openat`` is missing, open the resolved path with ``O_NOFOLLOW``."""
    if not _WALKS:
        return os.open(os.path.join(real_root, rel), flags)
    *dirs, name = rel.split(os.sep)
    dir_fd = os.open(real_root, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    try:
        for part in dirs:
            next_fd = os.open(part, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=dir_fd)
            os.close(dir_fd)
            dir_fd = next_fd
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
            raise NotRegularFileError(key, mode)  # not even opened: a device open may act
        return os.open(name, flags, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def read_range(root: str, key: str, start: int, end: int | None) -> bytes:
    """Bytes ``[start, end)`` of ``key`` (to its end when ``end`` is None), via :func:`open_regular`."""
    with open_regular(root, key) as f:
        if start:
            f.seek(start)
        return f.read() if end is None else f.read(end - start)


class SinkRaised(Exception):
    """What a sink raised inside :func:`stream_range`, carried out apart from the file's own errors."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(repr(error))
        self.error = error


def stream_range(
    root: str, key: str, start: int, end: int, sink: ReadSink, piece: int, stopped: threading.Event
) -> int:
    """Hand bytes ``[start, end)`` of ``key`` (opened by :func:`open_regular`) to ``sink`` in the
    pieces it sizes; how many bytes it was handed (fewer only where the file ends).

    Each piece is read with ``readinto`` straight into the place the sink names for it
    (:func:`objckpt.storage.streaming.destination_of`), else into one reused buffer of
    at most ``piece`` bytes. Stops without calling the sink again once ``stopped`` is set
    (the caller gave up waiting). A sink's error comes out as :class:`SinkRaised`.
    """
    buffer: memoryview | None = None
    with open_regular(root, key) as f:
        f.seek(start)
        raw = f.raw if hasattr(f, "raw") else f
        offset, length = 0, end - start

        def sink_call(fn: Any, *args: Any) -> Any:
            if stopped.is_set():
                raise SinkRaised(TimeoutError("the read was abandoned"))
            try:
                return fn(*args)
            except Exception as exc:
                raise SinkRaised(exc) from exc

        sink_call(sink.begin)
        while offset < length:
            size = sink_call(piece_size, sink, offset, min(piece, length - offset))
            place = sink_call(destination_of, sink, offset, size)
            if place is None:
                if buffer is None:
                    buffer = memoryview(bytearray(min(piece, length)))
                place = buffer[:size]
            got = _read_fully(raw, place)
            if got < size:
                return offset  # the file ends inside this piece: it is not handed over
            sink_call(sink.receive, offset, place)
            offset += size
    return offset


def _read_fully(f: Any, view: memoryview) -> int:
    """``readinto`` until ``view`` is full or the file ends; the bytes read."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def stat_regular(root: str, key: str) -> os.stat_result:
    """``fstat`` of ``key`` opened by :func:`open_regular` (the same checks as a read)."""
    with open_regular(root, key) as f:
        return os.fstat(f.fileno())


def _make_parent(path: str) -> str:
    parent = os.path.dirname(path) or "."
    try:
        os.makedirs(parent, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        raise ParentNotDirectoryError(errno.ENOTDIR, "a parent of the object exists as a file", parent) from exc
    return parent


#: A whole object's bytes: one buffer, or parts written one after another (never joined).
Body = bytes | memoryview | tuple[memoryview, ...]


def _write_body(f: BinaryIO, data: Body) -> None:
    for part in data if isinstance(data, tuple) else (data,):
        f.write(part)


def _write_temp(parent: str, data: Body) -> str:
    tmp = os.path.join(parent, f"{TMP_PREFIX}{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), _FILE_MODE)
    try:
        with os.fdopen(fd, "wb", closefd=True) as f:
            _write_body(f, data)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return tmp


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def write_atomic(path: str, data: Body, *, exclusive: bool) -> None:
    """Write ``data`` to ``path`` so no reader ever sees a partial file.

    Args:
        path: Absolute destination path; missing parent directories are made.
        data: The whole object, or its parts in order.
        exclusive: Create-if-absent: raise :class:`FileExistsError` (and leave
            the existing file untouched) if ``path`` exists.

    Raises:
        FileExistsError: ``exclusive`` and the file exists.
        ParentNotDirectoryError: a parent path component is a regular file.
    """
    parent = _make_parent(path)
    tmp = _write_temp(parent, data)
    try:
        if not exclusive:
            os.replace(tmp, path)
            return
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError as exc:
            if exc.errno not in _NO_HARDLINKS:
                raise
            _create_exclusive_fallback(path, data)
    finally:
        # After replace the name is gone already; after link it is a second name.
        _unlink_quietly(tmp)


def _create_exclusive_fallback(path: str, data: Body) -> None:
    """O_EXCL create for filesystems without hard links.

    Still exactly-one-winner, but a reader racing the writer may see a short
    file for a moment; only used where ``os.link`` is unsupported.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), _FILE_MODE)
    try:
        with os.fdopen(fd, "wb", closefd=True) as f:
            _write_body(f, data)
    except BaseException:
        _unlink_quietly(path)
        raise


def write_inside(root: str, key: str, data: Body, *, exclusive: bool) -> None:
    """:func:`write_atomic` of ``key`` under ``root``, refusing a parent that resolves outside it.

    Raises:
        OutsideRootError: a directory on the key's path is a link leading out of the root.
    """
    write_atomic(resolve_parent(root, key), data, exclusive=exclusive)


def remove_inside(root: str, key: str) -> None:
    """Remove ``key`` under ``root`` (a link is removed, not its target), refusing a parent outside it.

    Raises:
        OutsideRootError: a directory on the key's path is a link leading out of the root.
        FileNotFoundError: no such file.
    """
    os.unlink(resolve_parent(root, key))
