"""Named non-array items of a saved tree: :class:`Json`, :class:`PerProcess` and :class:`Stateful` objects.

A training job's state is more than its arrays: the run's configuration, each
process's data-iterator position, objects with a serialisation of their own.
These classes mark such values anywhere in a pytree (they are pytree leaves):

- ``Json(value)``: a JSON document, kept inline in the root manifest (``kind
  "json"``), shown by ``inspect``, restorable without reading any blob. Its NaN
  and infinities come back as floats: the manifest is strict JSON, so each is
  stored as the string :data:`~objckpt.core.metadata.NON_FINITE` names and the
  leaf lists where those strings stand for floats (:func:`stored_document`).
- ``PerProcess(value)``: every process saves its own value (bytes, str or a
  JSON document) and each process restores its own (``kind "per_process"``);
  ``PerProcess(all=True)`` in a target returns every process's value, in
  saved process order.
- any object with ``state_dict()`` / ``load_state_dict(state)``
  (:class:`Stateful`): saved as what ``state_dict()`` returns (bytes as a
  ``bytes`` leaf, anything else as JSON); restored by calling the target
  object's ``load_state_dict``. Never pickle: the object serialises itself.

In a restore target, ``Json()`` and ``PerProcess()`` (no value) stand for what
was saved; a target item holding a :class:`Stateful` object gets it loaded.
This module holds the markers and the value ↔ bytes rules; no I/O, no JAX.
"""

from __future__ import annotations

import json
import math
from typing import Any, Protocol, runtime_checkable

from objckpt.core.metadata import MAX_DEPTH, NON_FINITE, to_json_value
from objckpt.core.strict import strict_json

#: The largest JSON document a ``json`` leaf holds (encoded, UTF-8); readers refuse larger.
JSON_MAX_BYTES = 1 << 20
#: The largest value one process saves in a ``per_process`` leaf; readers refuse larger.
PER_PROCESS_MAX_BYTES = 64 << 20
#: How a ``per_process`` value is stored: raw bytes, UTF-8 text, or a UTF-8 JSON document.
ENCODINGS = ("bytes", "str", "json")


class _Unset:
    """The value of a target's ``Json()`` / ``PerProcess()``: whatever was saved."""

    def __repr__(self) -> str:
        return "<saved>"


UNSET: Any = _Unset()


@runtime_checkable
class Stateful(Protocol):
    """An object that saves and restores itself (PyTorch DCP's protocol).

    ``state_dict()`` returns ``bytes`` or a JSON value (dict, list, str, int,
    float, bool, None; numpy scalars become numbers). On restore the target's
    object gets ``load_state_dict(state)`` with what was saved and is returned
    in the restored tree.
    """

    def state_dict(self) -> Any:
        """The object's state to save: ``bytes`` or a JSON value."""
        ...

    def load_state_dict(self, state: Any) -> Any:
        """Take back ``state``, as ``state_dict()`` returned it when saved; the return value is ignored."""
        ...


class Json:
    """A JSON document in the tree, stored inline in the root manifest (the primary process's
    value, as for every non-array leaf; each process's own: :class:`PerProcess`).

    Args:
        value: the document (dict, list, str, number, bool, None; tuples become lists,
            numpy scalars numbers) or a :class:`Stateful` object whose state is JSON.
            Left out in a restore target: stands for what was saved.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any = UNSET) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Json({self.value!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is Json and self.value == other.value

    __hash__ = None  # type: ignore[assignment]


class PerProcess:
    """A value every process saves for itself (a data iterator's state, a host's RNG).

    Args:
        value: this process's value: ``bytes``, ``str``, a JSON value or a
            :class:`Stateful` object. Left out in a restore target: this process's
            own saved value.
        all: in a restore target, the list of every process's value, in saved
            process order (to re-split a data pipeline over another number of processes).
    """

    __slots__ = ("value", "all")

    def __init__(self, value: Any = UNSET, *, all: bool = False) -> None:  # noqa: A002 (the issue's public name)
        if all and value is not UNSET and not is_stateful(value):
            raise ValueError("PerProcess(all=True) is a restore target: it takes no value")
        self.value = value
        self.all = all

    def __repr__(self) -> str:
        return "PerProcess(all=True)" if self.all else f"PerProcess({self.value!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is PerProcess and (self.value, self.all) == (other.value, other.all)

    __hash__ = None  # type: ignore[assignment]


def is_stateful(value: Any) -> bool:
    """Whether ``value`` is a :class:`Stateful` object (its class has both methods).

    Why not ``isinstance(value, Stateful)``: a protocol check costs microseconds, and every
    leaf of every save and restore target is asked.
    """
    cls = type(value)
    return hasattr(cls, "load_state_dict") and hasattr(cls, "state_dict") and not isinstance(value, type)


def is_item(value: Any) -> bool:
    """Whether a tree leaf is one of this module's items (a marker or a :class:`Stateful` object)."""
    cls = type(value)
    return cls is Json or cls is PerProcess or is_stateful(value)


def state_of(value: Any, path: str) -> Any:
    """What a saved value stands for: a :class:`Stateful` object's ``state_dict()``, else the value."""
    if is_stateful(value):
        state = value.state_dict()
        if is_stateful(state):
            raise TypeError(f"leaf {path}: state_dict() returned another stateful object")
        return state
    return value


def json_document(value: Any, path: str) -> tuple[Any, bytes]:
    """``value`` as plain JSON, and its encoding; refused when it has no JSON form or is too large.

    The plain document keeps NaN and infinities as floats; the encoding writes them as the
    tokens ``NaN``, ``Infinity`` and ``-Infinity`` (what :func:`decode_value` reads back).
    The size cap counts the document as the manifest stores it (:func:`stored_document`).

    Raises:
        TypeError: a part of ``value`` has no JSON form (its key path named).
        ValueError: the document nests deeper than :data:`~objckpt.core.metadata.MAX_DEPTH`
            (or contains itself), or its stored form is over :data:`JSON_MAX_BYTES`.
    """
    try:
        plain = to_json_value(value, path, non_finite=True)
    except TypeError as e:
        raise TypeError(f"leaf {path}: not a JSON document: {e}") from None
    except ValueError as e:
        raise ValueError(f"leaf {path}: not a JSON document: {e}") from None
    stored, floats = stored_document(plain)
    size = stored_size(stored, floats)
    if size > JSON_MAX_BYTES:
        raise ValueError(
            f"leaf {path}: the JSON document is {size} bytes, over the {JSON_MAX_BYTES}-byte cap of a"
            " Json item (store large data as arrays or bytes)"
        )
    return plain, json.dumps(plain, separators=(",", ":")).encode()


def stored_document(document: Any) -> tuple[Any, list[list[str | int]]]:
    """A plain document as strict JSON holds it: each NaN or infinity replaced by its string in
    :data:`~objckpt.core.metadata.NON_FINITE`, and the key path of each (a list of object keys
    and list positions), in document order. No non-finite float: the document itself and ``[]``."""
    floats: list[list[str | int]] = []

    def walk(value: Any, at: list[str | int]) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            floats.append(list(at))
            return NON_FINITE[repr(value)]
        if isinstance(value, dict):
            return {k: walk(v, [*at, str(k)]) for k, v in value.items()}
        return [walk(v, [*at, i]) for i, v in enumerate(value)] if isinstance(value, list) else value

    stored = walk(document, [])
    return (stored if floats else document), floats


def stored_size(stored: Any, floats: list[list[str | int]]) -> int:
    """The bytes a ``json`` leaf counts against :data:`JSON_MAX_BYTES`: its stored document's
    compact encoding, plus its list of floats' when it has one."""
    size = len(json.dumps(stored, separators=(",", ":")).encode())
    return size + (len(json.dumps(floats, separators=(",", ":")).encode()) if floats else 0)


def document_from_stored(stored: Any, floats: Any) -> Any:
    """The inverse of :func:`stored_document`: the strings at the key paths ``floats`` as floats.

    ``stored`` comes from a parsed manifest and is changed in place.

    Raises:
        ValueError: ``floats`` is not a list of key paths, or one does not lead to one of the
            strings (a path of the wrong type, a missing key, a position past a list's end,
            another value, the same path twice).
    """
    if not isinstance(floats, list) or not floats:
        raise ValueError("must be a non-empty list of key paths")
    names = {text: float(text) for text in NON_FINITE.values()}
    for j, at in enumerate(floats):
        if not isinstance(at, list) or len(at) > MAX_DEPTH:
            raise ValueError(f"[{j}] is not a key path (a list of at most {MAX_DEPTH} keys and positions)")
        parent: Any = None
        node = stored
        for key in at:
            ok = (type(key) is str and isinstance(node, dict) and key in node) or (
                type(key) is int and isinstance(node, list) and 0 <= key < len(node)
            )
            if not ok:
                raise ValueError(f"[{j}] {json.dumps(at)[:200]} leads nowhere in the document")
            parent, node = node, node[key]
        if type(node) is not str or node not in names:
            raise ValueError(f"[{j}] {json.dumps(at)[:200]} does not lead to 'NaN', 'Infinity' or '-Infinity'")
        if parent is None:
            stored = names[node]
        else:
            parent[at[-1]] = names[node]
    return stored


def encode_value(value: Any, path: str) -> tuple[bytes, str]:
    """One process's value of a ``PerProcess`` item as (bytes, encoding)."""
    state = state_of(value, path)
    if isinstance(state, (bytes, bytearray, memoryview)):
        data, encoding = bytes(state), "bytes"
    elif isinstance(state, str):
        data, encoding = state.encode(), "str"
    else:
        data, encoding = json_document(state, path)[1], "json"
    if len(data) > PER_PROCESS_MAX_BYTES:
        raise ValueError(f"leaf {path}: this process's value is {len(data)} bytes, over {PER_PROCESS_MAX_BYTES}")
    return data, encoding


def decode_value(data: bytes, encoding: str) -> Any:
    """The inverse of :func:`encode_value` (``encoding`` already checked).

    Raises:
        ValueError: the bytes are not valid UTF-8 or JSON for their encoding.
    """
    if encoding == "bytes":
        return data
    return data.decode() if encoding == "str" else strict_json(data, "the JSON value", non_finite=True)


def load_into(target: Any, state: Any) -> Any:
    """What a restore returns for a target item given its saved ``state``: a
    :class:`Stateful` target (or one inside the marker) gets ``load_state_dict(state)``
    and is returned; any other target gets ``state`` itself."""
    holder = target.value if type(target) in (Json, PerProcess) else target
    if is_stateful(holder):
        holder.load_state_dict(state)
        return holder
    return state
