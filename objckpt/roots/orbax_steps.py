"""Steps that Orbax's ``CheckpointManager`` wrote under a manager root, beside objckpt's own.

A training job that switches from Orbax keeps its root: ``<root>/<step>/<item>/…``
with the step's ``_CHECKPOINT_METADATA`` (the layout :mod:`objckpt.orbax.layout`
reads). The manager lists those steps with its own, restores, inspects and reads
the metrics of them through :mod:`objckpt.orbax`, and saves new steps beside them
as ``step_<number>/``. Retention never deletes them unless the manager is opened
with ``Retention(delete_orbax_steps=True)``.

When an Orbax step is committed: Orbax writes ``_CHECKPOINT_METADATA`` when a step
starts and ``commit_success.txt`` when it ends. On local disk the step directory
appears by a rename once complete, so the metadata file is enough there (Orbax
before ~0.5 wrote no commit file); on an object store (no rename) a step is
committed only once ``commit_success.txt`` is there too: a crashed Orbax save
leaves a step directory without it, which Orbax itself ignores, and so does this.

Where Orbax keeps a step's metrics: a ``CheckpointManager`` with a ``best_fn``
writes them as the JSON item ``<step>/metrics/metrics``; ``_CHECKPOINT_METADATA``
also has a ``metrics`` field (empty unless set). The item wins when both exist.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from typing import Any

from objckpt.errors import FormatError
from objckpt.options import Options
from objckpt.roots.sweep import delete_objects
from objckpt.storage import ObjectInfo, Store
from objckpt.transfer import runtime

log = logging.getLogger("objckpt")

#: An Orbax step directory's name: the step number, as Orbax's default step naming writes it.
ORBAX_STEP = re.compile(r"^[0-9]{1,18}$")
STEP_METADATA = "_CHECKPOINT_METADATA"
COMMIT_FILE = "commit_success.txt"
#: Orbax's item holding a step's metrics (``CheckpointManager`` with a ``best_fn``), and its file.
METRICS_FILE = "metrics/metrics"
_METRICS_LIMIT = 16 << 20


def renames_to_commit(url: str) -> bool:
    """Whether Orbax commits a step at ``url`` by renaming its directory (local disk)."""
    return "://" not in url or url.startswith("file://")


def orbax_steps_in(objects: Iterable[ObjectInfo], url: str) -> list[int]:
    """The committed Orbax steps in one listing of the root at ``url``, ascending."""
    seen: dict[int, set[str]] = {}
    for obj in objects:
        head, slash, rest = obj.key.partition("/")
        if slash and rest in (STEP_METADATA, COMMIT_FILE) and ORBAX_STEP.match(head):
            seen.setdefault(int(head), set()).add(rest)
    need = {STEP_METADATA} if renames_to_commit(url) else {STEP_METADATA, COMMIT_FILE}
    return sorted(step for step, files in seen.items() if need <= files)


async def _exists(store: Store, key: str) -> bool:
    try:
        await store.head(key)
    except FileNotFoundError:  # ObjectNotFoundError is one
        return False
    return True


async def is_orbax_step(store: Store, step: int, objckpt_manifest: str) -> bool:
    """Whether ``step`` under the root ``store`` is Orbax's: Orbax committed it and objckpt did not
    (no ``objckpt_manifest``, the key of its own step's manifest). One HEAD for a step Orbax never wrote."""
    if not await _exists(store, f"{step}/{STEP_METADATA}"):
        return False
    if not renames_to_commit(store.url) and not await _exists(store, f"{step}/{COMMIT_FILE}"):
        return False
    return not await _exists(store, objckpt_manifest)


def orbax_step_at(store: Store, step: int, objckpt_manifest: str, options: Options, *, replicas: bool) -> bool:
    """:func:`is_orbax_step` for a manager. With ``replicas``, the root is asked with a short
    budget (:func:`~objckpt.restoring.locations.probing_store`), and a root that does not answer
    holds no Orbax step: objckpt's own restore then reads the step from the replicas."""
    if not replicas:
        return runtime.run_sync(is_orbax_step(store, step, objckpt_manifest))
    from objckpt.restoring.locations import probing_store
    from objckpt.transfer.retries import RetryingStore

    try:
        probe = probing_store(store, options) if isinstance(store, RetryingStore) else store
        return runtime.run_sync(is_orbax_step(probe, step, objckpt_manifest))
    except OSError as exc:  # StoreError, timeouts, refused connections (a missing key is answered inside)
        log.info("objckpt could not ask %s whether step %d is Orbax's (%s): reading objckpt's", store.url, step, exc)
        return False


async def orbax_metrics(store: Store, step: int) -> dict[str, Any]:
    """The metrics Orbax saved with ``step``: its ``metrics`` item, else the ``metrics`` field of
    its ``_CHECKPOINT_METADATA``, else none.

    Raises:
        FormatError: either file is not a JSON object (naming it).
    """
    for key, field in ((f"{step}/{METRICS_FILE}", None), (f"{step}/{STEP_METADATA}", "metrics")):
        try:
            raw = await store.get(key)
        except FileNotFoundError:
            continue
        where = f"{store.url}/{key}"
        if len(raw) > _METRICS_LIMIT:
            raise FormatError(f"{where} is {len(raw)} bytes: too large for Orbax metrics")
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise FormatError(f"{where} is not valid JSON: {exc}") from None
        value = doc.get(field) if field is not None and isinstance(doc, dict) else doc
        if field is not None and not value:
            continue  # the step metadata's field is empty unless set
        if not isinstance(value, dict):
            raise FormatError(f"{where}: Orbax metrics are not a JSON object")
        return dict(value)
    return {}


async def delete_orbax_step(store: Store, step: int) -> list[str]:
    """Delete the Orbax step ``step`` under the root ``store``: its commit files first (it stops
    being a committed step at once), then everything else under ``<step>/``. Returns the keys."""

    keys = [o.key for o in await store.list(f"{step}/")]
    first = [k for k in (f"{step}/{COMMIT_FILE}", f"{step}/{STEP_METADATA}") if k in keys]
    await delete_objects(store, first)
    await delete_objects(store, [k for k in keys if k not in first])
    log.info("objckpt deleted the Orbax step %d under %s (%d objects)", step, store.url, len(keys))
    return keys
