"""Which pieces each blob of a checkpoint holds: what every check of a blob starts from."""

from __future__ import annotations

from collections import defaultdict

from objckpt.core.format import Manifest, Piece

PieceRef = tuple[str, Piece]  # (leaf path, piece)


def pieces_by_blob(manifest: Manifest) -> dict[str, list[PieceRef]]:
    """Every piece of the manifest, grouped by the blob that holds it; each process's value of a
    ``per_process`` item counts as a piece (its bytes checked as a piece's are)."""
    out: dict[str, list[PieceRef]] = defaultdict(list)
    for leaf in manifest.leaves:
        for piece in leaf.pieces:
            out[piece.blob].append((leaf.path, piece))
        if leaf.kind == "per_process":
            for ref in leaf.value:
                if ref["length"]:
                    value = Piece((0,), (ref["length"],), ref["blob"], ref["offset"], ref["length"], ref["crc32c"])
                    out[ref["blob"]].append((leaf.path, value._replace(sha256=ref.get("sha256"))))
    return out
