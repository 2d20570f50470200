"""The CPU kernel: query blocks over key tiles (the CPU flash op where a tile is fully visible or
diagonal, explicit scores under a block-sized mask otherwise), merged by log-sum-exp, with an exact
backward that recomputes each tile. Packed documents' tiles that no query's document reaches are
never computed."""

import math
from typing import NamedTuple

import torch

from torch_impl.attention.rule import mask_mod, repeat_kv
from torch_impl.layout import document_starts

# CPU tiles: query rows per block (and key rows per tile that needs a mask), measured fastest here
BLOCK = {"global": 1024, "window": 256, "masked": 512}


class Tile(NamedTuple):
    """Query rows [q0, q1) against key rows [k0, k1) (local indices) and how to mask them."""

    q0: int
    q1: int
    k0: int
    k1: int
    kind: str  # "full": every pair visible; "causal": the diagonal square; "masked": mask_mod's mask


def tile_plan(L, T, window, block, masked, spans=None):
    """Every tile of the attention, grouped by query block: a pure function of the shapes (and,
    for packed documents, of where they start).

    Query block [q0, q1) owns key rows [q0 + off, q1 + off) (off = T - L: its own positions),
    the "causal" diagonal tile; keys before those come in tiles of `block` rows going left, until
    the window or row 0 ends them. Without data masks (`masked` False) a tile every query fully
    sees is "full" and the full tiles of a block merge into one; with padding (or documents not
    given as spans) every tile is "masked" and keeps its `block` rows, so that no mask exceeds
    block x block. spans: per query block, (earliest, latest) key rows: the start of its first
    query's document (the least over the batch) and of its last query's (the most). Keys before
    `earliest` are in no query's document and get no tile; a tile from `latest` on lies in every
    query's document and stays unmasked; the tiles between are masked.
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
            if kind == "full" and tiles[-1].kind == "full":
                tiles[-1] = tiles[-1]._replace(k0=k0)
            else:
                tiles.append(Tile(q0, q1, k0, k1, kind))
            k1 = k0
        plan.append((q0, q1, tuple(tiles)))
    return tuple(plan)


def _tile_mask(tile, visible, dtype, device):
    """Additive float mask [B or 1, 1, q1-q0, k1-k0] (0: seen, -inf: not) and bool [.., q1-q0]: the
    rows that see some key of the tile."""
    rows = torch.arange(tile.q0, tile.q1, device=device)[None, :, None]
    cols = torch.arange(tile.k0, tile.k1, device=device)[None, None, :]
    batch = torch.arange(visible.batch, device=device)[:, None, None]
    seen = visible.rule(batch, None, rows, cols)  # bool [B or 1, nq, nk]
    mask = torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, -math.inf)
    return mask[:, None], seen.any(-1)[:, None]


def document_spans(documents, L, block):
    """tile_plan's spans from documents (int [B, T] per key row, the last L rows the queries'), or
    None where a document's ids are not one run (ids that decrease somewhere): then every tile is
    masked. One host read."""
    if documents.shape[1] > 1 and bool((documents[:, 1:] < documents[:, :-1]).any()):
        return None
    off, starts = documents.shape[1] - L, document_starts(documents)  # [B, T]
    firsts = [off + q0 for q0 in range(0, L, block)]
    lasts = [off + min(q0 + block, L) - 1 for q0 in range(0, L, block)]
    earliest = starts[:, firsts].amin(dim=0).tolist()
    latest = starts[:, lasts].amax(dim=0).tolist()
    return tuple(zip(earliest, latest, strict=True))


class _Visible(NamedTuple):
    rule: object  # mask_mod
    batch: int  # the mask's batch size: B with documents or padding, else 1


def _tile_forward(q, key, value, tile, visible, scale, groups):
    """(out [B, H, nq, D], lse [B, H, nq]) of one tile; rows that see no key: zeros and -inf."""
    k = repeat_kv(key[:, :, tile.k0 : tile.k1], groups)  # [B, H, nk, D]
    v = repeat_kv(value[:, :, tile.k0 : tile.k1], groups)  # [B, H, nk, D]
    if tile.kind != "masked":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, tile.kind == "causal", scale=scale
        )
    mask, seen = _tile_mask(tile, visible, q.dtype, q.device)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, attn_mask=mask, scale=scale
    )
    return out, lse.masked_fill(~seen, -math.inf)


def _merge(out, lse, tile_out, tile_lse):
    """Two partial attentions of the same queries over disjoint keys -> their attention over both."""
    merged = torch.logaddexp(lse, tile_lse)  # [B, H, nq]
    safe = merged.masked_fill(merged == -math.inf, 0)  # rows no key seen yet: both weights are 0
    out = out * (lse - safe).exp()[..., None] + tile_out * (tile_lse - safe).exp()[..., None]
    return out, merged


class TiledAttention(torch.autograd.Function):
    """Exact attention as query blocks over key tiles, with the memory of flash attention.

    Forward: 1. for every query block, each of its tiles through the fused CPU op, which returns
    the tile's output and log-sum-exp; 2. merge the tiles by log-sum-exp into the block's output;
    3. keep only the output and its log-sum-exp (masks are rebuilt, never saved).
    Backward: the same plan; each tile's fused backward op takes the *merged* output and log-sum-exp
    (so its softmax is the whole row's, as in torch's ring attention): dq adds up over the tiles,
    dk and dv over the query blocks (and a key head's query heads).
    """

    @staticmethod
    def forward(ctx, query, key, value, q_start, k_start, window, scale, documents, padding):
        B, H, L, D = query.shape
        groups = H // key.shape[1]
        masked = documents is not None or padding is not None  # masks that differ per row
        visible = _Visible(mask_mod(q_start, k_start, window, documents, padding), B if masked else 1)
        block = BLOCK["window" if window is not None else "masked" if masked else "global"]
        compiling = torch.compiler.is_compiling()  # document_spans reads the ids on the host
        spans = None if documents is None or compiling else document_spans(documents, L, block)
        masked_tiles = padding is not None or documents is not None and spans is None
        plan = tile_plan(L, key.shape[2], window, block, masked_tiles, spans)
        work = torch.float64 if query.dtype == torch.float64 else torch.float32  # merging precision
        out = query.new_empty(B, H, L, D)  # [B, H, L, D]
        lse = query.new_empty(B, H, L, dtype=work)  # [B, H, L]
        for q0, q1, tiles in plan:
            q = query[:, :, q0:q1]  # [B, H, nq, D]
            acc, acc_lse = None, None
            for tile in tiles:
                tile_out, tile_lse = _tile_forward(q, key, value, tile, visible, scale, groups)
                tile_out, tile_lse = tile_out.to(work), tile_lse.to(work)
                acc, acc_lse = (
                    (tile_out, tile_lse) if acc is None else _merge(acc, acc_lse, tile_out, tile_lse)
                )
            out[:, :, q0:q1] = acc
            lse[:, :, q0:q1] = acc_lse
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.plan, ctx.visible, ctx.scale = plan, visible, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse = ctx.saved_tensors
        B, Hkv, T, D = key.shape
        groups = query.shape[1] // Hkv
        lse = lse.masked_fill(lse == -math.inf, math.inf)  # rows that saw nothing: every weight 0
        grad_q, grad_k, grad_v = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
        for q0, q1, tiles in ctx.plan:
            q, g, o = query[:, :, q0:q1], grad[:, :, q0:q1].contiguous(), out[:, :, q0:q1]  # [B, H, nq, D]
            row_lse = lse[:, :, q0:q1]  # [B, H, nq]
            for tile in tiles:
                k = repeat_kv(key[:, :, tile.k0 : tile.k1], groups)  # [B, H, nk, D]
                v = repeat_kv(value[:, :, tile.k0 : tile.k1], groups)  # [B, H, nk, D]
                mask = None
                if tile.kind == "masked":
                    mask, _ = _tile_mask(tile, ctx.visible, query.dtype, query.device)
                dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    g, q, k, v, o, row_lse, 0.0, tile.kind == "causal", attn_mask=mask, scale=ctx.scale
                )
                grad_q[:, :, q0:q1] += dq
                grad_k[:, :, tile.k0 : tile.k1] += dk.unflatten(1, (Hkv, groups)).sum(2)  # [B, Hkv, nk, D]
                grad_v[:, :, tile.k0 : tile.k1] += dv.unflatten(1, (Hkv, groups)).sum(2)  # [B, Hkv, nk, D]
        return grad_q, grad_k, grad_v, None, None, None, None, None, None
