"""The checkpoint reader protocol, and what readers return.

A prefix in a store holds a checkpoint in some *layout*: objckpt's own format
(v1, v2) or another library's (Orbax). :func:`objckpt.layouts.registry.open_checkpoint`
decides which, once, and returns a reader. Every reader describes itself
(:meth:`CheckpointReader.info`, for ``inspect``). Then one of two things holds:

- it is **native** (:class:`objckpt.layouts.native.NativeCheckpoint`): it holds a
  :class:`~objckpt.core.format.Manifest` whose pieces the engine fetches itself
  (restore, verify, copy, gc);
- or it **reads itself** (:class:`ForeignReader`): it restores and verifies its own
  arrays, since their bytes are in a format the engine does not decode.

The result types of ``inspect`` and ``verify`` live here, below every reader,
so that a layout's reader and the tools that print its results share them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from objckpt.options import Options
from objckpt.progress import ProgressArg, human_bytes

if TYPE_CHECKING:
    from objckpt.transfer.stats import TransferStats


@dataclass(frozen=True)
class LeafInfo:
    """One saved leaf: its path, kind, shape, dtype and size in bytes.

    Attributes:
        path: the leaf's key path in the saved tree (``params/w``).
        kind: what was saved there: ``array`` (a ``jax.Array``), ``ndarray`` (numpy),
            ``str`` or ``bytes`` (their data in blobs, like arrays); ``int``, ``float``,
            ``bool`` or ``none`` (inline in the manifest); ``json`` (:class:`objckpt.Json`)
            or ``per_process`` (:class:`objckpt.PerProcess`).
        shape: the array's shape; None for a leaf without one.
        dtype: the array's dtype name (``bfloat16``); None for a leaf without one.
        nbytes: bytes of array data the leaf holds.
        sharding: the sharding it was saved with, as the manifest describes it
            (mesh axes, partition spec); None when saved from the host.
        value: for an inline leaf (int, float, bool, None), the value; for a ``json``
            item, the document; for a ``per_process`` item, each process's value size
            in bytes, in process order.
        codec: how its pieces are stored (``shuffle-zstd``: byte planes and zstd, saved
            with ``Options(compression="zstd")``); None: as they are.
    """

    path: str
    kind: str
    shape: tuple[int, ...] | None
    dtype: str | None
    nbytes: int
    sharding: dict[str, Any] | None = None
    value: Any = None
    codec: str | None = None

    def item_summary(self, limit: int = 200) -> str | None:
        """For an item, what ``inspect`` shows of it: a JSON document inline when its text is at
        most ``limit`` characters (else its size), a ``PerProcess`` item's sizes; None otherwise."""
        if self.kind == "json":
            text = json.dumps(self.value, sort_keys=True)
            return text if len(text) <= limit else f"<JSON document, {human_bytes(len(text.encode()))}>"
        if self.kind == "per_process":
            sizes = list(self.value or ())
            shown = ", ".join(human_bytes(n) for n in sizes[:8]) + (", ..." if len(sizes) > 8 else "")
            return f"{len(sizes)} process(es): {shown}"
        return None

    @property
    def key_type(self) -> str | None:
        """For a typed PRNG key array, its JAX key type (``key<threefry2x32>``); the leaf's
        ``dtype`` and ``shape`` are those of the stored key data (``jax.random.key_data``),
        whose last dimension holds one key's words."""
        impl = (self.sharding or {}).get("prng_impl")
        return f"key<{impl}>" if impl is not None else None

    def __str__(self) -> str:
        summary = self.item_summary()
        if summary is not None and self.kind == "per_process":
            return f"{self.path}  {self.kind}: {summary} ({human_bytes(sum(self.value))} in all)"
        if summary is not None:
            return f"{self.path}  {self.kind}: {summary}"
        if self.shape is None:
            return f"{self.path}  {self.kind} = {self.value!r}"
        if self.key_type is not None:
            return (
                f"{self.path}  {self.key_type}{list(self.shape[:-1])} (stored as {self.dtype}{list(self.shape)})"
                f"  {human_bytes(self.nbytes)}  ({self.kind})"
            )
        kind = self.kind if self.codec is None else f"{self.kind}, {self.codec}"
        return f"{self.path}  {self.dtype}{list(self.shape)}  {human_bytes(self.nbytes)}  ({kind})"


def _ratio(logical: int, stored: int) -> str:
    return f"{logical / stored:.2f}× smaller" if stored else "nothing stored"


@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`objckpt.inspect` returns.

    Attributes:
        url: the checkpoint.
        tree: the saved tree with a :class:`LeafInfo` at every leaf.
        leaves: the same leaves by path, in manifest order.
        total_bytes: array bytes over all leaves.
        num_blobs: objects holding the array data.
        format_version: the checkpoint format's version (docs/FORMAT.md).
        created: when the save committed (ISO 8601, UTC).
        save_id: the save's unique id, the same on every copy of it.
        num_processes: how many processes saved it.
        metadata: the ``metadata=`` it was saved with (a manager's step and metrics
            under ``"objckpt.manager"``).
        format: ``"objckpt"``, or the name of another layout (``"orbax"``: format_version 0,
            no save_id; its arrays are in Orbax's own files, not blobs).
        stored_bytes: the bytes of its blobs in the store (from the root manifest alone); below
            ``total_bytes`` when its leaves are compressed. None for another layout.
        bytes_from: an incremental checkpoint's array bytes by where they are stored: ``""``
            its own blobs, else the name of the earlier checkpoint (a base) whose blobs hold
            them; None for any other checkpoint.
    """

    url: str
    tree: Any
    leaves: dict[str, LeafInfo]
    total_bytes: int
    num_blobs: int
    format_version: int
    created: str
    save_id: str
    num_processes: int
    metadata: dict[str, Any]
    format: str = "objckpt"
    stored_bytes: int | None = None
    bytes_from: dict[str, int] | None = None

    def stored_summary(self) -> str:
        """``, stored as <bytes> (<ratio>× smaller)`` when any leaf is compressed, else nothing."""
        if self.stored_bytes is None or not any(leaf.codec for leaf in self.leaves.values()):
            return ""
        return f", stored as {human_bytes(self.stored_bytes)} ({_ratio(self.total_bytes, self.stored_bytes)})"

    def __str__(self) -> str:
        if self.format != "objckpt":
            summary = (
                f"  {self.format.capitalize()} checkpoint, created {self.created}, {len(self.leaves)} leaves,"
                f" {human_bytes(self.total_bytes)}"
            )
        else:
            summary = (
                f"  format v{self.format_version}, created {self.created}, {self.num_processes} process(es),"
                f" {len(self.leaves)} leaves, {human_bytes(self.total_bytes)} in {self.num_blobs} blobs"
                f"{self.stored_summary()}"
            )
        lines = [f"checkpoint {self.url}", summary]
        if self.metadata:
            lines.append(f"  metadata: {self.metadata}")
        if self.bytes_from is not None:
            where = [f"{human_bytes(n)} from {name or 'its own blobs'}" for name, n in sorted(self.bytes_from.items())]
            lines.append(f"  incremental: {', '.join(where)}")
        lines.extend(f"  {leaf}" for leaf in self.leaves.values())
        return "\n".join(lines)


@dataclass(frozen=True)
class VerifyProblem:
    """One thing wrong with a checkpoint.

    Attributes:
        kind: ``missing``, ``short``, ``size`` (longer than the manifest says),
            ``checksum``, ``sha256`` (the crc32c matches, the SHA-256 of a
            checkpoint saved with ``Options.digest`` does not: bytes changed on
            purpose), ``codec`` (a compressed piece whose checksum matches does not
            decode to its box's bytes: written wrong), ``unreadable``, or, from
            ``verify(read_data=False)``, ``unchecked`` (the store keeps no crc32c of the blob to compare).
        blob: the blob's key, relative to the checkpoint.
        message: one line naming everything needed to find it.
        leaf: the leaf path, for a checksum or sha256 mismatch.
        start: where the damaged byte range ``[start, end)`` starts in the blob, for a checksum or
            sha256 mismatch.
        end: where it ends (exclusive).
    """

    kind: str
    blob: str
    message: str
    leaf: str | None = None
    start: int | None = None
    end: int | None = None

    def __str__(self) -> str:
        return self.message


@dataclass
class VerifyReport:
    """What :func:`objckpt.verify` found.

    Attributes:
        url: the checkpoint.
        problems: every problem found, sorted by blob and byte offset; empty when ``ok``.
        blobs: how many blobs were checked.
        pieces: how many pieces (one leaf's bytes in a blob) were checked.
        bytes_read: bytes read from the store.
        requests: store requests issued.
        retries: how many of them were retries.
        checksum_retries: pieces read again after a checksum mismatch (a mismatch
            that a re-read cures was a bit flipped in flight, not a problem).
        seconds: wall time.
        format: ``"objckpt"``, or the name of another layout (``"orbax"``: its arrays
            are read and decoded chunk by chunk; Orbax stores no checksums):
            ``arrays`` counts them, ``blobs`` and ``pieces`` are 0.
        checks: for another layout, what its reader checked (one line, from the
            reader: the summary says it, since it differs from objckpt's checksums);
            for ``verify(read_data=False)``, that the store's checksums were compared.
        arrays: for another layout, how many arrays were read and decoded.
    """

    url: str
    problems: list[VerifyProblem] = field(default_factory=list)
    blobs: int = 0
    pieces: int = 0
    bytes_read: int = 0
    requests: int = 0
    retries: int = 0
    checksum_retries: int = 0
    seconds: float = 0.0
    format: str = "objckpt"
    arrays: int = 0
    checks: str = ""

    @property
    def ok(self) -> bool:
        """Whether nothing is wrong: no problem found."""
        return not self.problems

    def summary(self) -> str:
        """One line: OK or how many problems, what was checked, bytes read and seconds."""
        status = "OK" if self.ok else f"FAILED, {len(self.problems)} problem(s)"
        if self.format != "objckpt":
            return (
                f"verify {self.url}: {status}; {self.format.capitalize()} checkpoint, {self.arrays} arrays"
                f" ({self.checks}), {human_bytes(self.bytes_read)} read in {self.seconds:.2f} s"
            )
        checks = f" ({self.checks})" if self.checks else ""
        return (
            f"verify {self.url}: {status}; {self.blobs} blobs, {self.pieces} pieces{checks},"
            f" {human_bytes(self.bytes_read)} read in {self.seconds:.2f} s"
        )

    def __str__(self) -> str:
        return "\n".join([self.summary(), *(f"  {p}" for p in self.problems)])

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready values (what ``objckpt verify --json`` prints)."""
        return {
            "url": self.url,
            "ok": self.ok,
            "problems": [
                {"kind": p.kind, "blob": p.blob, "leaf": p.leaf, "start": p.start, "end": p.end, "message": p.message}
                for p in self.problems
            ],
            "blobs": self.blobs,
            "pieces": self.pieces,
            "bytes_read": self.bytes_read,
            "requests": self.requests,
            "retries": self.retries,
            "checksum_retries": self.checksum_retries,
            "seconds": self.seconds,
            "format": self.format,
            "arrays": self.arrays,
        }


@dataclass(frozen=True)
class OpenRequest:
    """What a layout's opener is told besides the store.

    Attributes:
        url: the checkpoint's URL as the caller named it.
        storage_options: the caller's storage options (a reader that opens its
            own connections, such as tensorstore's, passes them on).
        options: tuning (size limits, timeouts).
        look_above: the caller (restore) wants an item that is no pytree named as
            such: a layout may read the prefix one level up to tell (Orbax's step metadata).
    """

    url: str
    storage_options: dict[str, Any] | None
    options: Options
    look_above: bool = False


@runtime_checkable
class CheckpointReader(Protocol):
    """What every reader says about the checkpoint it opened."""

    @property
    def url(self) -> str:
        """The checkpoint."""
        ...

    @property
    def format(self) -> str:
        """The layout's name: ``"objckpt"``, ``"orbax"``, ..."""
        ...

    @property
    def version(self) -> int:
        """The layout's format version (0 where the layout has none)."""
        ...

    def info(self) -> CheckpointInfo:
        """A description for ``inspect``; reads no array data."""
        ...


@runtime_checkable
class ForeignReader(CheckpointReader, Protocol):
    """A reader of a layout whose arrays the engine does not decode: it restores and verifies itself."""

    def restore(self, target: Any, *, partial: bool, options: Options, stats: TransferStats, cast: str) -> Any:
        """The checkpoint's tree (or the ``target``'s part of it), as :func:`objckpt.restore` returns it."""
        ...

    def verify(self, options: Options, stats: TransferStats, progress: ProgressArg) -> VerifyReport:
        """Read and check everything the layout can check; ``report.checks`` says what that is."""
        ...


#: A layout's entry point: given a store with no objckpt manifest, a reader of what
#: the prefix holds in this layout, or None when it holds nothing of it.
LayoutOpener = Callable[[Any, OpenRequest], ForeignReader | None]
