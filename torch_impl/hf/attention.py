"""Full, sliding-window and chunked attention layers: the registered attention function.

Each layer is handed the LocalMask that the mask function made for its kind (torch_impl.hf.masks:
how far back its keys reach and, per chunk the rank holds, which of the fetched keys it attends
over, with their padding and documents). It fetches its K and V in one exchange (`fetch_kv`:
gather_sequence or gather_halo of both side by side) and attends per chunk at global rows
(`attend_chunks`) through torch_impl.attention, or, for layers whose math it does not compute,
through the model's own function on a dense [C, T] mask (`attend`). Where image tokens see every
token of their image (Gemma 3's and 4's: media.BLOCKWISE; the Context's Images), a chunk's keys
run on past its end as far as its last token's image (the fetch's lookahead), and a chunk holding
image tokens attends on their rule (`attend_images`, `image_rule`).
"""

from collections.abc import Callable
import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import (
    and_masks,
    causal_mask_function,
    packed_sequence_mask_function,
    sliding_window_causal_mask_function,
)

from torch_impl.attention import causal_attention
from torch_impl.hf._common import IMPLEMENTATION, RUNNING, Aside, attend_visible, fetch_kv
from torch_impl.hf.block_sparse import block_sparse_attention, own_block_mask
from torch_impl.hf.compressed import CompressedEntries, compressed_attention
from torch_impl.hf.indexed import IndexedContext, Selection, indexed_attention, qsa_attention
from torch_impl.hf.inkling import RelativeTable, relative_attention
from torch_impl.hf.masks import LocalMask


@dataclasses.dataclass(frozen=True)
class AttentionSetup:
    """Set on each attention module by `parallelize`: its CP group and the model's own math."""

    group: dist.ProcessGroup
    attend: Callable  # (module, q, k, v, mask, **kwargs) -> (out [B, L, H, D], weights)
    make_mask: Callable  # transformers' mask function for `attend` (sdpa_mask or eager_mask)
    fallback: str | None  # why this layer keeps `attend` on a dense [L, T] mask; None: torch_impl.attention
    layout: str = "contiguous"  # which global rows the rank holds (torch_impl.layout)
    query_scale: Callable | None = None  # positions -> the per-row factor the module gave its queries


@dataclasses.dataclass(frozen=True)
class CrossAttention:
    """Set by `parallelize` on a cross-attention module whose keys and values come whole to every
    rank from outside the sequence CP splits (Mllama's images' states, torch_impl.hf.media.CROSS):
    the rank's queries, its shard of the text, attend over all of them on the model's own mask of
    its rows, with the model's own math. Nothing is fetched."""

    attend: Callable  # (module, q, k, v, mask, **kwargs) -> (out [B, L, H, D], weights)


def temperature_scale(module):
    """Llama 4's NoPE layers with temperature tuning scale each query by a function of its row in
    the sequence, which the module computes from the rank's local rows: as a function of the
    positions [L], the factor [L] (the module's formula), or None for any other module."""
    if not (getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True)):
        return None

    def scale(positions):
        return (
            torch.log1p(torch.floor((positions.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0
        )

    return scale


# --- the registered attention function -----------------------------------------------------------


def attend(module, query, key, value, keys, window, **kwargs):
    """The math for one chunk's queries (global rows w.start ..) over its keys (from w.first_key):
    torch_impl.attention (with the model's soft-cap and sinks), or the model's own mask and attention
    functions for a layer marked dense and for attention dropout (train mode), which the fused math
    does not apply.

    query: [B, H, C, D]; key/value: [B, Hkv, T, D] for the keys w.first_key .. w.end + w.after - 1,
    whose padding, documents and images `keys` (ChunkKeys) holds. Returns ([B, C, H, D], weights).
    """
    w, padding, documents = keys.chunk, keys.padding, keys.documents
    setup, B, C = module.context_parallel, query.shape[0], query.shape[2]
    if keys.blocks is not None:  # image tokens that see later ones: their images' rule
        return attend_images(module, query, key, value, keys, window, kwargs)
    if setup.fallback is None and not kwargs.get("dropout", 0.0) > 0:
        check_fused_kwargs(module, kwargs)
        out = causal_attention(
            query,
            key,
            value,
            w.start,
            w.first_key,
            window=window,
            scale=kwargs.get("scaling"),
            documents=documents,  # [B, T]
            padding=padding,
            softcap=kwargs.get("softcap"),  # Gemma 2
            sinks=kwargs.get("s_aux"),  # GPT-OSS
            document_starts=keys.starts,  # [B, C]: found once a forward
        )  # [B, H, C, D]
        return out.transpose(1, 2).contiguous(), None
    mask_function = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    if documents is not None:  # by global row, as the mask's q_idx and kv_idx
        documents = F.pad(documents, (w.first_key, 0))  # [B, end]
        mask_function = and_masks(mask_function, packed_sequence_mask_function(documents))
    padding = None if padding is None else F.pad(padding, (w.first_key, 0))  # [B, end]: by global row
    mask = setup.make_mask(
        batch_size=B,
        q_length=C,
        kv_length=key.shape[2],
        q_offset=w.start,
        kv_offset=w.first_key,
        mask_function=mask_function,
        attention_mask=padding,
        allow_is_causal_skip=False,  # sdpa's is_causal would align the queries with keys 0 .. C-1
        dtype=query.dtype,
        device=query.device,
        config=module.config,
    )  # [B, 1, C, T]
    return setup.attend(module, query, key, value, mask, **kwargs)


IMAGE_QUERY_BLOCK = 256  # queries whose image mask [B, block, keys] attend_images makes at once


def attend_images(module, query, key, value, keys, window, kwargs):
    """A chunk holding image tokens that see their whole image: per block of its queries, the
    model's own attention over the keys they reach (W - 1 back on a sliding layer, then on to the
    chunk's lookahead's end) on image_rule's dense mask [B, block, k]. query [B, H, C, D];
    key/value [B, Hkv, T, D] at global rows [first_key, end + after). Returns ([B, C, H, D], None)."""
    assert keys.documents is None, "packed rows with images are refused"
    w, outs, block = keys.chunk, [], IMAGE_QUERY_BLOCK
    for q0 in range(w.start, w.end, block):
        q1 = min(q0 + block, w.end)
        k0 = w.first_key if window is None else max(w.first_key, q0 - window + 1)
        cut, local = slice(k0 - w.first_key, None), slice(q0 - w.start, q1 - w.start)
        seen = image_rule(keys, window, range(q0, q1), cut, query.device)  # [B, block, k]
        out, _ = attend_visible(module, query[:, :, local], key[:, :, cut], value[:, :, cut], seen, kwargs)
        outs.append(out)  # [B, block, H, D]
    return torch.cat(outs, dim=1), None


def image_rule(keys, window, queries, cut, device):
    """bool [B, q, k]: which keys (ChunkKeys columns `cut`) queries at global rows `queries` see
    where image tokens see every token of their image (Gemma 3's and 4's masks): causal, or the same
    image; then within the window (W - 1 back, any distance forward) and not padding."""
    w = keys.chunk
    q = torch.arange(queries.start, queries.stop, device=device)[:, None]  # [q, 1]
    k = torch.arange(w.first_key, w.end + w.after, device=device)[None, cut]  # [1, k]
    own = keys.blocks[:, queries.start - w.first_key : queries.stop - w.first_key, None]  # [B, q, 1]
    theirs = keys.blocks[:, None, cut]  # [B, 1, k]
    seen = (k <= q)[None] | ((own == theirs) & (own >= 0))  # [B, q, k]
    if window is not None:
        seen = seen & (k > q - window)[None]
    return seen if keys.padding is None else seen & keys.padding[:, None, cut]


def check_fused_kwargs(module, kwargs):
    """An attention argument torch_impl.attention does not honour is refused rather than dropped:
    it computes `softcap` (Gemma 2's) and `s_aux` (GPT-OSS's per-head sinks), not `sinks` (a
    per-token form some models pass)."""
    if kwargs.get("sinks") is not None:
        raise ValueError(
            f"torch_impl.hf: {type(module).__name__} passed `sinks`, which the fused attention "
            "does not compute (it computes per-head sinks passed as `s_aux`)"
        )


def _setup(module):
    """The AttentionSetup `parallelize` set on the module."""
    if not isinstance(getattr(module, "context_parallel", None), AttentionSetup):
        raise ValueError(
            f"torch_impl.hf: {type(module).__name__} uses attention `{IMPLEMENTATION}` but was not "
            "prepared by torch_impl.hf.parallelize"
        )
    return module.context_parallel


def check_call(module, attention_mask):
    """The setup `parallelize` set on the module, and the mask this implementation's mask function made."""
    _setup(module)
    if not isinstance(attention_mask, (LocalMask, IndexedContext, Selection)):
        raise ValueError(
            f"torch_impl.hf: `{IMPLEMENTATION}` needs the mask its mask function made (the model's own "
            f"create_*_mask), got {type(attention_mask).__name__}; custom 4-D masks cannot be split "
            "across CP ranks"
        )
    if isinstance(attention_mask, LocalMask) and not attention_mask.chunks:
        raise ValueError(
            f"torch_impl.hf: {type(module).__name__} was given a mask of a kind its config's "
            "layer_types do not list"
        )


def attention(module, query, key, value, attention_mask, **kwargs):
    """The registered implementation: query [B, H, L, D], key/value [B, Hkv, L, D] on rank r ->
    ([B, L, H, D], weights), equal to the single-process model at the rank's global rows. Each of
    the rank's chunks (one contiguous, two head_tail: ShardPlan) attends over its own keys."""
    if isinstance(getattr(module, "context_parallel", None), CrossAttention):  # keys whole everywhere
        return module.context_parallel.attend(module, query, key, value, attention_mask, **kwargs)
    if isinstance(RUNNING.context, Aside):  # an unsharded call: the model's own attention
        if kwargs.get("block_indices") is not None:  # MiniMax-M3's picks: the mask it makes on sdpa
            blocks = kwargs["block_indices"]
            attention_mask = own_block_mask(
                module, query, key, attention_mask, blocks, kwargs.get("position_ids")
            )
        return _setup(module).attend(module, query, key, value, attention_mask, **kwargs)
    check_call(module, attention_mask)
    if isinstance(attention_mask, IndexedContext):
        check_fused_kwargs(module, kwargs)
        return indexed_attention(module, query, key, value, attention_mask, **kwargs)
    if isinstance(attention_mask, Selection):  # Qwen4's QSA: its indexer's picks
        return qsa_attention(module, query, key, value, attention_mask, **kwargs)
    if kwargs.get("block_indices") is not None:  # MiniMax-M3's sparse layers: its indexer's picks
        return block_sparse_attention(module, query, key, value, attention_mask, **kwargs)
    if isinstance(getattr(module, "compressor", None), CompressedEntries):  # DeepSeek V4's CSA, HCA
        return compressed_attention(module, query, key, value, attention_mask, **kwargs)
    if isinstance(getattr(module, "rel_logits_proj", None), RelativeTable):  # Inkling's relative logits
        return relative_attention(module, query, key, value, attention_mask, **kwargs)
    setup, shard = module.context_parallel, attention_mask.context.shard
    if setup.query_scale is not None:  # scaled by local rows: rescaled to the global ones
        rows = shard.rows(query.device)  # [L]
        local, wanted = (
            setup.query_scale(t).to(query.dtype) for t in (torch.arange(len(rows), device=query.device), rows)
        )
        query = query / local[:, None] * wanted[:, None]  # [B, H, L, D]
    mask = attention_mask
    key, value = fetch_kv(mask.context, key, value, mask.reach, mask.lookahead)  # [B, Hkv, T, D]
    return attend_chunks(module, query, key, value, mask, **kwargs)


def attend_chunks(module, query, key, value, mask, **kwargs):
    """Every local chunk's queries over its keys (key/value as fetch_kv returns them, or any fetch
    whose rows the mask's ChunkKeys name): ([B, L, H, D], weights or None)."""
    outs = []
    for keys in mask.chunks:
        rows = keys.rows
        out, weights = attend(
            module, query[:, :, keys.chunk.queries], key[:, :, rows], value[:, :, rows], keys, mask.window,
            **kwargs
        )  # fmt: skip
        outs.append(out)  # [B, C, H, D]
    return (outs[0], weights) if len(outs) == 1 else (torch.cat(outs, dim=1), None)  # [B, L, H, D]


AttentionInterface.register(IMPLEMENTATION, attention)
