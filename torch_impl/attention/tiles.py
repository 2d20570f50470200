"""The CPU kernel: query blocks over key tiles (the CPU flash op where a tile is fully visible or
diagonal, under a block-sized mask otherwise; explicit block-sized scores where they are
soft-capped), merged by log-sum-exp, attention sinks joined to the merged denominator, with an
exact backward that recomputes each tile. Which tiles, and how each is masked, is
torch_impl.attention.plan's, the same plan forward and backward: packed documents' tiles that no
query's document reaches are never computed."""

import math

import torch

from torch_impl.attention.plan import plan_call, tile_mask
from torch_impl.attention.rule import repeat_kv


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
    mask, seen = tile_mask(tile, visible, q.dtype, q.device)
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
        mask, _ = tile_mask(tile, visible, t.dtype, t.device)  # [B or 1, 1, nq, nk]: 0 or -inf
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
    starts: torch.Tensor | None,
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
    plan, visible = plan_call(query, key, q_start, k_start, window, documents, padding, softcap, starts)
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
def _(query, key, value, q_start, k_start, window, scale, documents, padding, softcap, sinks, starts):
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
    starts: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_q, grad_k, grad_v, grad_sinks) of `tiled_attention` (its docstring states them);
    grad_sinks is empty without sinks."""
    B, Hkv, T, D = key.shape
    groups = query.shape[1] // Hkv
    plan, visible = plan_call(query, key, q_start, k_start, window, documents, padding, softcap, starts)
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
                    mask, _ = tile_mask(tile, visible, query.dtype, query.device)
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
def _(
    grad,
    query,
    key,
    value,
    out,
    lse,
    q_start,
    k_start,
    window,
    scale,
    documents,
    padding,
    softcap,
    sinks,
    starts,
):
    grad_sinks = query.new_empty(0) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), grad_sinks


def _setup_context(ctx, inputs, output):
    query, key, value, q_start, k_start, window, scale, documents, padding, softcap, sinks, starts = inputs
    ctx.save_for_backward(query, key, value, *output, documents, padding, sinks, starts)
    ctx.mark_non_differentiable(output[1])
    ctx.args = q_start, k_start, window, scale, softcap


def _backward(ctx, grad, _grad_lse):
    query, key, value, out, lse, documents, padding, sinks, starts = ctx.saved_tensors
    q_start, k_start, window, scale, softcap = ctx.args
    grad_q, grad_k, grad_v, grad_sinks = tiled_attention_backward(
        grad,
        query,
        key,
        value,
        out,
        lse,
        q_start,
        k_start,
        window,
        scale,
        documents,
        padding,
        softcap,
        sinks,
        starts,
    )
    grad_sinks = None if sinks is None else grad_sinks
    return grad_q, grad_k, grad_v, None, None, None, None, None, None, None, grad_sinks, None


tiled_attention.register_autograd(_backward, setup_context=_setup_context)
