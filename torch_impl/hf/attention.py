"""Full and sliding-window attention layers: the registered attention and mask functions.

Rank r's keys arrive by `fetch_keys` (full: gather_sequence; a window W: gather_halo(W - 1)) and its
queries attend over them at their global rows through torch_impl.attention, or, for layers whose
math it does not compute, through the model's own function on a dense [L, T] mask (`attend`).
Under the head_tail layout (`attend_chunks`) the keys arrive in that layout and each of the rank's
two chunks attends over its own.
"""

from collections.abc import Callable
import dataclasses
from typing import NamedTuple

import torch
import torch.distributed as dist
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
from torch_impl.hf._common import DOCUMENTS, IMPLEMENTATION
from torch_impl.hf.indexed import IndexedContext, indexed_attention
from torch_impl.layout import chunk_len, chunks
from torch_impl.metadata import gather_metadata
from torch_impl.sequence import gather_sequence


class LocalMask(NamedTuple):
    """What this implementation's mask function hands the model to route to its attention layers."""

    padding: torch.Tensor | None  # bool [B, L]: this rank's 2-D padding mask (True: a token), or None
    window: int | None  # sliding window W (a query sees W keys, itself included); None: full causal


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """Set on each attention module by `parallelize`: its CP group and the model's own math."""

    group: dist.ProcessGroup
    attend: Callable  # (module, q, k, v, mask, **kwargs) -> (out [B, L, H, D], weights)
    make_mask: Callable  # transformers' mask function for `attend` (sdpa_mask or eager_mask)
    dense: str | None  # why this layer keeps `attend` on a dense [L, T] mask; None: torch_impl.attention
    layout: str = "contiguous"  # which global rows the rank holds (torch_impl.layout)


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
    """transformers calls this once per forward per mask kind; the math waits for the gathered keys."""
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
    return LocalMask(attention_mask, local_size)  # packed sequences: the documents come as a kwarg


def fetch_keys(group, key, value, padding, window):
    """This rank's keys and values, their padding mask, and the global position of the first key.

    key/value: [B, Hkv, L, D]; padding: bool [B, L] or None. Full attention (window None) gathers
    keys 0 .. S-1; a window W fetches only the h = min(r*L, W-1) keys before this rank's own.
    Returns key/value [B, Hkv, T, D] for the keys first_key .. (r+1)*L - 1, and the padding mask
    indexed by global key position ([B, (r+1)*L] or [B, S]; False before first_key), or None.
    """
    L = key.shape[2]
    if window is None:
        key = gather_sequence(key.transpose(1, 2), group).transpose(1, 2)  # [B, Hkv, S, D]
        value = gather_sequence(value.transpose(1, 2), group).transpose(1, 2)  # [B, Hkv, S, D]
        padding = None if padding is None else gather_metadata(padding, group)  # [B, S]
        return key, value, padding, 0
    start = _group.rank(group) * L  # this rank's first token
    first_key = start - min(start, window - 1)
    key = gather_halo(key.transpose(1, 2), group, window - 1).transpose(1, 2)  # [B, Hkv, h+L, D]
    value = gather_halo(value.transpose(1, 2), group, window - 1).transpose(1, 2)  # [B, Hkv, h+L, D]
    if padding is not None:
        padding = gather_halo(padding, group, window - 1, left_padding=first_key)  # [B, (r+1)*L]
    return key, value, padding, first_key


def attend(module, query, key, value, padding, documents, first_key, window, start=None, **kwargs):
    """The math for queries start .. start + L - 1 (default: r*L ..) over keys from first_key:
    torch_impl.attention, or the model's own mask and attention functions for a layer marked dense.

    query: [B, H, L, D]; key/value: [B, Hkv, T, D] from global row first_key; padding (bool) and
    documents (int), when given, indexed by global key position. Returns ([B, L, H, D], weights).
    """
    plan, (B, _, L, _) = module.context_parallel, query.shape
    start = _group.rank(plan.group) * L if start is None else start
    if plan.dense is None:
        check_fused_kwargs(module, kwargs)
        rows = slice(first_key, start + L)  # the keys up to this rank's own: [first_key, (r+1)*L)
        out = causal_attention(
            query,
            key[:, :, : rows.stop - first_key],  # [B, Hkv, T', D]
            value[:, :, : rows.stop - first_key],  # [B, Hkv, T', D]
            start,
            first_key,
            window=window,
            scale=kwargs.get("scaling"),
            documents=None if documents is None else documents[:, rows],  # [B, T']
            padding=None if padding is None else padding[:, rows],  # [B, T']
        )  # [B, H, L, D]
        return out.transpose(1, 2).contiguous(), None
    mask_function = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    if documents is not None:
        mask_function = and_masks(mask_function, packed_sequence_mask_function(documents))
    mask = plan.make_mask(
        batch_size=B,
        q_length=L,
        kv_length=key.shape[2],
        q_offset=start,
        kv_offset=first_key,
        mask_function=mask_function,
        attention_mask=padding,
        allow_is_causal_skip=False,  # sdpa's is_causal would align the queries with keys 0 .. L-1
        dtype=query.dtype,
        device=query.device,
        config=module.config,
    )  # [B, 1, L, T]
    return plan.attend(module, query, key, value, mask, **kwargs)


def check_fused_kwargs(module, kwargs):
    """The attention arguments torch_impl.attention cannot honour (parallelize marks such layers
    dense; a model that passes them without saying so in its config is refused here)."""
    for name in ("softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"`{IMPLEMENTATION}`: {type(module).__name__} passed `{name}`, which the fused attention "
                "does not compute; torch_impl.hf.parallelize did not expect it for this model"
            )
    if kwargs.get("dropout", 0.0) > 0:
        raise ValueError(
            f"`{IMPLEMENTATION}`: {type(module).__name__} asked for attention dropout "
            f"{kwargs['dropout']}, which the fused attention does not apply"
        )


def check_call(module, attention_mask):
    """The plan `parallelize` set on the module, and the mask this implementation's mask function made."""
    if not isinstance(getattr(module, "context_parallel", None), AttentionPlan):
        raise ValueError(
            f"{type(module).__name__} uses attention `{IMPLEMENTATION}` but was not prepared by "
            "torch_impl.hf.parallelize"
        )
    if not isinstance(attention_mask, LocalMask):
        raise ValueError(
            f"`{IMPLEMENTATION}` needs the mask its mask function made (the model's own create_*_mask), "
            f"got {type(attention_mask).__name__}; custom 4-D masks cannot be split across CP ranks"
        )


def attention(module, query, key, value, attention_mask, **kwargs):
    """The registered implementation: query [B, H, L, D], key/value [B, Hkv, L, D] on rank r ->
    ([B, L, H, D], weights), equal to the single-process model's rows r*L .. (r+1)*L - 1."""
    if isinstance(attention_mask, IndexedContext):
        return indexed_attention(module, query, key, value, attention_mask, **kwargs)
    check_call(module, attention_mask)
    padding, window = attention_mask
    documents = kwargs.pop(DOCUMENTS, None)  # [B, S] for packed sequences, from ModelInputs
    plan = module.context_parallel
    if plan.layout != "contiguous":
        return attend_chunks(module, query, key, value, padding, documents, window, **kwargs)
    key, value, padding, first_key = fetch_keys(plan.group, key, value, padding, window)
    return attend(module, query, key, value, padding, documents, first_key, window, **kwargs)


def attend_chunks(module, query, key, value, padding, documents, window, **kwargs):
    """A layout of several chunks a rank (head_tail): keys, values and the padding mask arrive in
    that layout (full: gather_sequence / gather_metadata, the global order; a window W:
    gather_halo(W - 1), one segment per chunk, its window then the chunk), and each chunk's queries
    attend at their global rows over their own keys. Returns ([B, L, H, D], None)."""
    plan, L = module.context_parallel, query.shape[2]
    group, layout = plan.group, plan.layout
    C = chunk_len(layout, L)
    if window is None:
        key = gather_sequence(key.transpose(1, 2), group, layout=layout).transpose(1, 2)  # [B, Hkv, S, D]
        value = gather_sequence(value.transpose(1, 2), group, layout=layout).transpose(1, 2)
        padding = None if padding is None else gather_metadata(padding, group, layout=layout)  # [B, S]
    else:  # one segment per chunk: [B, Hkv, h_k + C, D] each, h_k = min(cC, W - 1)
        key = gather_halo(key.transpose(1, 2), group, window - 1, layout=layout).transpose(1, 2)
        value = gather_halo(value.transpose(1, 2), group, window - 1, layout=layout).transpose(1, 2)
        padding = None if padding is None else gather_halo(padding, group, window - 1, layout=layout)
    outs, row = [], 0
    for k, c in enumerate(chunks(layout, _group.world_size(group), _group.rank(group))):
        start, first_key, keys, values, mask = c * C, 0, key, value, padding  # full: cut at the chunk's end
        if window is not None:  # this chunk's segment
            first_key = start - min(start, window - 1)
            rows = slice(row, row + start - first_key + C)
            keys, values, row = key[:, :, rows], value[:, :, rows], rows.stop
            if padding is not None:  # indexed by global key position, as attend takes it (local zeros)
                mask = torch.cat([padding.new_zeros(padding.shape[0], first_key), padding[:, rows]], dim=1)
        q = query[:, :, k * C : (k + 1) * C]  # [B, H, C, D]
        outs.append(attend(module, q, keys, values, mask, documents, first_key, window, start, **kwargs)[0])
    return torch.cat(outs, dim=1), None  # [B, L, H, D]


AttentionInterface.register(IMPLEMENTATION, attention)
AttentionMaskInterface.register(IMPLEMENTATION, local_mask)
