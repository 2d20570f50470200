"""Images and videos in a CP batch, through transformers' own `mm_encoder_outputs`.

`shard_batch` gives every rank the batch's media whole (pixel values, grids, image sizes: a few
bytes a pixel, no activations) and its shard of the token ids and token types. In the forward,
rank r encodes its share of the items (images, videos; split into frames, or into the frames a
tower mixes: FRAMES_TOGETHER): contiguous, balanced by pixel count, so about 1/n of the vision
tower's work (a rank without a share encodes
the first item and keeps none of it: the tower runs, and gets gradients, on every rank, as FSDP2
and DDP need). The features (and Qwen3-VL's
deepstack features) are all-gathered, and the rank keeps those of its own placeholder tokens, in
the order the model's `masked_scatter` fills them; in backward the all-gather's reduce-scatter
returns to each encoding rank the gradients of every rank's tokens, so the vision tower and the
projector get exactly one process's gradients once summed over the ranks. (Encoding what a
rank's shard holds instead would encode an image that straddles shards on each of its ranks.)

mRoPE's 3-D positions (Qwen2-VL to Qwen4, Cosmos 3, GLM-4.1V to 4.6V, GLM-OCR, ERNIE 4.5 VL, ...)
are the model's own `compute_3d_position_ids` over the whole rows (token ids, types and padding
gathered once), then this rank's rows of them.
"""

import functools
import inspect
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.nn.functional as F

from torch_impl import _group
from torch_impl.hf import upstream
from torch_impl.hf._common import Images
from torch_impl.metadata import gather_metadata
from torch_impl.sequence import gather_sequence


class Modality(NamedTuple):
    pixels: str  # the processor's pixel values: one entry per item, or per patch where a grid is given
    grids: tuple  # names of [items, 3] (t, h, w) or [items, 2] (h, w) patches: an item's pixel rows
    per_item: tuple  # other inputs with one entry per item, split with the pixels
    token_ids: tuple  # the config's names for its placeholder token's id
    encoder: str  # the base model's method from pixels to features


MODALITIES = {
    "image": Modality(
        "pixel_values",
        # (Nemotron-H Omni's (h, w); MiniCPM-V's target_sizes: (h, w) patches a slice, packed: PACKED)
        ("image_grid_thw", "image_grid_hw", "target_sizes"),
        # (VideoLLaMA 3's merge sizes, LFM2-VL's NaFlex tiles, DeepSeek-VL hybrid's SAM pixels)
        (
            "image_sizes",
            "image_merge_sizes",
            "image_position_ids",  # (Gemma 4's patches' (x, y))
            "spatial_shapes",
            "pixel_attention_mask",
            "high_res_pixel_values",
            "num_local_patches",  # (DeepSeek-OCR 2's local views an image: none, LOCAL_VIEWS)
        ),
        ("image_token_id", "image_token_index"),
        "get_image_features",
    ),
    "video": Modality(
        "pixel_values_videos", ("video_grid_thw",), (), ("video_token_id",), "get_video_features"
    ),
}
# settings the processor gives beside the media, which the encoder takes: Granite Docling's fine
# route (a row's mask, all True when the batch takes it)
SETTINGS = ("tile_fine_mask",)
# what shard_batch passes every rank whole (Qwen2.5-VL's second_per_grid_ts: mRoPE's video timing)
MEDIA_KEYS = tuple(k for m in MODALITIES.values() for k in (m.pixels, *m.grids, *m.per_item)) + (
    "second_per_grid_ts",
    *SETTINGS,
    "pixel_values_local",  # (refused: LOCAL_VIEWS)
    "batch_num_images",  # LLaVA-OneVision's images a row [B]: made per item by _tiled
    *("aspect_ratio_ids", "aspect_ratio_mask"),  # Mllama's tiles a row's image: CROSS
)
# families whose images enter as cross-attention keys and values, not as placeholder features:
# every rank encodes the batch's images whole (the tower runs unsplit on each), and its queries, its
# shard of the text, attend over all of them (torch_impl.hf.kinds.CROSS_ATTENTION); their mask of
# which tokens see which image's tiles, [B, S, images, tiles], is sharded with the tokens (ROW_KEYS)
CROSS = ("mllama",)
ROW_KEYS = ("cross_attention_mask",)
# the families whose images are exact under CP (parity_tests/hf/test_hf_media.py); others are refused
VERIFIED = (
    *("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "qwen4_exp"),
    *("cosmos3_omni", "hyperclovax_vision_v2", "exaone4_5", "minimax_m3_vl", "dots3_note"),
    *("llava", "mistral3", "lighton_ocr", "aya_vision", "cohere2_vision", "internvl", "gemma3"),
    *("deepseek_vl", "video_llava", "qianfan_ocr"),
    *("glm4v", "glm4v_moe", "glm46v", "glmga", "glm_ocr", "cosmos3_edge", "ernie4_5_vl_moe"),
    *("cohere_compass", "qwen2_5_omni_thinker", "qwen3_omni_moe_thinker", "paddleocr_vl", "muse_spark"),
    *("vipllava", "shieldgemma2", "step3p7", "aria", "llava_next", "llava_next_video"),
    *("janus", "kimi_k25", "lfm3_vl", "hunyuan_vl", "inkling2"),
    *("video_llama_3", "lfm2_vl", "deepseek_vl_hybrid", "llama4", "fuyu", "nemotron_h_omni"),
    *("idefics2", "idefics3", "smolvlm", "granite_docling"),
    *("llava_onevision", "ovis2", "minicpmv4_6", "minicpmv4_7", "minicpm_ocr"),
    *("chameleon", "emu3", "muse_glimmer", "gemma4", "gemma4_unified", "granite4_vision", "deepseek_ocr2"),
    *("inkling_mm_model", "mllama"),
)
# families whose media are refused for a reason in the model itself: why
REFUSED = {
    "mistral4": (
        "the class the image-text mapping names (Mistral4ForCausalLM) has no vision tower: "
        "Mistral Small 4 takes images as Mistral3ForConditionalGeneration over a mistral4 text model"
    ),
}
# the encoder's output that holds a family's features, where not pooler_output: Llama 4's adapter
# output, which its forward projects itself (no deepstack features; not the text width)
FIELD = {"llama4": "last_hidden_state", "fuyu": "last_hidden_state"}  # (Fuyu's: its patches' embeddings)
# those whose videos are too (MiniMax-M3-VL's come out wrong: refused)
VIDEOS = (
    *("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"),
    *("hyperclovax_vision_v2", "exaone4_5", *("glm4v", "glm4v_moe", "glm46v", "glm_ocr")),
    *("lfm3_vl", "dots3_note", "muse_spark", "muse_glimmer", "cosmos3_edge", "cohere_compass"),
    *("ernie4_5_vl_moe", "qwen4_exp", "cosmos3_omni", "minimax_m3_vl"),
)
# families whose video frames are marked with the image token, each frame its own run of tokens
# between marks and a timestamp (the processor's types: 2), which their forward places the video's
# features on (GLM-4.1V to 4.6V, GLM-OCR: a batch holds images or videos, not both)
VIDEO_AS_IMAGE = ("glm4v", "glm4v_moe", "glm46v", "glm_ocr")
# families whose tower mixes a video's frames (videos are split into frames otherwise: the tower
# attends within a frame): the config field naming how many frames it merges in time (ERNIE 4.5
# VL's resampler: pairs; videos split into chunks of that many frames), or None where it attends
# across all of them (MiniMax-M3-VL's: videos shared whole)
FRAMES_TOGETHER = {"ernie4_5_vl_moe": "temporal_merge_size", "minimax_m3_vl": None}


class Blockwise(NamedTuple):
    """A family whose media tokens see every token of their image (or video), later ones included:
    `images` numbers them (runs of such tokens, as transformers' get_block_sequence_ids_for_mask),
    the attention fetches each image's rest and attends on their rule (attention.attend_images)."""

    key: str  # the input holding the token types the model's masks read (the adapter drops it)
    types: tuple  # the types whose runs are blocks
    full: bool  # whether full-attention layers see the blocks too (else only sliding layers)
    vision_gate: bool  # only where the text config's use_bidirectional_attention is "vision"
    up_to_window: bool  # its sliding layers see an image past the window: images up to it only


BLOCKWISE = {
    "gemma3": Blockwise("token_type_ids", (1,), True, False, False),
    "shieldgemma2": Blockwise("token_type_ids", (1,), True, False, False),
    # Gemma 4's images and videos, on its sliding layers only; the unified model's on every layer,
    # its sliding window applied before the images (exact where no image is longer than the window)
    "gemma4": Blockwise("mm_token_type_ids", (1, 2), False, True, False),
    "gemma4_unified": Blockwise("mm_token_type_ids", (1, 2), True, True, True),
}
# families whose processors give each row's images, pixel_values [B, images, C, H, W], a row with
# fewer padded with images the model drops: all zero (their pixel_attention_mask [B, images, H, W]),
# or false in Granite Docling's pixel_attention_mask [B, images]; their items are the real images
PER_ROW = ("idefics2", "idefics3", "smolvlm", "granite_docling")
# families whose processors pack every item's patches side by side, pixel_values [1, C, P, patches * P]
# (MiniCPM-V's NaViT packing): an item's pixels are its patches' P columns each
PACKED = ("minicpmv4_6", "minicpmv4_7", "minicpm_ocr")
# an encoder output's fields that are not per item, which the forward reads beside the features:
# each rank passes its own call's (Ovis2's visual indicator embeddings: table rows, no pixels)
SHARED = {"ovis2": ("visual_indicator_features",)}
# local views beside each image's global one (DeepSeek-OCR 2's, Step 3.7's): a rank whose share of
# the images has none would call the tower once, one with some twice, which FSDP2's per-call
# gathers of its layers cannot pair; refused (the global views alone are split)
LOCAL_VIEWS = "pixel_values_local"
# families whose encoder gives no pooled features, only deepstack_features as (text layer, per-item
# features) pairs, each added at its layer (Granite 4 Vision's; the first fills the placeholders)
LAYERED = ("granite4_vision",)
# the dtypes an encoder's features may have, numbered for the ranks' one exchange of their sizes
FEATURE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def given(argument, names):
    """The media the hooked forward was given (names of MEDIA_KEYS set)."""
    return [name for name in names if name in MEDIA_KEYS and argument(name) is not None]


def refusal(module, argument, media):
    """What is wrong with giving this model these media under CP, or None."""
    model_type = getattr(module.config, "model_type", type(module).__name__)
    videos = MODALITIES["video"].pixels in media
    if model_type in REFUSED:
        return f"torch_impl.hf: {type(module).__name__} was given {media}: {REFUSED[model_type]}"
    if model_type in VIDEO_AS_IMAGE and len({MODALITIES[m].pixels for m in MODALITIES} & set(media)) == 2:
        return (
            f"torch_impl.hf: {type(module).__name__} was given images and a video: it marks a "
            "video's frames with the image token, so its forward takes images or a video, not both"
        )
    if model_type in CROSS and argument(ROW_KEYS[0]) is None:
        return (
            f"torch_impl.hf: {type(module).__name__} was given {media} without a {ROW_KEYS[0]}: its "
            "cross-attention then runs without a mask, which sdpa aligns causally to the rows it "
            "holds; pass the processor's mask to hf.shard_batch"
        )
    if argument(LOCAL_VIEWS) is not None and argument(LOCAL_VIEWS).numel():
        return (
            f"torch_impl.hf: {type(module).__name__} was given local views ({LOCAL_VIEWS}): a rank "
            "whose share of the images has none would call the vision tower a different number of "
            "times from one whose share has some, which FSDP2's gathers of its layers cannot pair; "
            "pass the global views alone"
        )
    pixels = argument(MODALITIES["image"].pixels)
    if model_type in PACKED and pixels is not None and pixels.shape[0] != 1:
        return (
            f"torch_impl.hf: {type(module).__name__} was given pixel_values of {pixels.shape[0]} rows: "
            "the model encodes the first only ([1, C, P, patches * P], every image's patches side "
            "by side)"
        )
    if getattr(module.config, "density_router_hidden_size", None) is not None:
        return (
            f"torch_impl.hf: {type(module).__name__} was given {media} with a density router, which "
            "pools each row's tiles into the row's logit (and its loss): the adapter splits the "
            "tiles over the ranks but does not gather them per row for the router"
        )
    if model_type not in VERIFIED or videos and model_type not in VIDEOS:
        kind, verified = ("videos", VIDEOS) if model_type in VERIFIED else ("vision inputs", VERIFIED)
        return (
            f"torch_impl.hf: {type(module).__name__} was given {media}: {model_type} its {kind} "
            f"are not verified under CP; they are split across CP ranks for {', '.join(verified)}"
        )
    if argument("input_ids") is None:
        return (
            "torch_impl.hf: images and videos under CP need input_ids (their placeholder tokens "
            "locate the features), not inputs_embeds"
        )
    return None


def inputs(module, argument, ids, types, padding, rows, group):
    """The hooked forward's changed arguments for its media: `mm_encoder_outputs` holding this
    rank's placeholder tokens' features, the pixels dropped, and where the model makes mRoPE
    positions itself, those of rows [L]. ids, types: the gathered token ids and token types [B, S]
    (types None if not given); padding: the gathered attention_mask, bool [B, S], or None."""
    if module.config.model_type in CROSS:  # the model's own path: every image on every rank
        return {}
    changes, outputs = {}, {}
    width = module.get_input_embeddings().embedding_dim
    for name, modality in MODALITIES.items():
        pixels = argument(modality.pixels)
        if pixels is None:
            continue
        features, as_tensor, shared = _encode(module, modality, pixels, argument, group)  # [tokens, W]
        marked = MODALITIES["image"] if module.config.model_type in VIDEO_AS_IMAGE else modality
        placeholder = ids == _token_id(module.config, marked)  # [B, S]
        if placeholder.sum() != features.shape[0]:
            raise ValueError(
                f"torch_impl.hf: the batch has {int(placeholder.sum())} {name} placeholder tokens and "
                f"its {name}s {features.shape[0]} features"
            )
        order = placeholder.flatten().cumsum(0).view_as(placeholder) - 1  # [B, S]: feature of each
        mine = features[order[:, rows][placeholder[:, rows]]]  # [local tokens, W], row-major
        field = FIELD.get(module.config.model_type, "pooler_output")
        pooled, *deep = (mine,) if module.config.model_type in FIELD else mine.split(width, dim=-1)
        pooled = pooled[None] if as_tensor else (pooled,)  # as the model's encoder returns them
        deepstack = [(d,) for d in deep]  # (Granite Docling's forward reads router_logits: no router)
        if module.config.model_type in LAYERED:  # (text layer, features) pairs, the first's included
            config = module.config
            layers = [text for _, text in config.deepstack_layer_map] + list(config.spatial_target_layers)
            deepstack = list(zip(layers, [pooled, *deepstack], strict=True))
        outputs[name] = SimpleNamespace(
            **{field: pooled}, deepstack_features=deepstack, router_logits=None, **shared
        )
        changes[modality.pixels] = None
    changes["mm_encoder_outputs"] = outputs
    given = argument("position_ids") is not None
    positions = None if given else _positions(module, argument, ids, types, padding)  # [axes, B, S]
    if positions is not None:  # the model's mRoPE over the whole rows: this rank's
        changes["position_ids"] = positions[..., rows]  # [axes, B, L]
        changes["mm_token_type_ids"] = None  # (used for the positions only)
    return changes


def images(module, types, shard):
    """For a family in BLOCKWISE whose rule is on, given its token types: its Images (each token's
    block numbered as transformers' get_block_sequence_ids_for_mask does: runs of the rule's types;
    per global chunk how far its last token's block runs on past its end, the most over the
    batch's rows; the chunks holding blocks), in one host read; else None (ValueError where the
    installed transformers numbers them otherwise: torch_impl.hf.upstream, or where an image is
    longer than a window its rule needs it within). types: the gathered types [B, S], or None."""
    rule = BLOCKWISE.get(getattr(module.config, "model_type", None))
    vision = getattr(module.config.get_text_config(), "use_bidirectional_attention", None) == "vision"
    if types is None or rule is None or rule.vision_gate and not vision:
        return None
    upstream.check("torch_impl.hf.media.images")
    image = torch.isin(types, torch.tensor(rule.types, device=types.device))  # [B, S]
    starts = image & ~F.pad(image, (1, 0))[:, :-1]
    ids = torch.where(image, starts.long().cumsum(dim=1) - 1, -1)  # [B, S]
    (B, S), C, count = ids.shape, shard.chunk_len, shard.num_chunks
    rows = torch.arange(S, device=ids.device).expand(B, S)
    last = torch.full_like(ids, -1)  # [B, S]: per image id, its last row (text scatters -1 into slot 0)
    last = last.scatter_reduce(1, ids.clamp(min=0), torch.where(image, rows, -1), "amax")
    run_end = last.gather(1, ids.clamp(min=0)) + 1  # [B, S]: one past each token's image
    ends = torch.arange(C, count * C, C, device=ids.device)  # [count - 1]: every chunk's end but the last's
    spill = torch.where(image[:, ends - 1], run_end[:, ends - 1] - ends, 0).clamp(min=0)  # [B, count - 1]
    seeing = image.view(B, count, C).any(dim=2).any(dim=0)  # [count]
    longest = image.new_zeros(B, S, dtype=torch.long).scatter_add(1, ids.clamp(min=0), image.long()).amax()
    both = torch.cat([spill.amax(dim=0), spill.new_zeros(1), seeing.long(), longest[None]]).tolist()
    window = getattr(module.config.get_text_config(), "sliding_window", None)
    if rule.up_to_window and window is not None and both[-1] > window:
        raise ValueError(
            f"torch_impl.hf: {module.config.model_type}'s sliding layers let an image's tokens see "
            f"their whole image beyond the window; an image of {both[-1]} tokens, longer than its "
            f"sliding_window ({window}), is not split under CP"
        )
    ahead, seen = tuple(both[:count]), frozenset(c for c in range(count) if both[count + c])
    return Images(ids, ahead, seen, rule.full)


def _positions(module, argument, ids, types, padding):
    """The model's own positions for its media (`compute_3d_position_ids`: mRoPE's [3, B, S]) over
    the whole rows, or None for a model that makes none."""
    compute = getattr(module, "compute_3d_position_ids", None)
    if compute is None:
        return None
    values = {
        "input_ids": ids,
        "inputs_embeds": None,
        "attention_mask": None if padding is None else padding.long(),
        "past_key_values": None,
        "mm_token_type_ids": types,
    }
    grids = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
    grids += ("target_sizes", "target_sizes_videos", "downsample_mode")  # (MiniCPM-V 4.7's canvas)
    values |= {key: argument(key) for key in grids}
    taken = inspect.signature(compute).parameters
    return compute(**{key: value for key, value in values.items() if key in taken})


def _token_id(config, modality):
    for key in modality.token_ids:
        if getattr(config, key, None) is not None:
            return getattr(config, key)
    raise ValueError(
        f"torch_impl.hf: the config names no placeholder token ({' or '.join(modality.token_ids)})"
    )


def share(weights, n):
    """Each rank's items [lo, hi): contiguous, balanced by weight (an item goes to the rank whose
    part of the total holds its middle)."""
    weights = [float(w) for w in weights]
    total, before, owner = sum(weights) or 1.0, 0.0, []
    for w in weights:
        owner.append(min(int(n * (before + w / 2) / total), n - 1))
        before += w
    return [(sum(o < r for o in owner), sum(o <= r for o in owner)) for r in range(n)]


def _real_images(pixels, argument):
    """A PER_ROW family's images [B, images, C, H, W] as items: the real ones [items, C, H, W] in
    row order, by the model's rule (PER_ROW), and `argument` giving their pixel_attention_mask
    ([items, H, W], or [items] all true)."""
    flat = pixels.flatten(0, 1)  # [B * images, C, H, W]
    mask = argument("pixel_attention_mask")
    if mask is not None and mask.dim() == 2:  # [B, images]: which are real
        real = mask.flatten().bool()
    else:  # a padding image is all zero
        real = flat.flatten(1).ne(0).any(dim=1)  # [B * images]
    mask = None if mask is None else mask.flatten(0, 1)[real]
    return flat[real], lambda key: mask if key == "pixel_attention_mask" else argument(key)


def _tiled(counts, lo, hi):
    """LLaVA-OneVision's items [lo, hi) given its `batch_num_images` [B] (images a row): an image is
    tiled only when alone in its row. The order to encode them in (tiled ones first) and the counts
    that tile just those: 1 each, then the untiled as one row of at least 2 (get_image_features
    zips its per-image flags with the images, so a row of 2 holding one image leaves it untiled)."""
    tiled = [int(k) == 1 for k in counts.tolist() for _ in range(int(k))][lo:hi]
    order = sorted(range(hi - lo), key=lambda i: not tiled[i])  # (stable)
    untiled = tiled.count(False)
    return order, torch.tensor([1] * (hi - lo - untiled) + ([max(untiled, 2)] if untiled else []))


def _share_inputs(module, modality, pixels, named_grid, rows, lo, hi, argument):
    """The encoder's inputs for items [lo, hi) (rows: each item's pixel rows), and for
    LLaVA-OneVision the order they are encoded in (_tiled), else None."""
    (name, grid), start, stop = named_grid, int(rows[:lo].sum()), int(rows[:hi].sum())
    kwargs = {modality.pixels: pixels[start:stop]}
    if module.config.model_type in PACKED:  # [1, C, P, patches * P]: P columns a patch
        P = pixels.shape[-2]
        kwargs[modality.pixels] = pixels[..., start * P : stop * P]
    if grid is not None:
        kwargs[name] = grid[lo:hi]
    for key in modality.per_item:
        if argument(key) is not None:
            kwargs[key] = argument(key)[lo:hi]
    if module.config.model_type in PER_ROW:  # one row of them
        kwargs = {key: value[None] for key, value in kwargs.items()}
    order = None
    if modality.pixels == "pixel_values" and argument("batch_num_images") is not None:
        order, kwargs["batch_num_images"] = _tiled(argument("batch_num_images"), lo, hi)
        kwargs = {key: value[order] if key != "batch_num_images" else value for key, value in kwargs.items()}
    return kwargs, order


def _frame_chunks(config, t):
    """The frames each piece of the items of t frames [items] holds: 1 (the tower attends within a
    frame), or for a FRAMES_TOGETHER family the frames its tower merges (ValueError where they do
    not divide t) or all t."""
    if config.model_type not in FRAMES_TOGETHER:
        return torch.ones_like(t)
    field = FRAMES_TOGETHER[config.model_type]
    if field is None:
        return t.clone()
    merged = getattr(config.vision_config, field)
    if bool((t % merged).any()):
        raise ValueError(
            f"torch_impl.hf: {config.model_type}'s tower merges {merged} frames at a time; items of "
            f"{t.tolist()} frames do not split into them"
        )
    return torch.full_like(t, merged)


def _encode(module, modality, pixels, argument, group):
    """Every item's features [tokens, W] in item order (pooled, then any deepstack features side by
    side), this rank having encoded its share; whether the model's encoder returns its pooled
    features as one tensor (not one per item); and the encoder's outputs that are not per item
    (SHARED: this rank's own call's). LLaVA-OneVision's share is encoded tiled images first
    (_tiled) and put back in item order. Items with a (t, h, w) grid are split into their
    frames (t = 1 each: the Qwen towers attend within a frame), so that one long video is shared
    too; a FRAMES_TOGETHER family's videos into the frames its tower mixes (_frame_chunks)."""
    n, r = _group.world_size(group), _group.rank(group)
    if module.config.model_type in PER_ROW:
        pixels, argument = _real_images(pixels, argument)
    name = next((key for key in modality.grids if argument(key) is not None), None)
    grid = None if name is None else argument(name)
    if grid is not None and grid.shape[-1] == 3 and all(argument(key) is None for key in modality.per_item):
        t = grid[:, 0]  # [items]
        video = modality is MODALITIES["video"]
        chunk = _frame_chunks(module.config, t) if video else torch.ones_like(t)  # [items]: frames a piece
        grid = grid.repeat_interleave(t // chunk, dim=0)  # [pieces, 3], a new tensor
        grid[:, 0] = chunk.repeat_interleave(t // chunk)
    rows = grid.prod(-1) if grid is not None else torch.ones(len(pixels), dtype=torch.long)  # [items]
    lo, hi = share(rows.tolist(), n)[r]
    # a rank without a share encodes the first item and keeps none of it, so that the encoder runs
    # on every rank (FSDP2 gathers its parameters on each; DDP waits for their gradients: zeros here)
    kept = hi > lo
    if not kept and len(rows):
        lo, hi = 0, 1
    x, shared = None, {}
    if hi > lo:
        kwargs, order = _share_inputs(module, modality, pixels, (name, grid), rows, lo, hi, argument)
        encoder = getattr(module, modality.encoder)
        for key in inspect.signature(encoder).parameters:  # settings the forward passes on
            if key not in kwargs and (key not in MEDIA_KEYS or key in SETTINGS) and argument(key) is not None:
                kwargs[key] = argument(key)
        out = encoder(**kwargs, return_dict=True)
        layered = module.config.model_type in LAYERED  # (its first layer's features as the pooled)
        pairs = out.deepstack_features if layered else None
        output = (
            pairs[0][1] if layered else getattr(out, FIELD.get(module.config.model_type, "pooler_output"))
        )
        as_tensor = not isinstance(output, (tuple, list))  # [items, tokens, W], not per item
        if order is not None:  # back in item order
            output = [output[order.index(i)] for i in range(len(order))]
        shared = {key: getattr(out, key) for key in SHARED.get(module.config.model_type, ())}
        pooled = torch.cat(list(output)) if isinstance(output, (tuple, list)) else output
        deep = [f for _, f in pairs[1:]] if layered else getattr(out, "deepstack_features", None) or []
        deep = [torch.cat(list(f)) for f in deep]
        x = torch.cat([pooled.flatten(0, -2), *deep], dim=-1)  # [tokens, W]
        x = x if kept else x[:0]  # [0, W]: none kept, a zero gradient back through the encoder
    embeddings = module.get_input_embeddings().weight
    kind = 0 if x is None else 1 + FEATURE_DTYPES.index(x.dtype)  # 0: encoded nothing
    mine = [0, 0, 0, 0, 0] if x is None else [*x.shape, x.requires_grad, as_tensor, kind]
    sizes = gather_metadata(torch.tensor([[mine]], device=embeddings.device), group)[0]  # [n, 5]
    M, W, grad, as_tensor, _ = (int(v) for v in sizes.amax(dim=0))  # (tokens, width, grad, a tensor)
    # one dtype on the wire: what the encoding ranks made (under autocast, the projector's, which
    # may not be the embeddings'), promoted where they differ; a rank that encoded nothing sends it
    dtypes = [FEATURE_DTYPES[k - 1] for k in set(sizes[:, 4].tolist()) - {0}]
    dtype = functools.reduce(torch.promote_types, dtypes) if dtypes else embeddings.dtype
    x = embeddings.new_zeros(0, W, dtype=dtype) if x is None else x.to(dtype)
    padded = F.pad(x, (0, W - x.shape[1], 0, M - x.shape[0]))[None]  # [1, M, W]
    if grad and not padded.requires_grad and torch.is_grad_enabled():  # every rank joins backward
        padded = padded.detach().requires_grad_()
    every = gather_sequence(padded, group)[0].view(n, M, W)  # [n, M, W]
    features = torch.cat([every[i, : int(sizes[i, 0])] for i in range(n)])  # [tokens, W]
    return features, bool(as_tensor), shared
