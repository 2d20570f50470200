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
    if softcap is not None:
        return _capped_forward(q, key, value, tile, visible, scale, softcap, work)
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


# --- soft-capped tiles: explicit scores, a key head's query heads stacked into one matrix ----------
# S = cap * tanh(x / cap) (x = q.k * scale) is computed as cap * (2 sigmoid(2x / cap) - 1), the same
# function, as CPU sigmoid is faster than tanh; S's rounding grows from u |S| to
# about 3u cap (2u cap from the subtraction), each weight exp(S - lse) by as much, relative.


def _grouped(t, Hkv):
    """[B, H, n, ...] -> [B, Hkv, groups * n, ...]: each key head's query heads' rows stacked."""
    return t.unflatten(1, (Hkv, -1)).flatten(2, 3)


def _ungrouped(t, groups):
    """[B, Hkv, groups * n, ...] -> [B, H, n, ...], _grouped's inverse."""
    return t.unflatten(2, (groups, -1)).flatten(1, 2)


def _hide_unseen(t, tile, visible):
    """t ([B, Hkv, groups * nq, nk], a tile's scores or exponents) -inf, in place, where its
    queries do not see its keys; returns t."""
    if tile.kind != "full":
        mask, _ = _tile_mask(tile, visible, t.dtype, t.device)  # [B or 1, 1, nq, nk]: 0 or -inf
        t.unflatten(2, (-1, tile.q1 - tile.q0)).add_(mask[:, :, None])  # every query head alike
    return t


def _sigmoids(q, key, tile, scale, softcap, work):
    """sigmoid(2x / cap) of one tile ([B, Hkv, groups * nq, nk]; S = cap * (2 that - 1)), for
    q [B, H, nq, D] and key [B, Hkv, T, D]."""
    k = key[:, :, tile.k0 : tile.k1].to(work)  # [B, Hkv, nk, D]
    q = _grouped(q.to(work), key.shape[1]) * (2 * scale / softcap)  # [B, Hkv, g * nq, D]
    return (q @ k.transpose(-1, -2)).sigmoid_()


def _capped_forward(q, key, value, tile, visible, scale, softcap, work):
    """(out [B, H, nq, D], lse [B, H, nq]) of a soft-capped tile, in `work`; rows that see no key:
    zeros and -inf."""
    groups = q.shape[1] // key.shape[1]
    sig = _hide_unseen(_sigmoids(q, key, tile, scale, softcap, work), tile, visible)  # [B, Hkv, g*nq, nk]
    most = sig.amax(-1, keepdim=True)  # [B, Hkv, g * nq, 1]: the largest sigmoid, -inf if none seen
    most.masked_fill_(most == -math.inf, 0.5)  # rows that see nothing: every weight exp(-inf) = 0
    weights = torch.add(most * (-2 * softcap), sig, alpha=2 * softcap, out=sig).exp_()  # exp(S - max S)
    total = weights.sum(-1, keepdim=True)  # [B, Hkv, g * nq, 1]
    v = value[:, :, tile.k0 : tile.k1].to(work)  # [B, Hkv, nk, D]
    out = (weights @ v).div_(total.clamp_min(torch.finfo(work).tiny))  # [B, Hkv, g * nq, D]
    lse = most.mul_(2 * softcap).sub_(softcap).add_(total.log())  # max S + log(total)
    return _ungrouped(out, groups), _ungrouped(lse.squeeze(-1), groups)


def _capped_backward(g, q, key, value, rows, row_lse, tile, visible, scale, softcap, work):
    """(dq [B, H, nq, D], dk, dv [B, Hkv, nk, D]) of one soft-capped tile, its softmax the merged
    row's: with P = exp(S - lse) and rows = rowsum(dO * out) ([B, H, nq, 1]), dV = P^T dO,
    dS = P * (dO V^T - rows), and through the cap dx = dS * (1 - tanh^2) = dS * 4 sig (1 - sig)
    (sig = sigmoid(2x / cap), x = q.k * scale): dQ = dx K * scale, dK = dx^T Q * scale (summed over
    a key head's query heads)."""
    Hkv, groups = key.shape[1], q.shape[1] // key.shape[1]
    g, rows, row_lse = (_grouped(t.to(work), Hkv) for t in (g, rows, row_lse))  # [B, Hkv, g * nq, ..]
    sig = _sigmoids(q, key, tile, scale, softcap, work)  # [B, Hkv, g * nq, nk], unmasked
    exponent = torch.add((row_lse + softcap)[..., None].neg(), sig, alpha=2 * softcap)  # S - lse
    weights = _hide_unseen(exponent, tile, visible).exp_()  # P
    v = value[:, :, tile.k0 : tile.k1].to(work)  # [B, Hkv, nk, D]
    dscores = (g @ v.transpose(-1, -2)).sub_(rows).mul_(weights)  # dS
    dscores.mul_(sig.addcmul_(sig, sig, value=-1))  # dx / 4: dS * sig (1 - sig)
    k = key[:, :, tile.k0 : tile.k1].to(work)  # [B, Hkv, nk, D]
    q = _grouped(q.to(work), Hkv)  # [B, Hkv, g * nq, D]
    dq = _ungrouped((dscores @ k).mul_(4 * scale), groups)  # [B, H, nq, D]
    return dq, (dscores.transpose(-1, -2) @ q).mul_(4 * scale), weights.transpose(-1, -2) @ g


def _merge(out, lse, tile_out, tile_lse):
    """Two partial attentions of the same queries over disjoint keys -> their attention over both."""
    merged = torch.logaddexp(lse, tile_lse)  # [B, H, nq]
    safe = merged.masked_fill(merged == -math.inf, 0)  # rows no key seen yet: both weights are 0
    out = out * (lse - safe).exp()[..., None] + tile_out * (tile_lse - safe).exp()[..., None]
    return out, merged


def _plan(query, key, q_start, k_start, window, documents, padding, softcap):
    """(tile_plan, _Visible) of one call: the same in forward and backward (pure, one host read of
    the documents where they run in order)."""
    B, _, L, _ = query.shape
    masked = documents is not None or padding is not None  # masks that differ per row
    visible = _Visible(mask_mod(q_start, k_start, window, documents, padding), B if masked else 1)
    block = BLOCK["window" if window is not None else "masked" if masked or softcap else "global"]
    spans = None if documents is None else document_spans(documents, L, block)
    masked_tiles = padding is not None or documents is not None and spans is None
    # soft-capped scores are explicit: every tile keeps its block rows, so none exceeds block^2
    return tile_plan(L, key.shape[2], window, block, masked_tiles, spans, merge=softcap is None), visible


def _work(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32  # merging precision


@torch.library.custom_op("torch_impl::tiled_attention", mutates_args=())
def tiled_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_start: int,
    k_start: int,
    window: int | None,
    scale: float,
    documents: torch.Tensor | None,
    padding: torch.Tensor | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention as query blocks over key tiles, with the memory of flash attention: one op
    (torch.library), so that torch.compile keeps it whole and activation checkpointing can keep its
    output (hf.checkpoint_kwargs() does) instead of running it again.

    Forward: 1. for every query block, each of its tiles through the fused CPU op (soft-capped:
    explicit scores of at most a block square), which returns the tile's output and log-sum-exp;
    2. merge the tiles by log-sum-exp into the block's output; 3. sinks (a logit s_h per query head
    that joins every row's softmax denominator and contributes no value): lse' = logaddexp(lse,
    s_h), out' = out * exp(lse - lse') (= out * sigmoid(lse - s_h)); 4. return out' [B, H, L, D]
    and lse' [B, H, L] (float32, float64 for float64 inputs): masks are rebuilt, never saved. lse'
    is for the backward; `causal_attention` returns out' alone (no gradient flows into lse').
    Backward (`tiled_attention_backward`): the same plan; each tile's backward takes the *merged*
    out' and lse' (so its softmax is the whole row's, sink included, as in torch's ring attention):
    with P' = exp(S - lse'), dS = P' * (dO V^T - rowsum(dO * out')), exact with a sink too since
    rowsum(dO * out') is the row's sum of P' dO V^T; dq adds up over the tiles, dk and dv over the
    query blocks (and a key head's query heads). The sink's weight is exp(s_h - lse') and its
    logit's gradient -sum over rows of exp(s_h - lse') * rowsum(dO * out').
    """
    B, H, L, D = query.shape
    groups = H // key.shape[1]
    plan, visible = _plan(query, key, q_start, k_start, window, documents, padding, softcap)
    work = _work(query.dtype)
    out = query.new_empty(B, H, L, D)  # [B, H, L, D]
    lse = query.new_empty(B, H, L, dtype=work)  # [B, H, L]
    for q0, q1, tiles in plan:
        q = query[:, :, q0:q1]  # [B, H, nq, D]
        acc, acc_lse = None, None
        for tile in tiles:
            tile_out, tile_lse = _tile_forward(q, key, value, tile, visible, scale, groups, softcap, work)
            tile_out, tile_lse = tile_out.to(work), tile_lse.to(work)
            acc, acc_lse = (tile_out, tile_lse) if acc is None else _merge(acc, acc_lse, tile_out, tile_lse)
        if sinks is not None:
            with_sink = torch.logaddexp(acc_lse, sinks.to(work)[None, :, None])  # [B, H, nq]
            acc, acc_lse = acc * (acc_lse - with_sink).exp()[..., None], with_sink
        out[:, :, q0:q1] = acc
        lse[:, :, q0:q1] = acc_lse
    return out, lse


@tiled_attention.register_fake
def _(query, key, value, q_start, k_start, window, scale, documents, padding, softcap, sinks):
    return query.new_empty(query.shape), query.new_empty(query.shape[:3], dtype=_work(query.dtype))


@torch.library.custom_op("torch_impl::tiled_attention_backward", mutates_args=())
def tiled_attention_backward(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_start: int,
    k_start: int,
    window: int | None,
    scale: float,
    documents: torch.Tensor | None,
    padding: torch.Tensor | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_q, grad_k, grad_v, grad_sinks) of `tiled_attention` (its docstring states them);
    grad_sinks is empty without sinks."""
    B, Hkv, T, D = key.shape
    groups = query.shape[1] // Hkv
    plan, visible = _plan(query, key, q_start, k_start, window, documents, padding, softcap)
    work = _work(query.dtype)
    lse = lse.masked_fill(lse == -math.inf, math.inf)  # rows that saw nothing: every weight 0
    grad_q, grad_k, grad_v = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    for q0, q1, tiles in plan:
        q, g, o = query[:, :, q0:q1], grad[:, :, q0:q1].contiguous(), out[:, :, q0:q1]  # [B, H, nq, D]
        row_lse = lse[:, :, q0:q1]  # [B, H, nq]
        if softcap is not None:
            rows = (g.to(work) * o.to(work)).sum(-1, keepdim=True)  # [B, H, nq, 1]
        for tile in tiles:
            if softcap is not None:
                dq, dk, dv = _capped_backward(
                    g, q, key, value, rows, row_lse, tile, visible, scale, softcap, work
                )
            else:
                k = repeat_kv(key[:, :, tile.k0 : tile.k1], groups)  # [B, H, nk, D]
                v = repeat_kv(value[:, :, tile.k0 : tile.k1], groups)  # [B, H, nk, D]
                mask = None
                if tile.kind == "masked":
                    mask, _ = _tile_mask(tile, visible, query.dtype, query.device)
                dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    g, q, k, v, o, row_lse, 0.0, tile.kind == "causal", attn_mask=mask, scale=scale
                )
                dk, dv = (t.unflatten(1, (Hkv, groups)).sum(2) for t in (dk, dv))  # [B, Hkv, nk, D]
            grad_q[:, :, q0:q1] += dq
            grad_k[:, :, tile.k0 : tile.k1] += dk
            grad_v[:, :, tile.k0 : tile.k1] += dv
    grad_sinks = query.new_empty(0)
    if sinks is not None:
        rows = (grad.to(work) * out.to(work)).sum(-1)  # [B, H, L]: rowsum(dO * out')
        weight = (sinks.to(work)[None, :, None] - lse).exp()  # [B, H, L]: the sink's weight
        grad_sinks = -(weight * rows).sum((0, 2)).to(sinks.dtype)  # [H]
    return grad_q, grad_k, grad_v, grad_sinks


@tiled_attention_backward.register_fake
def _(grad, query, key, value, out, lse, q_start, k_start, window, scale, documents, padding, softcap, sinks):
    grad_sinks = query.new_empty(0) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), grad_sinks


def _setup_context(ctx, inputs, output):
    query, key, value, q_start, k_start, window, scale, documents, padding, softcap, sinks = inputs
    ctx.save_for_backward(query, key, value, *output, documents, padding, sinks)
    ctx.mark_non_differentiable(output[1])
    ctx.args = q_start, k_start, window, scale, softcap


def _backward(ctx, grad, _grad_lse):
    query, key, value, out, lse, documents, padding, sinks = ctx.saved_tensors
    q_start, k_start, window, scale, softcap = ctx.args
    grad_q, grad_k, grad_v, grad_sinks = tiled_attention_backward(
        grad, query, key, value, out, lse, q_start, k_start, window, scale, documents, padding, softcap, sinks
    )
    return (
        grad_q,
        grad_k,
        grad_v,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None if sinks is None else grad_sinks,
    )


tiled_attention.register_autograd(_backward, setup_context=_setup_context)
