"""`shard_batch`: a rank's model kwargs from a global batch, and the keys a batch may hold."""

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from torch_impl import _group
from torch_impl.hf import media
from torch_impl.layout import ShardPlan
from torch_impl.layout import check as check_layout

IGNORE_INDEX = -100
BATCH_KEYS = ("input_ids", "attention_mask", "labels", "position_ids")
# a vision-language processor's token types [B, S] (0: text): accepted for text-only batches
TYPE_KEYS = ("token_type_ids", "mm_token_type_ids")
LAYOUT = "cp_layout"  # the kwarg by which shard_batch marks a rank's shard (naming its layout)


def shard_batch(
    batch: Mapping[str, torch.Tensor], group: _group.Group, *, layout: str = "contiguous"
) -> dict:
    """This rank's model kwargs from a global batch of [B, S] tensors; the same keys for every n
    (and with n > 1 the mark of a shard, `cp_layout`).

    batch: `input_ids`, optionally `attention_mask` (1: token, 0: padding), `labels` (-100:
    ignored) and `position_ids` (e.g. restarting at every document of a packed row), as the model
    takes them without CP; a vision-language processor's `token_type_ids` or `mm_token_type_ids`
    of a text-only batch (all 0: ValueError where one marks an image or video token) are checked
    and dropped, the model then running its text path, which a text-only batch takes in one
    process too. Images and videos as the processor returns them (media.MEDIA_KEYS:
    `pixel_values`, `image_grid_thw`, `pixel_values_videos`, `video_grid_thw`, `image_sizes`,
    `second_per_grid_ts`, ...) go to every rank whole, with the shards of the token types; the model's
    pre-hook splits the vision tower's work over the ranks (torch_impl.hf.media); Mllama's
    `cross_attention_mask` [B, S, images, tiles] (media.ROW_KEYS) is sharded with the tokens. Labels of a
    sequence classification model, one per row ([B] or [B, labels], any float labels), are passed
    whole, with no shift_labels or count.
    Returns the [B, L] shards, `use_cache=False`, and for labels:
    `shift_labels`, shifted over the *global* sequence (the last token of shard r predicts the first
    of shard r+1), and `num_items_in_batch`, the global count of valid shifted labels, so that the
    ranks' losses add up to the single-process mean. With data parallelism too, wrap the model
    with `apply_fsdp` or `apply_ddp` (gradients summed over CP, averaged over DP); or set
    `num_items_in_batch` to the count over all DP batches and pass them `global_num_items=True`.
    Without CP (n = 1) the same keys, with the whole sequence.

    layout: "contiguous", or "head_tail" (rank r gets chunks r and 2n-1-r of S/2n tokens: S must be
    divisible by 2n); the model must be parallelized with the same layout. With n > 1 the kwargs
    also hold `cp_layout`, the mark of a shard, which the model's pre-hook checks and removes: a
    parallelized model called without it (the whole sequence, e.g. by `generate`) runs as one
    process.
    """
    group = _group.resolve_group(group)
    check_layout(layout)
    unknown = sorted(set(batch) - {*BATCH_KEYS, *TYPE_KEYS, *media.MEDIA_KEYS, *media.ROW_KEYS})
    if unknown or "input_ids" not in batch:
        raise ValueError(
            f"`batch` must hold input_ids and optionally {BATCH_KEYS[1:]}, {TYPE_KEYS} or images and "
            f"videos {media.MEDIA_KEYS + media.ROW_KEYS}, got keys {sorted(batch)}"
        )
    whole = {key: batch[key] for key in media.MEDIA_KEYS if batch.get(key) is not None}  # every rank's
    for key in TYPE_KEYS:
        if key in batch and not whole and bool(batch[key].ne(0).any()):
            raise ValueError(
                f"`batch[{key!r}]` marks image or video tokens (nonzero types) but the batch holds no "
                f"images or videos ({media.MEDIA_KEYS})"
            )

    n, r = _group.world_size(group), _group.rank(group)
    B, S = batch["input_ids"].shape
    labels = batch.get("labels")
    # a sequence classification model's: one class per row [B], or float labels [B, labels]
    per_row = labels is not None and (labels.dim() == 1 or labels.is_floating_point())
    if per_row and labels.shape[:1] != (B,):
        raise ValueError(
            f"`batch['labels']` must be [B, S] = {(B, S)} (a label per token) or start with B = {B} (per "
            f"row, for a sequence classification model), got {tuple(labels.shape)}"
        )
    for key, value in batch.items():
        if key == "labels" and per_row or key in media.MEDIA_KEYS:
            continue
        if key in media.ROW_KEYS and tuple(value.shape[:2]) != (B, S):
            raise ValueError(
                f"`batch[{key!r}]` must start with [B, S] = {(B, S)} like input_ids, got {tuple(value.shape)}"
            )
        if key not in media.ROW_KEYS and tuple(value.shape) != (B, S):
            raise ValueError(
                f"`batch[{key!r}]` must be [B, S] = {(B, S)} like input_ids, got {tuple(value.shape)}"
            )
    # the token types of a text-only batch (all 0) are dropped; with media, sharded for mRoPE
    batch = {
        key: v for key, v in batch.items() if key not in media.MEDIA_KEYS and (whole or key not in TYPE_KEYS)
    }
    if S % n:
        raise ValueError(f"the sequence length S={S} must be divisible by the CP size n={n}")
    if layout == "head_tail" and S % (2 * n):
        raise ValueError(
            f"the sequence length S={S} must be divisible by 2n = {2 * n} under layout='head_tail' "
            f"(CP size n={n}: 2n chunks)"
        )
    L = S // n
    rows = ShardPlan.of(layout, n, r, L).rows(batch["input_ids"].device)  # [L]
    local = {key: value if key == "labels" and per_row else value[:, rows] for key, value in batch.items()}
    local |= whole
    local["use_cache"] = False
    if "labels" in batch and not per_row:
        shifted = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)  # [B, S]: target of token t
        local["shift_labels"] = shifted[:, rows]  # [B, L]
        local["num_items_in_batch"] = (shifted != IGNORE_INDEX).sum()
    if n > 1:
        local[LAYOUT] = layout
    return local
