"""Which pieces each blob of a checkpoint holds: what every check of a blob starts from."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping

import numpy as np

from objckpt.core.format import Manifest, Piece
from objckpt.core.format.index3_bounds import BYTES_LIMIT
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


def pieces_up_to(by_blob: Mapping[str, list[PieceRef]], key: str, size: int) -> tuple[list[PieceRef], int, set[str]]:
    """The pieces of blob ``key``, of rows only those that end within its first ``size`` bytes built,
    and the count and leaves of the rows left out: a short blob costs no piece past its end."""
    return by_blob.up_to(key, size) if isinstance(by_blob, _RowsByBlob) else (by_blob.get(key, []), 0, set())


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
        return self.up_to(key, BYTES_LIMIT)[0]

    def up_to(self, key: str, size: int) -> tuple[list[PieceRef], int, set[str]]:
        parts = [self._order[self._cuts[k] : self._cuts[k + 1]] for k in self._ids.get(key, ())]
        at = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
        fits = self._rows.offset[at].astype(np.int64) + self._rows.length(at) <= size
        cut = {self._paths[i] for i in np.unique(self._rows.leaf_of(at[~fits])).tolist()}
        paths = map(self._paths.__getitem__, self._rows.leaf_of(at[fits]).tolist())
        return [*zip(paths, self._rows.pieces(at[fits])), *self._more.get(key, ())], int((~fits).sum()), cut

    def __contains__(self, key: object) -> bool:
        return key in self._ids or key in self._more

    def __iter__(self) -> Iterator[str]:
        return iter({**self._ids, **self._more})

    def __len__(self) -> int:
        return len({**self._ids, **self._more})
