"""The visibility rule of a rank's causal attention (flex_attention's `mask_mod` form) and the
checks of its arguments."""

from collections.abc import Callable

import torch


def mask_mod(
    q_start: int,
    k_start: int,
    window: int | None,
    documents: torch.Tensor | None,
    padding: torch.Tensor | None,
) -> Callable:
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


def check_arguments(
    query, key, value, q_start, k_start, window, documents, padding, softcap=None, sinks=None, starts=None
):
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
    if softcap is not None and not softcap > 0:
        raise ValueError(
            f"`softcap` must be positive (scores become softcap * tanh(score / softcap)), got {softcap}"
        )
    if sinks is not None and tuple(sinks.shape) != (H,):
        raise ValueError(f"`sinks` must be [H] = ({H},), one logit per query head, got {tuple(sinks.shape)}")
    if starts is not None and (
        documents is None
        or tuple(starts.shape) != (B, L)
        or starts.is_floating_point()
        or starts.dtype == torch.bool
    ):
        raise ValueError(
            f"`document_starts` must be integer [B, L] = {(B, L)}, one per query, given with `documents`; "
            f"got {starts.dtype} {tuple(starts.shape)}"
            + ("" if documents is not None else " without documents")
        )


def repeat_kv(t, groups):
    """[B, Hkv, T, D] -> [B, Hkv * groups, T, D], each key head repeated for its query heads."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)
