"""Which pieces each blob of a checkpoint holds: what every check of a blob starts from."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping

import numpy as np

from objckpt.core.format import Manifest, Piece
from objckpt.core.format.rows import LeafPieces, Rows

PieceRef = tuple[str, Piece]  # (leaf path, piece)


def pieces_by_blob(manifest: Manifest) -> Mapping[str, list[PieceRef]]:
    """Every piece of the manifest, grouped by the blob that holds it; each process's value of a
    ``per_process`` item counts as a piece (its bytes checked as a piece's are). Pieces read as
    rows (version 3 and later) are built blob by blob, when a blob's are asked for."""
    out: dict[str, list[PieceRef]] = defaultdict(list)
    rows = None
    for leaf in manifest.leaves:
        if isinstance(leaf.pieces, LeafPieces) and (rows is None or leaf.pieces.rows is rows):
            rows = leaf.pieces.rows
        else:
            for piece in leaf.pieces:
                out[piece.blob].append((leaf.path, piece))
        if leaf.kind == "per_process":
            for ref in leaf.value:
                if ref["length"]:
                    value = Piece((0,), (ref["length"],), ref["blob"], ref["offset"], ref["length"], ref["crc32c"])
                    out[ref["blob"]].append((leaf.path, value._replace(sha256=ref.get("sha256"))))
    return out if rows is None else _RowsByBlob(manifest, rows, dict(out))


class _RowsByBlob(Mapping[str, list[PieceRef]]):
    """:func:`pieces_by_blob` of rows: each blob's pieces built when asked for, not held."""

    def __init__(self, manifest: Manifest, rows: Rows, more: dict[str, list[PieceRef]]) -> None:
        self._paths = [leaf.path for leaf in manifest.leaves]
        self._rows, self._more = rows, more
        self._order = np.argsort(rows.blob, kind="stable")
        self._cuts = np.searchsorted(rows.blob[self._order], np.arange(len(rows.keys) + 1)).tolist()
        self._ids: dict[str, list[int]] = defaultdict(list)  # a base's blob is listed by each object referencing it
        for k, key in enumerate(rows.keys):
            if self._cuts[k + 1] > self._cuts[k]:
                self._ids[key].append(k)

    def __getitem__(self, key: str) -> list[PieceRef]:
        if key not in self._ids and key not in self._more:
            raise KeyError(key)
        parts = [self._order[self._cuts[k] : self._cuts[k + 1]] for k in self._ids.get(key, ())]
        at = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
        paths = map(self._paths.__getitem__, self._rows.leaf_of(at).tolist())
        return [*zip(paths, self._rows.pieces(at)), *self._more.get(key, ())]

    def __contains__(self, key: object) -> bool:
        return key in self._ids or key in self._more

    def __iter__(self) -> Iterator[str]:
        return iter({**self._ids, **self._more})

    def __len__(self) -> int:
        return len({**self._ids, **self._more})
