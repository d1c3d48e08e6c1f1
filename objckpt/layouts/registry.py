"""The one place that decides what a prefix holds: :func:`open_checkpoint`.

An objckpt checkpoint is found by its root manifest (``manifest.json``), whose
version picks the reader's rules (:mod:`objckpt.layouts.native`). A prefix with
no manifest is offered to every registered layout in turn, each named by a
dotted path (``"package.module:opener"``) imported only when it is asked, as
fsspec's registry does: the engine never imports a layout's package, and a
layout whose dependencies are not installed costs nothing until a prefix needs
it. Third-party packages register theirs under the entry-point group
``objckpt.layouts`` (name: the layout, value: its opener). Nothing found is a
:class:`~objckpt.errors.CheckpointNotFoundError`.

An opener is a :data:`~objckpt.layouts.base.LayoutOpener`: given the store and an
:class:`~objckpt.layouts.base.OpenRequest`, a reader, or None when the prefix
holds nothing of its layout.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import threading
from typing import Any

from objckpt.errors import CheckpointNotFoundError
from objckpt.in_flight import save_in_flight
from objckpt.layouts.base import ForeignReader, LayoutOpener, OpenRequest
from objckpt.layouts.native import NativeCheckpoint, open_native
from objckpt.options import Options
from objckpt.transfer import runtime

log = logging.getLogger("objckpt")

#: The entry-point group third-party layouts register under.
ENTRY_POINT_GROUP = "objckpt.layouts"

#: Layouts shipped with objckpt, by dotted path (imported on first use).
BUILTIN_LAYOUTS: dict[str, str] = {
    "orbax": "objckpt.orbax.reader:open_orbax",
    "safetensors": "objckpt.safetensors.reader:open_safetensors",
}

_registered: dict[str, str | LayoutOpener] = {}
_loaded: dict[str, LayoutOpener] = {}
_unavailable: dict[str, list[str | LayoutOpener | None]] = {}  # what failed to import, by name (warned once)
_lock = threading.Lock()

Checkpoint = NativeCheckpoint | ForeignReader


def register_layout(name: str, opener: str | LayoutOpener, *, clobber: bool = False) -> None:
    """Make ``open_checkpoint`` try the layout ``name`` on prefixes with no objckpt manifest.

    Args:
        name: the layout's name (what its readers report as ``format``).
        opener: a :data:`~objckpt.layouts.base.LayoutOpener`, or its dotted path
            ``"package.module:attr"``, imported when a prefix first needs it.
        clobber: replace a layout already registered under ``name``.

    Raises:
        ValueError: ``name`` is taken (and ``clobber`` is false), or a dotted path has no ``:``.
    """
    if isinstance(opener, str) and ":" not in opener:
        raise ValueError(f"a layout's opener is named 'package.module:attr', got {opener!r}")
    with _lock:
        if not clobber and (name in _registered or name in BUILTIN_LAYOUTS):
            raise ValueError(f"layout {name!r} is already registered (pass clobber=True to replace it)")
        _registered[name] = opener
        _loaded.pop(name, None)


def known_layouts() -> list[str]:
    """The names of the layouts tried after objckpt's own, in the order they are tried."""
    names = [n for n in BUILTIN_LAYOUTS if n not in _registered] + list(_registered)
    names += [ep.name for ep in _entry_points() if ep.name not in names]
    return names


def open_checkpoint(
    store: Any,
    *,
    options: Options | None = None,
    storage_options: dict[str, Any] | None = None,
    look_above: bool = False,
) -> Checkpoint:
    """A reader of the checkpoint at ``store``: objckpt's (by its manifest), or another layout's.

    Args:
        store: the opened store of the checkpoint's prefix.
        options: tuning (the manifest size limit, timeouts).
        storage_options: the caller's, for readers that open their own connections.
        look_above: the caller (restore) wants an item that is no pytree named as
            such (:attr:`OpenRequest.look_above`).

    Raises:
        CheckpointNotFoundError: no layout recognises the prefix (the message of
            objckpt's own "no manifest", and whether a save to it is still running here).
        FormatError: an objckpt manifest is there and malformed.
    """
    options = options or Options()
    try:
        return runtime.run_sync(open_native(store, size_limit=options.manifest_size_limit))
    except CheckpointNotFoundError as e:
        missing = _with_in_flight_hint(e, str(store.url))
    request = OpenRequest(str(store.url), storage_options, options, look_above)
    for name in known_layouts():
        opener = _opener(name)
        if opener is None:
            continue
        reader = opener(store, request)
        if reader is not None:
            return reader
    raise missing from None


def _with_in_flight_hint(e: CheckpointNotFoundError, url: str) -> CheckpointNotFoundError:
    """``e``, saying so when a save to ``url`` is still running in this process."""
    if not save_in_flight(url):
        return e
    return CheckpointNotFoundError(
        f"{e}; a save_async to this URL is still running in this process:"
        " call .result() on its handle (CheckpointManager: .wait()) before restoring it"
    )


def _opener(name: str) -> LayoutOpener | None:
    """The opener registered as ``name``, imported on first use; None (logged once) when
    its module is not installed."""
    with _lock:
        if name in _loaded:
            return _loaded[name]
        spec: str | LayoutOpener | None = _registered.get(name, BUILTIN_LAYOUTS.get(name))
    try:
        if spec is None:
            eps = [ep for ep in _entry_points() if ep.name == name]
            opener: LayoutOpener = eps[0].load()
        elif isinstance(spec, str):
            module_name, _, attr = spec.partition(":")
            opener = getattr(importlib.import_module(module_name), attr)
        else:
            opener = spec
    except ModuleNotFoundError as e:
        with _lock:
            first = spec not in _unavailable.setdefault(name, [])
            if first:
                _unavailable[name].append(spec)
        if first:
            log.warning("objckpt: layout %r is not available (%s); prefixes in it are not recognised", name, e)
        return None
    with _lock:
        _loaded[name] = opener
    return opener


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
