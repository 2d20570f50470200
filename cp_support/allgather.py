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
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from torch_impl import gather_metadata, gather_sequence
from torch_impl.hf.attention import Keys, attend_windows, check_call, local_mask
from torch_impl.hf.indexed import AbsorbedMLA, IndexedContext
from torch_impl.layout import ShardPlan

IMPLEMENTATION = "cp_allgather"


def fetch_keys(group, shard, key, value, padding, window):
    """torch_impl.hf.attention.fetch_keys's Keys, from all-gathers of the whole K and V in every
    layer: each chunk attends over the rows [first_key, end) of the gathered sequence."""
    key = gather_sequence(key.transpose(1, 2), group).transpose(1, 2)  # [B, Hkv, S, D]
    value = gather_sequence(value.transpose(1, 2), group).transpose(1, 2)  # [B, Hkv, S, D]
    padding = None if padding is None else gather_metadata(padding, group)  # [B, S]
    reach = None if window is None else window - 1
    return Keys(key, value, padding, tuple((w, w.keys) for w in shard.windows(reach)))


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
    layout = getattr(getattr(module, "context_parallel", None), "layout", "contiguous")
    if layout != "contiguous":
        raise ValueError(
            f"`{IMPLEMENTATION}` is the contiguous layout's baseline; the model has layout {layout!r}"
        )
    check_call(module, attention_mask)
    if isinstance(attention_mask, IndexedContext):
        return indexed_attention(module, query, key, value, attention_mask, **kwargs)
    padding, window, chunked, context = attention_mask
    documents = context.chunks if chunked else context.documents
    documents = None if documents is None else documents.ids  # every key is gathered either way
    group = module.context_parallel.group
    shard = ShardPlan.of("contiguous", dist.get_world_size(group), dist.get_rank(group), query.shape[2])
    keys = fetch_keys(group, shard, key, value, padding, window)
    return attend_windows(module, query, keys, documents, window, **kwargs)


AttentionInterface.register(IMPLEMENTATION, attention)
AttentionMaskInterface.register(IMPLEMENTATION, local_mask)
