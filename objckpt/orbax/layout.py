"""What an Orbax checkpoint holds, from its small metadata files alone (no array data read).

Orbax (``StandardCheckpointer``, ``PyTreeCheckpointer``, a ``CheckpointManager``
item) writes, in one item directory:

* ``_METADATA``: the tree, one entry per leaf: its key path (``key_metadata``,
  each key a dict key or a sequence index) and its kind (``value_metadata``:
  ``jax.Array``, ``np.ndarray``, ``scalar``, ``string``), plus whether the
  arrays are in OCDBT (``use_ocdbt``) and zarr v3 (``use_zarr3``);
* ``_sharding``: each array leaf's sharding at save time, keyed by its
  base64-encoded parameter name (the key path joined by ``.``);
* ``_strings.json``: string leaves by parameter name;
* the arrays: one zarr array per parameter name, in an OCDBT database at the
  item root (``manifest.ocdbt``, ``ocdbt.process_N/``, ``d/``) or, without
  OCDBT, a directory per parameter.

A ``CheckpointManager`` root holds ``<step>/<item>/…`` (the default item is
``default``); a step directory with one item (besides the JSON ``metrics`` item
the manager writes with a ``best_fn``) is read as that item. Nothing
here trusts the files: every field is checked, and what cannot be read is a
:class:`~objckpt.errors.FormatError` naming the item and what is wrong.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from objckpt.errors import CheckpointNotFoundError, FormatError, ObjectNotFoundError
from objckpt.orbax.containment import check_array_name, check_item_name, check_local_item, read_small

#: Handlers whose items are a pytree of arrays, scalars and strings (what objckpt reads).
PYTREE_HANDLERS = ("StandardCheckpointHandler", "PyTreeCheckpointHandler")
_KINDS = {"jax.Array": "array", "np.ndarray": "array", "scalar": "scalar", "string": "string"}
_DICT_KEY, _SEQUENCE_KEY = 2, 1  # orbax's KeyType values
_LEAF = object()  # a leaf's place in a skeleton built only to check the key paths
#: Largest Orbax metadata file (or JSON item) objckpt reads.
METADATA_LIMIT = 64 << 20
#: Deepest key path a leaf may have (objckpt's own manifests allow the same nesting).
MAX_DEPTH = 256


@dataclass(frozen=True)
class OrbaxLeaf:
    """One leaf of an Orbax tree.

    ``path`` is the objckpt/JAX key path string (``['params']['w']``), ``name``
    Orbax's parameter name (``params.w``: the zarr array's path), ``kind``
    ``"array"``, ``"scalar"`` or ``"string"``; ``sharding`` the saved sharding
    as Orbax described it (a dict), when it did.
    """

    path: str
    name: str
    kind: str
    keys: tuple[Any, ...]
    sharding: dict[str, Any] | None = None


@dataclass(frozen=True)
class OrbaxItem:
    """One Orbax item: where it is, how its arrays are stored, its leaves and strings."""

    url: str
    leaves: list[OrbaxLeaf]
    use_ocdbt: bool
    use_zarr3: bool
    strings: dict[str, str] = field(default_factory=dict)
    created: str = ""  # when Orbax committed it (ISO 8601, UTC), when it said
    num_processes: int = 1  # processes that wrote arrays (array_metadatas/process_N)

    def skeleton(self, make_leaf: Callable[[int], Any]) -> Any:
        """The tree (dicts and lists, as saved) with ``make_leaf(i)`` for leaf ``i``.

        Raises:
            FormatError: two leaves' key paths disagree (a node both a list and a dict,
                or a leaf and a node); :func:`parse_item` checks this once.
        """
        root: Any = {}
        placed: set[int] = set()  # ids of the nodes made here (a leaf value may be a dict too)
        for i, leaf in enumerate(self.leaves):
            node = root
            for depth, (key, nxt) in enumerate(zip(leaf.keys, leaf.keys[1:], strict=False)):
                node = _child(self.url, leaf, node, key, [] if isinstance(nxt, int) else {}, placed, depth)
            last = leaf.keys[-1]
            if isinstance(node, list) != isinstance(last, int) or _slot_taken(node, last):
                raise FormatError(f"{self.url}/_METADATA: leaf {leaf.path} clashes with another leaf's key path")
            if isinstance(node, list):
                node.extend([None] * (last + 1 - len(node)))
            node[last] = make_leaf(i)
        return root


def _slot_taken(node: Any, key: Any) -> bool:
    if isinstance(node, list):
        return key < len(node) and node[key] is not None
    return key in node


def _child(url: str, leaf: OrbaxLeaf, node: Any, key: Any, empty: Any, placed: set[int], depth: int) -> Any:
    """``node[key]``, made ``empty`` if absent; a clash of kinds is a FormatError."""
    clash = FormatError(f"{url}/_METADATA: leaf {leaf.path} clashes with another leaf's key path at depth {depth}")
    if isinstance(node, list) != isinstance(key, int):
        raise clash
    if isinstance(node, list):
        node.extend([None] * (key + 1 - len(node)))
        child = node[key]
    else:
        child = node.get(key)
    if child is None:
        node[key] = child = empty
        placed.add(id(child))
    elif id(child) not in placed or isinstance(child, list) != isinstance(empty, list):
        raise clash
    return child


def metadata_json(data: bytes, what: str) -> Any:
    """An Orbax metadata document parsed; a FormatError naming ``what`` if too large or not JSON."""
    if len(data) > METADATA_LIMIT:
        raise FormatError(f"{what} is {len(data)} bytes: too large for Orbax metadata")
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormatError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:  # hostile nesting: deeper than Python's parser recurses
        raise FormatError(f"{what} nests too deeply to be Orbax metadata") from None


def parse_item(
    url: str, files: dict[str, bytes | None], *, step_metadata: bytes | None = None, num_processes: int = 1
) -> OrbaxItem:
    """An Orbax item from its metadata files (``_METADATA``, ``_CHECKPOINT_METADATA``,
    ``_sharding``, ``_strings.json``: content, or None where absent); ``step_metadata``
    is its step's ``_CHECKPOINT_METADATA`` when it is an item of a manager's step."""
    checkpoint_meta = files.get("_CHECKPOINT_METADATA")
    created = ""
    for raw_meta in (checkpoint_meta, step_metadata):
        if raw_meta is None:
            continue
        described = metadata_json(raw_meta, f"{url}/_CHECKPOINT_METADATA")
        if not isinstance(described, dict):
            continue
        handler = described.get("item_handlers")
        if isinstance(handler, str):  # a single-item checkpoint names its one handler
            _check_handler(url, handler)
        created = created or _iso(described.get("commit_timestamp_nsecs"))
    raw = files.get("_METADATA")
    if raw is None:
        raise FormatError(f"Orbax item {url} has no _METADATA (written by an Orbax older than 0.5?)")
    meta = metadata_json(raw, f"{url}/_METADATA")
    tree = meta.get("tree_metadata") if isinstance(meta, dict) else None
    if not isinstance(tree, dict):
        raise FormatError(f"{url}/_METADATA has no tree_metadata")
    shardings = _shardings(url, files.get("_sharding"))
    leaves = [_leaf(url, entry, shardings, len(tree)) for entry in tree.values()]
    use_ocdbt = bool(meta.get("use_ocdbt", False))
    if not use_ocdbt:  # each array is a directory <item>/<name>/ (in OCDBT a name is a key, not a path)
        for leaf in leaves:
            if leaf.kind in ("array", "scalar"):
                check_array_name(url, leaf.path, leaf.name)
    names = [leaf.name for leaf in leaves]
    if len(set(names)) != len(names):
        raise FormatError(f"{url}/_METADATA names a parameter twice")
    strings_raw = files.get("_strings.json")
    strings = metadata_json(strings_raw, f"{url}/_strings.json") if strings_raw is not None else {}
    if not isinstance(strings, dict) or not all(isinstance(v, str) for v in strings.values()):
        raise FormatError(f"{url}/_strings.json is not an object of strings")
    for leaf in leaves:
        if leaf.kind == "string" and leaf.name not in strings:
            raise FormatError(f"Orbax item {url}: string leaf {leaf.path} is missing from _strings.json")
    item = OrbaxItem(
        url=url,
        leaves=leaves,
        use_ocdbt=use_ocdbt,
        use_zarr3=bool(meta.get("use_zarr3", False)),
        strings=strings,
        created=created,
        num_processes=num_processes,
    )
    item.skeleton(lambda i: _LEAF)  # the key paths form one tree (FormatError naming a clash)
    return item


def _iso(nanoseconds: Any) -> str:
    import datetime as dt

    if not isinstance(nanoseconds, int) or isinstance(nanoseconds, bool) or nanoseconds <= 0:
        return ""
    return dt.datetime.fromtimestamp(nanoseconds / 1e9, dt.UTC).isoformat(timespec="seconds")


def _leaf(url: str, entry: Any, shardings: dict[str, dict[str, Any]], entries: int) -> OrbaxLeaf:
    """One tree entry; a sequence index must be below ``entries`` (the tree's entry count:
    Orbax records every element of a list, empty ones included, so no list is longer)."""
    if not isinstance(entry, dict):
        raise FormatError(f"{url}/_METADATA: a tree entry is not an object")
    keys_meta, value = entry.get("key_metadata"), entry.get("value_metadata")
    if not isinstance(keys_meta, list) or not keys_meta or not isinstance(value, dict):
        raise FormatError(f"{url}/_METADATA: a tree entry lacks key_metadata or value_metadata")
    if len(keys_meta) > MAX_DEPTH:
        raise FormatError(f"{url}/_METADATA: a key path {len(keys_meta)} keys deep (at most {MAX_DEPTH})")
    keys: list[Any] = []
    for key in keys_meta:
        k = key.get("key") if isinstance(key, dict) else None
        kind = key.get("key_type") if isinstance(key, dict) else None
        where = _path(keys) or "the root"
        if kind == _SEQUENCE_KEY:
            index = _index(k)
            if index is None or index >= entries:
                raise FormatError(
                    f"{url}/_METADATA: sequence key {_short(k)} under {where} is not an index below {entries}"
                    " (the tree's entry count)"
                )
            keys.append(index)
        elif isinstance(k, str):
            keys.append(k)
        else:
            raise FormatError(f"{url}/_METADATA: unsupported key {_short(key)} under {where}")
    path = _path(keys)
    value_type = value.get("value_type")
    kind = _KINDS.get(value_type) if isinstance(value_type, str) else None
    if kind is None:
        raise FormatError(f"Orbax item {url}: leaf {path} is a {_short(value_type)}, which objckpt does not read")
    if value.get("skip_deserialize"):
        kind = "skipped"
    name = ".".join(str(k) for k in keys)
    return OrbaxLeaf(path=path, name=name, kind=kind, keys=tuple(keys), sharding=shardings.get(name))


def _path(keys: list[Any]) -> str:
    """The leaf's path as ``jax.tree_util.keystr`` spells it (``['a'][0]``), without importing JAX:
    finding an Orbax checkpoint (``objckpt cp``, ``ls``) needs none."""
    return "".join(f"[{k!r}]" for k in keys)


def _index(key: Any) -> int | None:
    """A sequence key as Orbax writes it (a decimal string; an int is taken too), else None."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key if key >= 0 else None
    if isinstance(key, str) and 0 < len(key) <= 18 and key.isascii() and key.isdigit():
        return int(key)
    return None


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (hostile keys can be megabytes)."""
    text = repr(value) if not isinstance(value, (dict, list)) or len(value) < 16 else f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _shardings(url: str, raw: bytes | None) -> dict[str, dict[str, Any]]:
    """``_sharding``: base64 parameter name → the sharding's JSON description."""
    if raw is None:
        return {}
    table = metadata_json(raw, f"{url}/_sharding")
    out = {}
    if not isinstance(table, dict):
        raise FormatError(f"{url}/_sharding is not an object")
    for encoded, described in table.items():
        try:
            name = base64.urlsafe_b64decode(encoded.encode()).decode()
            value = json.loads(described) if isinstance(described, str) else described
        except (ValueError, UnicodeDecodeError, RecursionError):
            continue  # a sharding we cannot read only loses the description
        if _valid_sharding(value):
            out[name] = value
    return out


def _valid_sharding(value: Any) -> bool:
    """Whether a sharding description has the fields inspect and restore read, each of its type
    (a malformed one is dropped: it is a description, not data)."""
    if not isinstance(value, dict) or not isinstance(value.get("sharding_type", ""), str):
        return False
    if value.get("sharding_type") != "NamedSharding":
        return isinstance(value.get("device_str", ""), str)
    shape, axes, spec = value.get("shape", []), value.get("axis_names", []), value.get("partition_spec", [])
    return (
        isinstance(shape, list)
        and all(isinstance(n, int) and not isinstance(n, bool) for n in shape)
        and isinstance(axes, list)
        and all(isinstance(a, str) for a in axes)
        and isinstance(spec, list)
        and all(
            p is None or isinstance(p, str) or (isinstance(p, list) and all(isinstance(q, str) for q in p))
            for p in spec
        )
    )


def numpy_dtype(dtype: Any) -> np.dtype:
    """A tensorstore dtype as numpy's (bfloat16, float8, int4 through ml_dtypes, as JAX has them)."""
    return np.dtype(dtype.numpy_dtype)


async def read_item(
    store: Any, url: str, parent: Any = None, files: dict[str, bytes | None] | None = None
) -> OrbaxItem:
    """The Orbax item at ``store`` (an objckpt store at ``url``). A step directory of a
    ``CheckpointManager`` is read as its item when it has one, or one named ``default``;
    ``parent`` (the store one level up, if known) names the handler of an item
    directory that holds no pytree.

    Raises:
        CheckpointNotFoundError: nothing Orbax wrote is there.
        FormatError: the item cannot be read (naming it and why), or a step holds
            several items and none is ``default``.
    """
    files = files if files is not None else await metadata_files(store)
    if files.get("_METADATA") is not None:
        return parse_item(url, files, num_processes=await array_processes(store))
    handlers = item_handlers(url, files.get("_CHECKPOINT_METADATA"))
    if handlers:  # a step directory: {item: handler}
        items = sorted(k for k in handlers if not is_metrics_item(k, handlers[k]))  # the manager's metrics: no state
        name = "default" if "default" in handlers else items[0] if len(items) == 1 else None
        if name is None:
            raise FormatError(
                f"{url} is an Orbax step with items {', '.join(items)}: restore one of them ({url}/<item>)"
            )
        _check_handler(f"{url}/{name}", handlers[name])
        check_local_item(url, name)
        child = store.child(name)
        step_metadata = files.get("_CHECKPOINT_METADATA")
        return parse_item(
            f"{url}/{name}",
            await metadata_files(child),
            step_metadata=step_metadata,
            num_processes=await array_processes(child),
        )
    if parent is not None:
        name = url.rstrip("/").rsplit("/", 1)[-1]
        handler = item_handlers(url, (await metadata_files(parent)).get("_CHECKPOINT_METADATA")).get(name)
        if handler is not None:
            _check_handler(url, handler)
    raise CheckpointNotFoundError(f"no objckpt or Orbax checkpoint at {url}")


def item_handlers(url: str, raw: bytes | None) -> dict[str, str]:
    """A step's ``_CHECKPOINT_METADATA``: its items and the handler that wrote each (empty for an item's own)."""
    if raw is None:
        return {}
    handlers = metadata_json(raw, f"{url}/_CHECKPOINT_METADATA")
    handlers = handlers.get("item_handlers") if isinstance(handlers, dict) else None
    if not isinstance(handlers, dict):
        return {}
    for name in handlers:
        check_item_name(url, str(name))
    return {str(k): str(v) for k, v in handlers.items()}


def is_metrics_item(name: str, handler: str) -> bool:
    """Whether an item is the JSON ``metrics`` item Orbax's ``CheckpointManager`` writes beside the state."""
    return name == "metrics" and handler.endswith("JsonCheckpointHandler")


def _check_handler(url: str, handler: str) -> None:
    if not handler.endswith(PYTREE_HANDLERS):
        raise FormatError(
            f"Orbax item {url} was written by {handler}: objckpt reads the items of "
            f"{' and '.join(PYTREE_HANDLERS)} (a pytree of arrays, scalars and strings)"
        )


async def array_processes(store: Any) -> int:
    """How many processes wrote arrays (Orbax's ``array_metadatas/process_N``), at least 1."""
    try:
        listed = await store.list("array_metadatas/")
    except (ObjectNotFoundError, FileNotFoundError):
        return 1
    return max(1, sum(1 for info in listed if info.key.rsplit("/", 1)[-1].startswith("process_")))


async def metadata_files(store: Any) -> dict[str, bytes | None]:
    """The item's metadata files (None where absent), each read once its size is known to be
    within :data:`METADATA_LIMIT` (a FormatError naming the file otherwise)."""
    url = str(store.url).rstrip("/")
    names = ("_METADATA", "_CHECKPOINT_METADATA", "_sharding", "_strings.json")
    # All at once: probing a prefix that holds none (another layout's) costs one round trip, not four.
    found = await asyncio.gather(*(read_small(store, name, METADATA_LIMIT, f"{url}/{name}") for name in names))
    return dict(zip(names, found, strict=True))
