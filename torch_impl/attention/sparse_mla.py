"""DeepSeek Sparse Attention in absorbed (MQA) form: each query over the keys its indexer selected."""

import torch
from torch.utils.checkpoint import checkpoint


def sparse_mla_attention(
    query: torch.Tensor,
    latents: torch.Tensor,
    kv_weight: torch.Tensor,
    indices: torch.Tensor,
    valid: torch.Tensor,
    *,
    nope_dim: int,
    scale: float,
    sinks: torch.Tensor | None = None,
    block: int = 128,
) -> torch.Tensor:
    """MLA attention in absorbed (MQA) form over the keys each query selected; differentiable.

    query: [B, H, L, dn + dr], each head's nope part then its rope part; latents: [B, T, r + dr], a
    token's MLA latent (kv_lora_rank r) then its rope key, for T keys; kv_weight: [H * (dn + dv),
    r], `kv_b_proj.weight` (head h's key rows, then its value rows); indices: int [B, L, k], the
    rows of latents each query selected; valid: bool [B, L, k], which of them it may see; sinks:
    [H] or None, one learned logit per head that joins every query's softmax with no value (HY-V4's).

    Equal to the model's expanded form (K = kv_b_proj(latent) | rope key, V likewise) under the
    mask "visible and selected", but no per-head K or V exists: per block of queries,
    1. each head's nope query is absorbed into the latent space, q_nope @ W_uk^h, and joined
       with its rope part: [B, nq, H, r + dr];
    2. the latents of the block's picks are gathered, [B, nq, k, r + dr], and scored against it
       at `scale` (the model's own); picks a query may not see weigh nothing, a head's sink
       takes its share of the softmax, and a query that sees none returns zeros;
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
                sinks,
                use_reentrant=False,
            )
        )  # [B, nq, H, dv]
    return torch.cat(blocks, dim=1)


def _sparse_mla_block(query, latents, kv_weight, indices, valid, nope_dim, scale, sinks):
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
    scores = scores.masked_fill(~seen, torch.finfo(scores.dtype).min)  # [B, nq, H, k]
    if sinks is None:
        weights = scores.softmax(-1) * seen  # [B, nq, H, k]
    else:  # the sink: one more column of the softmax, dropped after it
        sink = sinks.to(scores.dtype)[:, None].expand(*scores.shape[:-1], 1)  # [B, nq, H, 1]
        weights = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1] * seen  # [B, nq, H, k]
    summed = weights.to(picked.dtype) @ picked[..., :r]  # [B, nq, H, r]
    return torch.einsum("bqhr,hvr->bqhv", summed, w_uv)  # [B, nq, H, dv]
