"""The CPU tiles' plan (torch_impl.attention.tiles): which key tiles each query block attends over
and how each tile is masked, a pure function of the shapes (and of where packed documents start),
made once per call and walked alike by the forward and the backward; a masked tile's mask, block by
block from the visibility rule. Packed documents' keys that no query's document reaches get no
tile; a tile inside every query's document stays unmasked."""

import math
from typing import NamedTuple

import torch

from torch_impl.attention.rule import mask_mod
from torch_impl.layout import document_starts

# CPU tiles: query rows per block (and key rows per tile that needs a mask), sizes chosen by timing
BLOCK = {"global": 1024, "window": 256, "masked": 512}


class Tile(NamedTuple):
    """Query rows [q0, q1) against key rows [k0, k1) (local indices) and how to mask them."""

    q0: int
    q1: int
    k0: int
    k1: int
    kind: str  # "full": every pair visible; "causal": the diagonal square; "masked": mask_mod's mask


def tile_plan(L, T, window, block, masked, spans=None, merge=True):
    """Every tile of the attention, grouped by query block: a pure function of the shapes (and,
    for packed documents, of where they start).

    Query block [q0, q1) owns key rows [q0 + off, q1 + off) (off = T - L: its own positions), the
    "causal" diagonal tile; keys before those come in tiles of `block` rows going left, until the
    window or row 0 ends them. Without data masks (`masked` False) a tile every query fully sees is
    "full" and the full tiles of a block merge into one (unless `merge` is False: explicit scores,
    each tile then keeps its `block` rows); with padding (or documents not given as spans) every
    tile is "masked" and keeps its `block` rows, so that no mask exceeds block x block. spans: per
    query block, (earliest, latest) key rows: the start of its first query's document (the least
    over the batch) and of its last query's (the most). Keys before `earliest` are in no query's
    document and get no tile; a tile from `latest` on lies in every query's document and stays
    unmasked; the tiles between are masked.
    Returns a tuple of (q0, q1, tiles) per query block.
    """
    off, plan = T - L, []
    for i, q0 in enumerate(range(0, L, block)):
        q1 = min(q0 + block, L)
        lo = 0 if window is None else max(0, q0 + off - window + 1)  # the first key any of them sees
        earliest, latest = (0, 0) if spans is None else spans[i]
        lo = max(lo, earliest)

        def cut(k0, latest=latest):  # some query of the block sees only part of the tile from k0
            return masked or k0 < latest

        banded = cut(q0 + off) or window is not None and q1 - q0 > window  # the window cuts the square too
        tiles = [Tile(q0, q1, q0 + off, q1 + off, "masked" if banded else "causal")]
        k1 = q0 + off
        while k1 > lo:
            k0 = max(lo, k1 - block)
            full = window is None or (q1 - 1 + off) - k0 < window  # the last query still sees k0
            kind = "full" if full and not cut(k0) else "masked"
            if merge and kind == "full" and tiles[-1].kind == "full":
                tiles[-1] = tiles[-1]._replace(k0=k0)
            else:
                tiles.append(Tile(q0, q1, k0, k1, kind))
            k1 = k0
        plan.append((q0, q1, tuple(tiles)))
    return tuple(plan)


def document_spans(documents, L, block, starts=None):
    """tile_plan's spans from documents (int [B, T] per key row, the last L rows the queries'), or
    None where a document's ids are not one run (ids that decrease somewhere): then every tile is
    masked. starts: int [B, L], the key row where each query's document begins (below 0: before
    the first key), where the caller has them (the documents then run in order, unread). One host
    read of 2 ints a query block."""
    if starts is None:
        if documents.shape[1] > 1 and bool((documents[:, 1:] < documents[:, :-1]).any()):
            return None
        starts = document_starts(documents)[:, documents.shape[1] - L :]  # [B, L]
    firsts = list(range(0, L, block))
    lasts = [min(q0 + block, L) - 1 for q0 in firsts]
    bounds = torch.stack([starts[:, firsts].amin(dim=0), starts[:, lasts].amax(dim=0)])  # [2, blocks]
    return tuple(zip(*bounds.clamp_min(0).tolist(), strict=True))


class Visible(NamedTuple):
    """The visibility rule of one call and the batch size of the masks made from it."""

    rule: object  # mask_mod
    batch: int  # the mask's batch size: B with documents or padding, else 1


def tile_mask(tile, visible, dtype, device):
    """Additive float mask [B or 1, 1, q1-q0, k1-k0] (0: seen, -inf: not) and bool [.., q1-q0]: the
    rows that see some key of the tile."""
    rows = torch.arange(tile.q0, tile.q1, device=device)[None, :, None]
    cols = torch.arange(tile.k0, tile.k1, device=device)[None, None, :]
    batch = torch.arange(visible.batch, device=device)[:, None, None]
    seen = visible.rule(batch, None, rows, cols)  # bool [B or 1, nq, nk]
    mask = torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, -math.inf)
    return mask[:, None], seen.any(-1)[:, None]


def plan_call(query, key, q_start, k_start, window, documents, padding, softcap, starts=None):
    """(tile_plan, Visible) of one call: the same in forward and backward (pure, one host read of
    the documents' spans where they run in order). starts: int [B, L], the global row where each
    query's document begins (causal_attention's `document_starts`), or None."""
    B, _, L, _ = query.shape
    masked = documents is not None or padding is not None  # masks that differ per row
    visible = Visible(mask_mod(q_start, k_start, window, documents, padding), B if masked else 1)
    block = BLOCK["window" if window is not None else "masked" if masked or softcap else "global"]
    local = None if starts is None else starts - k_start  # [B, L]: by key row
    spans = None if documents is None else document_spans(documents, L, block, local)
    masked_tiles = padding is not None or documents is not None and spans is None
    # soft-capped scores are explicit: every tile keeps its block rows, so none exceeds block^2
    return tile_plan(L, key.shape[2], window, block, masked_tiles, spans, merge=softcap is None), visible
