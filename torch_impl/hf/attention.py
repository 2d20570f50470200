"""Full and sliding-window attention layers: the registered attention and mask functions.

Rank r's keys arrive by `fetch_keys` (full: gather_sequence; a window W: gather_halo(W - 1); packed
documents: gather_halo of each chunk's reach back to its document's start) as a
`Keys` value that says, per chunk the rank holds (torch_impl.layout.ShardPlan: one contiguous, two
under head_tail), which of its rows that chunk attends over; each chunk's queries attend over them
at their global rows through torch_impl.attention, or, for layers whose math it does not compute,
through the model's own function on a dense [C, T] mask (`attend`).
"""

from collections.abc import Callable
import dataclasses
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import (
    AttentionMaskInterface,
    and_masks,
    causal_mask_function,
    packed_sequence_mask_function,
    sliding_window_causal_mask_function,
)

from torch_impl import _group
from torch_impl.attention import causal_attention
from torch_impl.halo import gather_halo
from torch_impl.hf._common import IMPLEMENTATION, RUNNING, Context
from torch_impl.hf.indexed import IndexedContext, indexed_attention
from torch_impl.layout import ShardPlan
from torch_impl.metadata import gather_metadata
from torch_impl.sequence import gather_sequence


class LocalMask(NamedTuple):
    """What this implementation's mask function hands the model to route to its attention layers."""

    padding: torch.Tensor | None  # bool [B, L]: this rank's 2-D padding mask (True: a token), or None
    window: int | None  # sliding window W (a query sees W keys, itself included); None: full causal
    chunked: bool  # chunked attention (Llama 4): keys of the query's attention chunk only
    context: Context  # the forward's, from the model's pre-hook


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """Set on each attention module by `parallelize`: its CP group and the model's own math."""

    group: dist.ProcessGroup
    attend: Callable  # (module, q, k, v, mask, **kwargs) -> (out [B, L, H, D], weights)
    make_mask: Callable  # transformers' mask function for `attend` (sdpa_mask or eager_mask)
    dense: str | None  # why this layer keeps `attend` on a dense [L, T] mask; None: torch_impl.attention
    layout: str = "contiguous"  # which global rows the rank holds (torch_impl.layout)
    query_scale: Callable | None = None  # positions -> the per-row factor the module gave its queries


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


# --- the registered attention and mask functions -------------------------------------------------


def local_mask(
    batch_size,
    q_length,
    kv_length,
    q_offset=0,
    kv_offset=0,
    attention_mask=None,
    local_size=None,
    allow_is_causal_skip=True,
    use_vmap=False,
    **kwargs,
):
    """transformers calls this once per forward per mask kind; the math waits for the gathered keys.
    Called inside the model's forward, after its pre-hook made the forward's Context."""
    context = RUNNING.context
    if context is None:
        raise ValueError(
            f"`{IMPLEMENTATION}`: the model's masks were made without the CP context that "
            "torch_impl.hf.parallelize's pre-hook makes: the model was called through a module the "
            "adapter did not hook, so its positions and padding would be this rank's alone"
        )
    if q_offset != 0 or kv_offset != 0 or kv_length != q_length:
        raise ValueError(
            f"`{IMPLEMENTATION}` cannot attend over a KV cache (generation): the model asked for "
            f"{q_length} queries over {kv_length} keys at offsets {q_offset}, {kv_offset}"
        )
    if use_vmap:
        raise ValueError(
            f"`{IMPLEMENTATION}` supports causal and sliding-window masks (and packed sequences) only: this "
            "model asked for a mask overlay (bidirectional or blockwise tokens, or a non-causal config)"
        )
    chunked = local_size is not None and local_size == getattr(
        kwargs.get("config"), "attention_chunk_size", None
    )
    return LocalMask(attention_mask, None if chunked else local_size, chunked, context)


class Keys(NamedTuple):
    """What a rank fetched for one attention layer, in the transport's order, and per local chunk
    the Window it attends over and that window's rows in these tensors."""

    key: torch.Tensor  # [B, Hkv, T, D]
    value: torch.Tensor  # [B, Hkv, T, D]
    padding: torch.Tensor | None  # bool [B, T]: True for a token
    windows: tuple  # per local chunk: (ShardPlan Window, slice of its keys' rows in key/value/padding)


def fetch_keys(group, shard, key, value, padding, window, documents=None):
    """This rank's keys, values and padding mask for a layer (key/value [B, Hkv, L, D], padding bool
    [B, L] or None): full attention (window None) gathers the sequence in global order, and each
    chunk attends over its rows [0, end); a window W fetches gather_halo(W - 1), one segment per
    chunk (its min(start, W - 1) tokens before it, then the chunk), the chunk's keys. With packed
    documents (torch_impl.layout.Documents) both fetch gather_halo of each chunk's reach instead:
    nothing before the start of the document that holds the chunk's first token."""
    layout = shard.layout
    reach = None if window is None else window - 1
    if documents is not None and not torch.compiler.is_compiling():  # compiled: no graph per batch
        reach = documents.layer_reach(window)

    def seq(t):  # [B, Hkv, L, D] -> [B, L, Hkv, D], the sequence on dim 1 as the transport takes it
        return t.transpose(1, 2)

    if reach is None:
        key = seq(gather_sequence(seq(key), group, layout=layout))  # [B, Hkv, S, D]
        value = seq(gather_sequence(seq(value), group, layout=layout))  # [B, Hkv, S, D]
        padding = None if padding is None else gather_metadata(padding, group, layout=layout)  # [B, S]
        return Keys(key, value, padding, tuple((w, w.keys) for w in shard.windows()))
    key = seq(gather_halo(seq(key), group, reach, layout=layout))  # [B, Hkv, sum_k (h_k + C), D]
    value = seq(gather_halo(seq(value), group, reach, layout=layout))
    padding = None if padding is None else gather_halo(padding, group, reach, layout=layout)
    return Keys(key, value, padding, tuple((w, w.segment) for w in shard.windows(reach)))


def attend(module, query, key, value, padding, documents, w, window, **kwargs):
    """The math for one chunk's queries (global rows w.start ..) over its keys (from w.first_key):
    torch_impl.attention (with the model's soft-cap and sinks), or the model's own mask and attention
    functions for a layer marked dense and for attention dropout (train mode), which the fused math
    does not apply.

    query: [B, H, C, D]; key/value: [B, Hkv, T, D] and padding (bool [B, T]) for the keys
    w.first_key .. w.end - 1; documents (int [B, S]) by global row. Returns ([B, C, H, D], weights).
    """
    plan, B, C = module.context_parallel, query.shape[0], query.shape[2]
    if plan.dense is None and not kwargs.get("dropout", 0.0) > 0:
        check_fused_kwargs(module, kwargs)
        out = causal_attention(
            query,
            key,
            value,
            w.start,
            w.first_key,
            window=window,
            scale=kwargs.get("scaling"),
            documents=None if documents is None else documents[:, w.keys],  # [B, T]
            padding=padding,
            softcap=kwargs.get("softcap"),  # Gemma 2
            sinks=kwargs.get("s_aux"),  # GPT-OSS
        )  # [B, H, C, D]
        return out.transpose(1, 2).contiguous(), None
    mask_function = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    if documents is not None:  # by global row, as the mask's q_idx and kv_idx
        mask_function = and_masks(mask_function, packed_sequence_mask_function(documents))
    padding = None if padding is None else F.pad(padding, (w.first_key, 0))  # [B, end]: by global row
    mask = plan.make_mask(
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
    return plan.attend(module, query, key, value, mask, **kwargs)


def check_fused_kwargs(module, kwargs):
    """An attention argument torch_impl.attention does not honour is refused rather than dropped:
    it computes `softcap` (Gemma 2's) and `s_aux` (GPT-OSS's per-head sinks), not `sinks` (a
    per-token form some models pass)."""
    if kwargs.get("sinks") is not None:
        raise ValueError(
            f"`{IMPLEMENTATION}`: {type(module).__name__} passed `sinks`, which the fused attention "
            "does not compute (it computes per-head sinks passed as `s_aux`)"
        )


def check_call(module, attention_mask):
    """The plan `parallelize` set on the module, and the mask this implementation's mask function made."""
    if not isinstance(getattr(module, "context_parallel", None), AttentionPlan):
        raise ValueError(
            f"{type(module).__name__} uses attention `{IMPLEMENTATION}` but was not prepared by "
            "torch_impl.hf.parallelize"
        )
    if not isinstance(attention_mask, (LocalMask, IndexedContext)):
        raise ValueError(
            f"`{IMPLEMENTATION}` needs the mask its mask function made (the model's own create_*_mask), "
            f"got {type(attention_mask).__name__}; custom 4-D masks cannot be split across CP ranks"
        )


def attention(module, query, key, value, attention_mask, **kwargs):
    """The registered implementation: query [B, H, L, D], key/value [B, Hkv, L, D] on rank r ->
    ([B, L, H, D], weights), equal to the single-process model at the rank's global rows. Each of
    the rank's chunks (one contiguous, two head_tail: ShardPlan) attends over its own keys."""
    check_call(module, attention_mask)
    if isinstance(attention_mask, IndexedContext):
        check_fused_kwargs(module, kwargs)
        return indexed_attention(module, query, key, value, attention_mask, **kwargs)
    padding, window, chunked, context = attention_mask
    documents = context.chunks if chunked else context.documents  # Documents, or None
    plan = module.context_parallel
    n, r = _group.world_size(plan.group), _group.rank(plan.group)
    shard = ShardPlan.of(plan.layout, n, r, query.shape[2])
    if plan.query_scale is not None:  # scaled by local rows: rescaled to the global ones
        rows = shard.rows(query.device)  # [L]
        local, wanted = (
            plan.query_scale(t).to(query.dtype) for t in (torch.arange(len(rows), device=query.device), rows)
        )
        query = query / local[:, None] * wanted[:, None]  # [B, H, L, D]
    keys = fetch_keys(plan.group, shard, key, value, padding, window, documents)
    ids = None if documents is None else documents.ids
    return attend_windows(module, query, keys, ids, window, **kwargs)


def attend_windows(module, query, keys, documents, window, **kwargs):
    """Every local chunk's queries over its window of `keys`: ([B, L, H, D], None)."""
    outs = []
    for w, rows in keys.windows:
        padding = None if keys.padding is None else keys.padding[:, rows]  # [B, T]
        out, weights = attend(
            module, query[:, :, w.queries], keys.key[:, :, rows], keys.value[:, :, rows], padding, documents,
            w, window, **kwargs
        )  # fmt: skip
        outs.append(out)  # [B, C, H, D]
    return (outs[0], weights) if len(outs) == 1 else (torch.cat(outs, dim=1), None)  # [B, L, H, D]


AttentionInterface.register(IMPLEMENTATION, attention)
AttentionMaskInterface.register(IMPLEMENTATION, local_mask)
