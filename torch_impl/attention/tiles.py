"""The CPU kernel: query blocks over key tiles (the CPU flash op where a tile is fully visible or
diagonal, under a block-sized mask otherwise; explicit block-sized scores where they are
soft-capped), merged by log-sum-exp, attention sinks joined to the merged denominator, with an
exact backward that recomputes each tile. Packed documents' tiles that no query's document
reaches are never computed."""

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


def _tile_forward(q, key, value, tile, visible, scale, groups, softcap, work):
    """(out [B, H, nq, D], lse [B, H, nq]) of one tile; rows that see no key: zeros and -inf."""
    k = repeat_kv(key[:, :, tile.k0 : tile.k1], groups)  # [B, H, nk, D]
    v = repeat_kv(value[:, :, tile.k0 : tile.k1], groups)  # [B, H, nk, D]
    if softcap is not None:
        scores, _ = _capped_scores(q, k, tile, visible, scale, softcap, work)  # [B, H, nq, nk]
        lse = scores.logsumexp(-1)  # [B, H, nq]
        weights = scores.sub_(lse.masked_fill(lse == -math.inf, 0)[..., None]).exp_()  # [B, H, nq, nk]
        return weights @ v.to(work), lse
    if tile.kind != "masked":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, tile.kind == "causal", scale=scale
        )
    mask, seen = _tile_mask(tile, visible, q.dtype, q.device)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, attn_mask=mask, scale=scale
    )
    return out, lse.masked_fill(~seen, -math.inf)


def _capped_scores(q, k, tile, visible, scale, softcap, work):
    """One tile's soft-capped scores cap * tanh(q.k * scale / cap), -inf where unseen ([B, H, nq, nk]
    in the working dtype), and the tanh itself (its derivative, 1 - tanh^2, is backward's)."""
    capped = (q.to(work) @ k.to(work).transpose(-1, -2)).mul_(scale / softcap).tanh_()  # [B, H, nq, nk]
    mask, _ = _tile_mask(tile, visible, work, q.device)  # [B or 1, 1, nq, nk]: 0 or -inf
    return (capped * softcap).add_(mask), capped


def _capped_backward(g, q, k, v, rows, row_lse, tile, visible, scale, softcap, work):
    """(dq, dk, dv) of one soft-capped tile, its softmax the merged row's: with P = exp(S - lse)
    (S the capped scores) and rows = rowsum(dO * out) ([B, H, nq, 1]), dV = P^T dO,
    dS = P * (dO V^T - rows), and through the cap d(q.k * scale) = dS * (1 - tanh^2):
    dQ = that K * scale, dK = its transpose Q * scale."""
    q, k, v, g = q.to(work), k.to(work), v.to(work), g.to(work)
    scores, capped = _capped_scores(q, k, tile, visible, scale, softcap, work)  # [B, H, nq, nk]
    weights = scores.sub_(row_lse[..., None]).exp_()  # [B, H, nq, nk]
    dscores = (g @ v.transpose(-1, -2)).sub_(rows).mul_(weights)  # [B, H, nq, nk]
    dscores.mul_(capped.square_().neg_().add_(1)).mul_(scale)  # d(q.k): through tanh and the scale
    return dscores @ k, dscores.transpose(-1, -2) @ q, weights.transpose(-1, -2) @ g


def _merge(out, lse, tile_out, tile_lse):
    """Two partial attentions of the same queries over disjoint keys -> their attention over both."""
    merged = torch.logaddexp(lse, tile_lse)  # [B, H, nq]
    safe = merged.masked_fill(merged == -math.inf, 0)  # rows no key seen yet: both weights are 0
    out = out * (lse - safe).exp()[..., None] + tile_out * (tile_lse - safe).exp()[..., None]
    return out, merged


class TiledAttention(torch.autograd.Function):
    """Exact attention as query blocks over key tiles, with the memory of flash attention.

    Forward: 1. for every query block, each of its tiles through the fused CPU op (soft-capped:
    explicit scores of at most a block square), which returns the tile's output and log-sum-exp;
    2. merge the tiles by log-sum-exp into the block's output; 3. sinks (a logit s_h per query head
    that joins every row's softmax denominator and contributes no value): lse' = logaddexp(lse,
    s_h), out' = out * exp(lse - lse') (= out * sigmoid(lse - s_h)); 4. keep only out' and lse'
    (masks are rebuilt, never saved).
    Backward: the same plan; each tile's backward takes the *merged* out' and lse' (so its softmax is
    the whole row's, sink included, as in torch's ring attention): with P' = exp(S - lse'),
    dS = P' * (dO V^T - rowsum(dO * out')), exact with a sink too since rowsum(dO * out') is the row's
    sum of P' dO V^T; dq adds up over the tiles, dk and dv over the query blocks (and a key head's
    query heads). The sink's weight is exp(s_h - lse') and its logit's gradient
    -sum over rows of exp(s_h - lse') * rowsum(dO * out').
    """

    @staticmethod
    def forward(ctx, query, key, value, q_start, k_start, window, scale, documents, padding, softcap, sinks):
        B, H, L, D = query.shape
        groups = H // key.shape[1]
        masked = documents is not None or padding is not None  # masks that differ per row
        visible = _Visible(mask_mod(q_start, k_start, window, documents, padding), B if masked else 1)
        block = BLOCK["window" if window is not None else "masked" if masked or softcap else "global"]
        compiling = torch.compiler.is_compiling()  # document_spans reads the ids on the host
        spans = None if documents is None or compiling else document_spans(documents, L, block)
        # soft-capped scores are explicit: every tile keeps its block rows, so none exceeds block^2
        masked_tiles = padding is not None or softcap is not None or documents is not None and spans is None
        plan = tile_plan(L, key.shape[2], window, block, masked_tiles, spans)
        work = torch.float64 if query.dtype == torch.float64 else torch.float32  # merging precision
        out = query.new_empty(B, H, L, D)  # [B, H, L, D]
        lse = query.new_empty(B, H, L, dtype=work)  # [B, H, L]
        for q0, q1, tiles in plan:
            q = query[:, :, q0:q1]  # [B, H, nq, D]
            acc, acc_lse = None, None
            for tile in tiles:
                tile_out, tile_lse = _tile_forward(q, key, value, tile, visible, scale, groups, softcap, work)
                tile_out, tile_lse = tile_out.to(work), tile_lse.to(work)
                acc, acc_lse = (
                    (tile_out, tile_lse) if acc is None else _merge(acc, acc_lse, tile_out, tile_lse)
                )
            if sinks is not None:
                with_sink = torch.logaddexp(acc_lse, sinks.to(work)[None, :, None])  # [B, H, nq]
                acc, acc_lse = acc * (acc_lse - with_sink).exp()[..., None], with_sink
            out[:, :, q0:q1] = acc
            lse[:, :, q0:q1] = acc_lse
        ctx.save_for_backward(query, key, value, out, lse, sinks)
        ctx.plan, ctx.visible, ctx.scale, ctx.softcap, ctx.work = plan, visible, scale, softcap, work
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse, sinks = ctx.saved_tensors
        B, Hkv, T, D = key.shape
        groups = query.shape[1] // Hkv
        lse = lse.masked_fill(lse == -math.inf, math.inf)  # rows that saw nothing: every weight 0
        grad_q, grad_k, grad_v = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
        for q0, q1, tiles in ctx.plan:
            q, g, o = query[:, :, q0:q1], grad[:, :, q0:q1].contiguous(), out[:, :, q0:q1]  # [B, H, nq, D]
            row_lse = lse[:, :, q0:q1]  # [B, H, nq]
            if ctx.softcap is not None:
                rows = (g.to(ctx.work) * o.to(ctx.work)).sum(-1, keepdim=True)  # [B, H, nq, 1]
            for tile in tiles:
                k = repeat_kv(key[:, :, tile.k0 : tile.k1], groups)  # [B, H, nk, D]
                v = repeat_kv(value[:, :, tile.k0 : tile.k1], groups)  # [B, H, nk, D]
                if ctx.softcap is not None:
                    dq, dk, dv = _capped_backward(
                        g, q, k, v, rows, row_lse, tile, ctx.visible, ctx.scale, ctx.softcap, ctx.work
                    )
                else:
                    mask = None
                    if tile.kind == "masked":
                        mask, _ = _tile_mask(tile, ctx.visible, query.dtype, query.device)
                    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                        g, q, k, v, o, row_lse, 0.0, tile.kind == "causal", attn_mask=mask, scale=ctx.scale
                    )
                grad_q[:, :, q0:q1] += dq
                grad_k[:, :, tile.k0 : tile.k1] += dk.unflatten(1, (Hkv, groups)).sum(2)  # [B, Hkv, nk, D]
                grad_v[:, :, tile.k0 : tile.k1] += dv.unflatten(1, (Hkv, groups)).sum(2)  # [B, Hkv, nk, D]
        grad_sinks = None
        if sinks is not None and ctx.needs_input_grad[10]:
            rows = (grad.to(ctx.work) * out.to(ctx.work)).sum(-1)  # [B, H, L]: rowsum(dO * out')
            weight = (sinks.to(ctx.work)[None, :, None] - lse).exp()  # [B, H, L]: the sink's weight
            grad_sinks = -(weight * rows).sum((0, 2)).to(sinks.dtype)  # [H]
        return grad_q, grad_k, grad_v, None, None, None, None, None, None, None, grad_sinks
