"""One CP rank's causal attention over the keys it holds, without an [L, T] mask or score matrix.

Rank r's L queries sit at global rows q_start .. q_start + L - 1; its T keys (gathered, or a halo
followed by its own) at global rows k_start .. q_start + L - 1. Query q sees key k iff

    k <= q,   q - k < window (when there is one),   documents[k] == documents[q] (packed
    sequences),   padding[k] (a padding key is seen by no one)

and a query that sees no key at all returns zeros. Memory is O((L + T) * heads * head_dim) plus a
kernel's workspace; no path builds a mask or score matrix that grows with L * T.

| device | layer                                      | kernel                                              |
|--------|--------------------------------------------|-----------------------------------------------------|
| CUDA   | global, no documents or padding            | flash attention, causal aligned bottom-right        |
| CUDA   | the rest (windows, documents, padding)     | flex_attention, BlockMask built from `mask_mod`     |
| CPU    | all                                        | `TiledAttention`: query blocks over key tiles (the  |
|        |                                            | CPU flash op), merged by log-sum-exp, exact backward|

The CUDA rows are PyTorch's own fused kernels. `parity_tests/test_cuda.py` checks them against the
CPU tiles where a GPU is (`make gpu-check`); none has been lent to this project yet. On the CPU the
tests run the flex row's rule (`mask_mod`) through flex_attention's forward.
"""

import functools
import math
from typing import NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

# CPU tiles: query rows per block (and key rows per tile that needs a mask), measured fastest here
BLOCK = {"global": 1024, "window": 256, "masked": 512}


def mask_mod(q_start, k_start, window, documents, padding):
    """The visibility rule as flex_attention's mask_mod(b, h, q_idx, kv_idx) over local indices.

    documents: int [B, T] per key row (a query's is its own key row's), or None; padding: bool
    [B, T], or None. Works on broadcastable index tensors too (the CPU tiles call it that way).
    """
    offset = q_start - k_start  # the key row of query 0

    def visible(b, h, q_idx, kv_idx):
        q = q_idx + offset  # the query's own key row
        ok = kv_idx <= q
        if window is not None:
            ok = ok & (q - kv_idx < window)
        if documents is not None:
            ok = ok & (documents[b, q] == documents[b, kv_idx])
        if padding is not None:
            ok = ok & padding[b, kv_idx]
        return ok

    return visible


def check_arguments(query, key, value, q_start, k_start, window, documents, padding):
    """ValueError naming the argument and the rule, before any work."""
    B, H, L, D = query.shape
    if key.ndim != 4 or key.shape != value.shape[:3] + (D,) or key.shape[0] != B or H % key.shape[1]:
        raise ValueError(
            f"`key`/`value` must be [B, Hkv, T, D] with H divisible by Hkv, matching `query` "
            f"{tuple(query.shape)}; got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    T = key.shape[2]
    if k_start + T != q_start + L or k_start > q_start:
        raise ValueError(
            f"the keys must end with this rank's own rows: k_start ({k_start}) + T ({T}) must equal "
            f"q_start ({q_start}) + L ({L})"
        )
    if window is not None and window < 1:
        raise ValueError(f"`window` must be at least 1 (a query sees itself), got {window}")
    for name, t in (("documents", documents), ("padding", padding)):
        if t is not None and tuple(t.shape) != (B, T):
            raise ValueError(f"`{name}` must be [B, T] = {(B, T)}, one per key row, got {tuple(t.shape)}")


def causal_attention(
    query, key, value, q_start, k_start, *, window=None, scale=None, documents=None, padding=None
):
    """Causal attention of this rank's queries over its keys, by global position; differentiable.

    query: [B, H, L, D] at global rows q_start ..; key, value: [B, Hkv, T, D] at global rows
    k_start .. q_start + L - 1 (H a multiple of Hkv: grouped-query attention); window: a query sees
    `window` keys, itself included, or all earlier ones when None; scale: default 1/sqrt(D);
    documents: int [B, T] (packed sequences) and padding: bool [B, T] (True: a token), per key row.
    Returns [B, H, L, D] in query's dtype.
    """
    check_arguments(query, key, value, q_start, k_start, window, documents, padding)
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    kernel = choose_kernel(query, window, documents, padding)
    return KERNELS[kernel](query, key, value, q_start, k_start, window, scale, documents, padding)


def choose_kernel(query, window, documents, padding):
    """The kernel name for this call (the table in the module docstring)."""
    if query.device.type != "cuda":
        return "tiled"
    plain = window is None and documents is None and padding is None
    return "flash" if plain and _flash_fits(query) else "flex"


# --- CUDA ---------------------------------------------------------------------------------------


def _flash_fits(query):
    return (
        query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] % 8 == 0 and query.shape[-1] <= 256
    )


def _repeat_kv(t, groups):
    """[B, Hkv, T, D] -> [B, Hkv * groups, T, D], each key head repeated for its query heads."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _flash(query, key, value, q_start, k_start, window, scale, documents, padding):
    """Global causal attention aligned bottom-right (queries are the last L of the T keys): the
    flash op's own `is_causal` for L < T, as torch's `causal_lower_right` dispatches it."""
    groups = query.shape[1] // key.shape[1]
    key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)  # [B, H, T, D]
    return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, True, scale=scale)[0]


@functools.cache
def _compiled_flex():
    """flex_attention and create_block_mask, compiled (eager flex_attention materializes the scores)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return torch.compile(create_block_mask), torch.compile(flex_attention)


def _flex(query, key, value, q_start, k_start, window, scale, documents, padding):
    """flex_attention with a BlockMask built by evaluating `mask_mod` block by block (no dense mask)."""
    create_block_mask, flex_attention = _compiled_flex()
    B, H, L, _ = query.shape
    per_row = documents is not None or padding is not None
    rule = mask_mod(q_start, k_start, window, documents, padding)
    block_mask = create_block_mask(rule, B if per_row else None, None, L, key.shape[2], device=query.device)
    return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=H != key.shape[1])


# --- CPU: tiles ---------------------------------------------------------------------------------


class Tile(NamedTuple):
    """Query rows [q0, q1) against key rows [k0, k1) (local indices) and how to mask them."""

    q0: int
    q1: int
    k0: int
    k1: int
    kind: str  # "full": every pair visible; "causal": the diagonal square; "masked": mask_mod's mask


def tile_plan(L, T, window, block, masked):
    """Every tile of the attention, grouped by query block: a pure function of the shapes.

    Query block [q0, q1) owns key rows [q0 + off, q1 + off) (off = T - L: its own positions),
    the "causal" diagonal tile; keys before those come in tiles of `block` rows going left, until
    the window or row 0 ends them. Without data masks (`masked` False) a tile every query fully
    sees is "full" and the full tiles of a block merge into one; with documents or padding every
    tile is "masked" and keeps its `block` rows, so that no mask exceeds block x block.
    Returns a tuple of (q0, q1, tiles) per query block.
    """
    off, plan = T - L, []
    for q0 in range(0, L, block):
        q1 = min(q0 + block, L)
        lo = 0 if window is None else max(0, q0 + off - window + 1)  # the first key any of them sees
        banded = masked or window is not None and q1 - q0 > window  # the window cuts the square too
        tiles = [Tile(q0, q1, q0 + off, q1 + off, "masked" if banded else "causal")]
        k1 = q0 + off
        while k1 > lo:
            k0 = max(lo, k1 - block)
            full = window is None or (q1 - 1 + off) - k0 < window  # the last query still sees k0
            kind = "full" if full and not masked else "masked"
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


class _Visible(NamedTuple):
    rule: object  # mask_mod
    batch: int  # the mask's batch size: B with documents or padding, else 1


def _tile_forward(q, key, value, tile, visible, scale, groups):
    """(out [B, H, nq, D], lse [B, H, nq]) of one tile; rows that see no key: zeros and -inf."""
    k = _repeat_kv(key[:, :, tile.k0 : tile.k1], groups)  # [B, H, nk, D]
    v = _repeat_kv(value[:, :, tile.k0 : tile.k1], groups)  # [B, H, nk, D]
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
        plan = tile_plan(L, key.shape[2], window, block, masked)
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
                k = _repeat_kv(key[:, :, tile.k0 : tile.k1], groups)  # [B, H, nk, D]
                v = _repeat_kv(value[:, :, tile.k0 : tile.k1], groups)  # [B, H, nk, D]
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


def _tiled(query, key, value, q_start, k_start, window, scale, documents, padding):
    return TiledAttention.apply(query, key, value, q_start, k_start, window, scale, documents, padding)


KERNELS = {"flash": _flash, "flex": _flex, "tiled": _tiled}


# --- DeepSeek Sparse Attention: each query over the keys its indexer selected ------------------


def sparse_mla_attention(query, latents, kv_weight, indices, valid, *, nope_dim, scale, block=128):
    """MLA attention in absorbed (MQA) form over the keys each query selected; differentiable.

    query: [B, H, L, dn + dr], each head's nope part then its rope part; latents: [B, T, r + dr], a
    token's MLA latent (kv_lora_rank r) then its rope key, at global rows 0 .. T-1; kv_weight:
    [H * (dn + dv), r], `kv_b_proj.weight` (head h's key rows, then its value rows); indices: int
    [B, L, k], the key rows each query selected; valid: bool [B, L, k], which of them it may see.

    Equal to the model's expanded form (K = kv_b_proj(latent) | rope key, V likewise) under the
    mask "visible and selected", but no per-head K or V exists: per block of queries,
    1. each head's nope query is absorbed into the latent space, q_nope @ W_uk^h, and joined
       with its rope part: [B, nq, H, r + dr];
    2. the latents of the block's picks are gathered, [B, nq, k, r + dr], and scored against it
       at `scale` (the model's own); picks a query may not see weigh nothing, and a query that
       sees none returns zeros;
    3. the weighted latent sum, [B, nq, H, r], is mapped through W_uv^h: [B, nq, H, dv].
    Each block is checkpointed, so the picks exist only while it runs, in forward and again in
    backward. Work per pick and head: 2r + dr multiply-adds. Returns [B, L, H, dv] in query's dtype.
    """
    L, H = query.shape[2], query.shape[1]
    blocks = []
    for q0 in range(0, L, block):
        rows = slice(q0, min(q0 + block, L))
        blocks.append(
            checkpoint(
                _sparse_mla_block,
                query[:, :, rows],  # [B, H, nq, dn + dr]
                latents,
                kv_weight.view(H, -1, kv_weight.shape[-1]),  # [H, dn + dv, r]
                indices[:, rows],  # [B, nq, k]
                valid[:, rows],  # [B, nq, k]
                nope_dim,
                scale,
                use_reentrant=False,
            )
        )  # [B, nq, H, dv]
    return torch.cat(blocks, dim=1)


def _sparse_mla_block(query, latents, kv_weight, indices, valid, nope_dim, scale):
    """One block of queries: steps 1-3 of sparse_mla_attention."""
    r = kv_weight.shape[-1]
    query = query.transpose(1, 2)  # [B, nq, H, dn + dr]
    q_nope, q_rope = query[..., :nope_dim], query[..., nope_dim:]  # [B, nq, H, dn], [B, nq, H, dr]
    w_uk, w_uv = kv_weight[:, :nope_dim], kv_weight[:, nope_dim:]  # [H, dn, r], [H, dv, r]
    q = torch.cat([torch.einsum("bqhd,hdr->bqhr", q_nope, w_uk), q_rope], dim=-1)  # [B, nq, H, r + dr]
    B, T, width = latents.shape
    rows = indices.long() + T * torch.arange(B, device=indices.device)[:, None, None]  # into [B * T]
    # index_select, not latents[batch, indices]: its backward, an index_add_, is several times faster
    # on CPU than advanced indexing's accumulating index_put
    picked = latents.reshape(B * T, width).index_select(0, rows.view(-1)).view(*indices.shape, width)
    scores = (q @ picked.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32)) * scale
    seen = valid[:, :, None, :]  # [B, nq, 1, k]
    weights = scores.masked_fill(~seen, torch.finfo(scores.dtype).min).softmax(-1) * seen  # [B, nq, H, k]
    summed = weights.to(picked.dtype) @ picked[..., :r]  # [B, nq, H, r]
    return torch.einsum("bqhr,hvr->bqhv", summed, w_uv)  # [B, nq, H, dv]
