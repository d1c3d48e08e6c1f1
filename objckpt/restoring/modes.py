"""How one planned read lands (:class:`Mode`; streamed ones through :mod:`objckpt.restoring.scatter`),
decided once per read before it is issued, from the store's traits and the read's plan alone."""

from __future__ import annotations

import enum
from collections.abc import Mapping

from objckpt.core.plan import ReadRequest
from objckpt.restoring.aligned_reads import ResponseAlignment
from objckpt.restoring.leaf_plan import LeafPlan


class Mode(enum.Enum):
    """How one planned read lands (:func:`landing_mode`)."""

    STREAMED = "streamed"  # scattered into its boxes as it arrives; holds a few MiB, not its length
    COPIED = "copied"  # read whole into a buffer of its length, then copied into its boxes
    ADOPTED = "adopted"  # read whole into the store client's buffer, which becomes its boxes' arrays


def landing_mode(
    request: ReadRequest, plans: Mapping[int, LeafPlan], *, streams_reads: bool, reads_in_place: bool
) -> Mode:
    """How ``request`` lands, from the store's traits and the read alone.

    Adopted: the store fills its own buffer in place (``Store.reads_in_place``),
    the read is large enough to land at a predictable phase, and every part is a
    whole box placed box by box with no cast; such a read is no memory above the
    restored arrays. Otherwise a store that streams (``Store.streams_reads``)
    scatters the read as it arrives, and any other store's read is copied (a
    part that happens to land aligned is still adopted: :meth:`objckpt.restoring.landing.Landing.land`).
    """
    if any(plans[part.leaf].entry.codec is not None for part in request.parts):
        return Mode.COPIED  # compressed pieces are decoded whole once read (Landing.land)
    if reads_in_place and may_adopt(request, plans):
        return Mode.ADOPTED
    return Mode.STREAMED if streams_reads else Mode.COPIED


def may_adopt(request: ReadRequest, plans: Mapping[int, LeafPlan]) -> bool:
    """Whether every part of a planned read can be adopted if its bytes land aligned."""
    return request.length >= ResponseAlignment.LARGE and all(
        plans[part.leaf].whole_box(part.piece) for part in request.parts
    )
