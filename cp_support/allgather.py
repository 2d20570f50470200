"""The baseline CP transport, for comparison only: every attention layer all-gathers K and V.

This is what torch's `context_parallel` (ring or all-gather of the whole K/V, in every attention
layer) and NeMo's CP paths move: a sliding-window layer gathers all n*L keys and slices its window
out of them; a DeepSeek Sparse Attention layer gathers its expanded per-head K and V (as CP code
that gathers the model's K/V would), not its latents, and attends under a dense mask of the
selected keys (transformers' own form). It is not part of the library's API. It registers one more
transformers attention implementation that differs from torch_impl.hf's only in how keys arrive
(and, for DSA, in that dense form): the same checks, masks and attention math otherwise, so that
comparisons measure the transport.

    model = hf.parallelize(model, group)
    model.set_attn_implementation(allgather.IMPLEMENTATION)  # back: hf.IMPLEMENTATION
"""

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from torch_impl import gather_sequence
from torch_impl.hf.attention import attend_chunks, check_call
from torch_impl.hf.indexed import AbsorbedMLA, IndexedContext
from torch_impl.hf.masks import local_mask

IMPLEMENTATION = "cp_allgather"


def indexed_attention(module, query, key, value, context, indices=None, scaling=None, **kwargs):
    """DeepSeek Sparse Attention as other CP code runs it: this rank's latents expanded into per-head
    K and V (the model's own `expand_kv`), those all-gathered, and SDPA under the mask of each
    query's visible selected keys, as transformers computes it on one process (the indexer is
    torch_impl.hf's)."""
    key, value = super(AbsorbedMLA, module).expand_kv(key, value)  # [B, H, L, Dk], [B, H, L, Dv]
    key = gather_sequence(key.transpose(1, 2), context.group).transpose(1, 2)  # [B, H, S, Dk]
    value = gather_sequence(value.transpose(1, 2), context.group).transpose(1, 2)  # [B, H, S, Dv]
    (B, L), S = indices.shape[:2], key.shape[2]
    queries = context.rows.to(query.device)[None, :, None]  # [1, L, 1]
    seen = context.visible(queries, indices.long())  # [B, L, k]
    chosen = torch.where(seen, indices.long(), S)  # a pick it may not see: a spare column, cut below
    mask = torch.zeros(B, L, S + 1, dtype=torch.bool, device=key.device).scatter_(-1, chosen, True)
    mask = mask[:, None, :, :S]  # [B, 1, L, S]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)  # [B, H, L, Dv]
    out = torch.where(mask.any(-1, keepdim=True), out, 0.0)  # a query that sees no key: zeros
    return out.transpose(1, 2).contiguous(), None


def attention(module, query, key, value, attention_mask, **kwargs):
    """torch_impl.hf.attention.attention, but K and V each all-gathered whole in every layer: each
    chunk attends over the rows [first_key, end) of the gathered sequence, with the padding and
    documents the library's mask function made for its kind of layer."""
    layout = getattr(getattr(module, "context_parallel", None), "layout", "contiguous")
    if layout != "contiguous":
        raise ValueError(
            f"`{IMPLEMENTATION}` is the contiguous layout's baseline; the model has layout {layout!r}"
        )
    check_call(module, attention_mask)
    if isinstance(attention_mask, IndexedContext):
        return indexed_attention(module, query, key, value, attention_mask, **kwargs)
    group = attention_mask.context.group
    key = gather_sequence(key.transpose(1, 2), group).transpose(1, 2)  # [B, Hkv, S, D]
    value = gather_sequence(value.transpose(1, 2), group).transpose(1, 2)  # [B, Hkv, S, D]
    chunks = tuple(keys._replace(rows=keys.chunk.keys) for keys in attention_mask.chunks)
    return attend_chunks(module, query, key, value, attention_mask._replace(chunks=chunks), **kwargs)


AttentionInterface.register(IMPLEMENTATION, attention)
AttentionMaskInterface.register(IMPLEMENTATION, local_mask)
