"""`causal_attention` and the table that picks its kernel per device and layer (torch_impl.attention)."""

import functools
import math

import torch
import torch.nn.functional as F

from torch_impl.attention.rule import check_arguments, mask_mod, repeat_kv
from torch_impl.attention.tiles import tiled_attention


def causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_start: int,
    k_start: int,
    *,
    window: int | None = None,
    scale: float | None = None,
    documents: torch.Tensor | None = None,
    padding: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    document_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries over its keys, by global position; differentiable.

    query: [B, H, L, D] at global rows q_start ..; key, value: [B, Hkv, T, D] and [B, Hkv, T, Dv] at
    global rows k_start .. q_start + L - 1 (H a multiple of Hkv: grouped-query attention; Dv may
    differ from D, as in MLA: the fused kernels then see all three zero-padded); window: a query sees
    `window` keys, itself included, or all earlier ones when None; scale: default 1/sqrt(D);
    documents: int [B, T] (packed sequences) and padding: bool [B, T] (True: a token), per key row;
    softcap: scores become softcap * tanh(score / softcap) before the mask (Gemma 2); sinks: [H],
    one learned logit per query head that joins every query's softmax denominator and adds no value
    (GPT-OSS), differentiable; document_starts: int [B, L], with `documents` that run in order, the
    global row where each query's document begins (as torch_impl.layout.document_starts finds them
    over the whole rows), where the caller has them: the CPU tiles then plan from these and scan no
    ids (unchecked against `documents`). Returns [B, H, L, D] in query's dtype (under autocast, as sdpa:
    q, k and v that autocast casts, floating and not float64, in the autocast dtype, and so the
    output; float64 ones as they are).
    """
    if torch.is_autocast_enabled(query.device.type):  # as sdpa under autocast (autocast's eligibility)
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = (
            t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t
            for t in (query, key, value)
        )
    check_arguments(
        query, key, value, q_start, k_start, window, documents, padding, softcap, sinks, document_starts
    )
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    width, Dv = max(query.shape[-1], value.shape[-1]), value.shape[-1]
    if query.shape[-1] != Dv:  # zero columns change no score and add no output
        query, key, value = (F.pad(t, (0, width - t.shape[-1])) for t in (query, key, value))
    kernel = choose_kernel(query, window, documents, padding, softcap, sinks)
    out = _KERNELS[kernel](
        query,
        key,
        value,
        q_start,
        k_start,
        window,
        scale,
        documents,
        padding,
        softcap,
        sinks,
        document_starts,
    )
    return out if width == Dv else out[..., :Dv]  # [B, H, L, Dv]


def choose_kernel(
    query: torch.Tensor,
    window: int | None,
    documents: torch.Tensor | None,
    padding: torch.Tensor | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> str:
    """The kernel name for this call (the table in the module docstring)."""
    if query.device.type != "cuda":
        return "tiled"
    plain = window is None and documents is None and padding is None and softcap is None and sinks is None
    return "flash" if plain and _flash_fits(query) else "flex"


# --- CUDA ---------------------------------------------------------------------------------------


def _flash_fits(query):
    return (
        query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] % 8 == 0 and query.shape[-1] <= 256
    )


def _flash(query, key, value, q_start, k_start, window, scale, documents, padding, softcap, sinks, starts):
    """Global causal attention aligned bottom-right (queries are the last L of the T keys): the
    flash op's own `is_causal` for L < T, as torch's `causal_lower_right` dispatches it."""
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # [B, H, T, D]
    return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, True, scale=scale)[0]


@functools.cache
def _compiled_flex():
    """flex_attention and create_block_mask, compiled (eager flex_attention materializes the scores)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return torch.compile(create_block_mask), torch.compile(flex_attention)


def _flex(query, key, value, q_start, k_start, window, scale, documents, padding, softcap, sinks, starts):
    """flex_attention with a BlockMask built by evaluating `mask_mod` block by block (no dense mask);
    soft-capping as its `score_mod`; sinks through its log-sum-exp (differentiable in flex):
    out * sigmoid(lse - sink), the softmax whose denominator has the sink's exp(sink) added."""
    from torch.nn.attention.flex_attention import AuxRequest

    create_block_mask, flex_attention = _compiled_flex()
    B, H, L, _ = query.shape
    per_row = documents is not None or padding is not None
    rule = mask_mod(q_start, k_start, window, documents, padding)
    block_mask = create_block_mask(rule, B if per_row else None, None, L, key.shape[2], device=query.device)
    score_mod = None if softcap is None else functools.partial(_capped, softcap=softcap)
    out = flex_attention(
        query,
        key,
        value,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=H != key.shape[1],
        return_aux=None if sinks is None else AuxRequest(lse=True),
    )
    if sinks is None:
        return out
    out, aux = out  # [B, H, L, D], lse [B, H, L] (float32; -inf where a query sees nothing)
    weight = torch.sigmoid(aux.lse - sinks.float()[None, :, None])  # [B, H, L]: 0 where it saw nothing
    return (out.float() * weight[..., None]).to(query.dtype)


def _capped(score, b, h, q_idx, kv_idx, softcap):
    return softcap * torch.tanh(score / softcap)


def _tiled(query, key, value, q_start, k_start, window, scale, documents, padding, softcap, sinks, starts):
    return tiled_attention(
        query, key, value, q_start, k_start, window, scale, documents, padding, softcap, sinks, starts
    )[0]


_KERNELS = {"flash": _flash, "flex": _flex, "tiled": _tiled}
