"""What each gloo rank runs for parity_tests/hf/test_hf_media.py: a tiny vision-language model given a
batch with images (and a video where the family has one), made CP by torch_impl.hf, against the
same model in one process on the whole batch, with zoo_cases' float64 bounds.

The batch (B = 2, S = 32, boundaries of 2 and 4 ranks at 8, 16, 24): row 0 holds image A across
the boundary at 8 and image B; row 1, left-padded by 3, holds image C (or a video) across the
boundary at 16. With 4 ranks and 3 items one rank encodes nothing.
"""

import copy

import torch
import torch.distributed as dist

from parity_tests.harness import bounds
from parity_tests.hf import zoo, zoo_cases
from torch_impl import hf
from torch_impl.hf import attention, media

S = 32
# families whose processors give patch rows and (t, h, w) grids, as Qwen's
GRIDS_OF = (
    *("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "qwen4_exp"),
    *("cosmos3_omni", "hyperclovax_vision_v2", "exaone4_5", "minimax_m3_vl", "dots3_note"),
    *("glm4v", "glm4v_moe", "glm46v", "glmga", "glm_ocr", "cosmos3_edge", "ernie4_5_vl_moe"),
    *("cohere_compass", "qwen2_5_omni_thinker", "qwen3_omni_moe_thinker", "paddleocr_vl", "muse_spark"),
    *("kimi_k25", "lfm3_vl", "hunyuan_vl", "inkling2", "video_llama_3", "muse_glimmer"),
)
PATCHES = ("paddleocr_vl", "kimi_k25")  # their processors give each patch as a [C, P, P] image, not a row
# grids that are not Qwen's (t, h, w patches, 2 x 2 merged): HunYuan-VL's images take (h/2)(w/2 + 1) + 2
# tokens (a row end per row, a begin and an end); Inkling 2's count its tokens, each a [2P, 2P, C] patch
GRIDS_FOR = {
    "hunyuan_vl": ((1, 4, 4), (1, 2, 4), (1, 4, 4)),  # 8, 5, 8 tokens
    "inkling2": ((1, 2, 4), (1, 2, 2), (1, 2, 4)),  # 8, 4, 8 tokens
}
# MiniCPM-V's slices of (h, w) patches, packed side by side: 16x mode, 4 x 4 patches a token; 4x
# (MiniCPM-OCR's), 2 x 2: 8, 4 and 8 tokens
PACKED_SIZES = {
    "minicpmv4_6": ((8, 16), (8, 8), (8, 16)),
    "minicpmv4_7": ((8, 16), (8, 8), (8, 16)),
    "minicpm_ocr": ((4, 8), (4, 4), (4, 8)),
}
VISION = {  # the vision tower's tiny sizes: images of 4 tokens
    "llava": dict(image_size=16, patch_size=8),
    "mistral3": dict(image_size=16, patch_size=4),
    "lighton_ocr": dict(image_size=16, patch_size=4),
    "aya_vision": dict(image_size=16, patch_size=4),
    "cohere2_vision": dict(image_size=16, patch_size=4),
    "internvl": dict(image_size=[16, 16], patch_size=[4, 4]),
    "gemma3": dict(image_size=24, patch_size=4),  # 6 x 6 patches pooled to 3 x 3: images of 9 tokens
    "deepseek_vl": dict(image_size=16, patch_size=8),
    "video_llava": dict(image_size=16, patch_size=8),
    "qianfan_ocr": dict(image_size=[16, 16], patch_size=[4, 4]),
    "paddleocr_vl": dict(image_size=16, patch_size=4),
    "vipllava": dict(image_size=16, patch_size=8),
    "shieldgemma2": dict(image_size=24, patch_size=4),
    "step3p7": dict(image_size=32, patch_size=4),  # 8 x 8 patches, two stride-2 downsamplers: 4 tokens
    "aria": dict(image_size=16, patch_size=4),
    # any resolution: tiles of 1 patch (CLIP's CLS dropped); the whole image, then 2 x 2 tiles with a
    # newline a row of tiles: 1 + 2 * (2 + 1) = 7 tokens
    "llava_next": dict(image_size=8, patch_size=8),
    "llava_next_video": dict(image_size=8, patch_size=8),
    "janus": dict(image_size=16, patch_size=8, projection_dim=32),  # its aligner ends at projection_dim
    "kimi_k25": dict(patch_size=4),
    "lfm3_vl": dict(patch_size=4),
    "hunyuan_vl": dict(patch_size=4),
    "inkling2": dict(patch_size=4),
    "video_llama_3": dict(patch_size=4),
    "lfm2_vl": dict(patch_size=4, num_patches=16),  # 4 x 4 patches, downsampled 2 x 2: 4 tokens
    "deepseek_vl_hybrid": dict(image_size=16, patch_size=8),
    # 4 x 4 patches pixel-shuffled (ratio 0.5) to 2 x 2: 4 tokens; its projector 48 wide, past the
    # text width (its forward projects the features the ranks exchange). (In float64 its tower's
    # complex rope buffer keeps its real part: both sides run the same tower.)
    # 4 x 4 patches, Idefics3's and SmolVLM's pixel-shuffled (scale 2) to 4 tokens, Idefics2's
    # resampled to its perceiver's latents (4: SUBCONFIGS)
    "idefics2": dict(image_size=16, patch_size=4),
    "idefics3": dict(image_size=16, patch_size=4),
    "smolvlm": dict(image_size=16, patch_size=4),
    "granite_docling": dict(image_size=16, patch_size=4),  # (its fine route: 4 tokens a tile)
    "llava_onevision": dict(image_size=8, patch_size=4),  # tiles of 2 x 2 patches (SigLIP: no CLS)
    "ovis2": dict(image_size=8, patch_size=4),  # 4 tokens a tile (hidden_stride 1)
    "inkling_mm_model": dict(patch_size=4),
    # MiniCPM-V: an 8 x 8 position grid; its window merger after layer 0 (at the default 6 the tiny
    # tower never runs it, while get_image_features still halves the target sizes)
    **{family: dict(image_size=32, patch_size=4, insert_layer_id=0) for family in PACKED_SIZES},
    "llama4": dict(
        image_size=16,
        patch_size=4,
        intermediate_size=128,
        vision_output_dim=48,
        projector_input_dim=48,
        projector_output_dim=48,
    ),
}
CONFIG = {  # the model config's own fields for these images
    "llava_next": dict(image_grid_pinpoints=[[16, 16]]),
    "llava_next_video": dict(image_grid_pinpoints=[[16, 16]]),
    # A and B share row 0, so are not tiled (a tile and a newline: 5 tokens); C, alone in row 1 and
    # 8 x 16, is tiled 1 x 2 at pinpoint (8, 16): its base tile, 2 x 4 features, 2 newlines: 14
    "llava_onevision": dict(image_grid_pinpoints=[[8, 8], [8, 16]]),
    "ovis2": dict(visual_indicator_token_ids=[86, 87, 88, 89, 90]),  # (its defaults: past the vocabulary)
    **{family: dict(image_token_id=80, insert_layer_id=0) for family in PACKED_SIZES},  # (default: None)
}
CONFIG["minicpmv4_7"] |= dict(
    image_start_id=86, image_end_id=87, slice_start_id=88, slice_end_id=89, newline_id=90
)
# DeepSeek-OCR 2's images: 144 queries and a separator (global views: local ones are refused), in
# rows of 320
COUNTS = {"llava_onevision": (5, 5, 14), "deepseek_ocr2": (145, 145, 145)}
LENGTH = {"deepseek_ocr2": 320}  # placeholder tokens of images A, B, C, where they differ
# the marks around an image, where its forward reads them (Ovis2's indicators: their own embeddings)
MARKS = {
    "ovis2": lambda config: config.visual_indicator_token_ids[::4],
    "minicpmv4_7": lambda config: (config.image_start_id, config.image_end_id),
}
SUBCONFIGS = {
    "idefics2": {"perceiver_config": dict(resampler_n_latents=4)},
    # Mllama: a cross-attention text layer (the zoo's has none within its 2), and a tower of 28 x 28
    # tiles of 2 x 2 patches, up to 2 tiles an image, its features from one intermediate layer
    "mllama": {
        "text_config": dict(cross_attention_layers=[1]),
        "vision_config": dict(
            image_size=28,
            num_global_layers=1,
            intermediate_layers_indices=[0],
            vision_output_dim=64,
            max_num_tiles=2,
            supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]],
        ),
    },
}
# Mllama's images (media.CROSS): (row, its image token, aspect ratio id: 1 tile, or 1 x 2, 2 x 1)
CROSS_IMAGES = ((0, 6, 2), (0, 20, 1), (1, 12, 3))
TILES = {
    "llava_next": 5,
    "llava_next_video": 5,
    "llava_onevision": 3,
    "granite4_vision": 3,  # (a 16 x 16 image at pinpoint (16, 32): its base tile and 1 x 2: 10 tokens)
}  # any resolution: pixel_values [3, tiles, C, H, W]
MM_TOKENS = {"gemma3": 9, "shieldgemma2": 9}  # config.mm_tokens_per_image
IMAGE_SIZES = ("mistral3", "lighton_ocr", *TILES)  # their images come with their sizes
GRIDS = ((1, 4, 8), (1, 4, 4), (1, 4, 8))  # Qwen's images A, B, C: (t, h, w) patches, 8, 4, 8 tokens
VIDEO = (2, 4, 4)  # Qwen's video in C's place: 2 temporal patches, 8 tokens
VIDEO_OF = {"ernie4_5_vl_moe": (4, 4, 4)}  # (two pairs of frames its tower merges: 8 tokens)
FRAMES = (
    *("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"),
    *media.VIDEO_AS_IMAGE,  # (GLM's frames: its image token, type 2; no images beside them)
    *("cosmos3_edge", "cohere_compass", "qwen4_exp", "cosmos3_omni"),  # (positions: a run a frame)
)  # their videos' frames apart, each with its timestamp (at 14 and 21)
STARTS = ((0, 6), (0, 20), (1, 12))  # (row, first placeholder) of A, B, C
# Gemma 3's images of 9 tokens, longer than its sliding window (8): A at [11, 20) across the two
# ranks' edge and ending at a chunk's end (head_tail on 4 ranks: chunks of 4), B at [23, 32) to the
# row's end, C at [5, 14); on 4 ranks chunk 2's lookahead runs 8 tokens on, past a sliding
# layer's 7 back, and B and C span three ranks' chunks
STARTS_OF = {
    "gemma3": ((0, 11), (0, 23), (1, 5)),
    "shieldgemma2": ((0, 11), (0, 23), (1, 5)),
    "gemma4": ((0, 11), (0, 23), (1, 5)),  # (its images on sliding layers only: full layers causal)
    "deepseek_ocr2": ((0, 6), (0, 158), (1, 12)),  # across 160, and 80 and 240 of 4 ranks' edges
}


def gemma4_vision(model_type):
    """Gemma 4's tiny vision configs (the zoo's have none): patches of 4 pixels pooled 2 x 2 (the
    unified model's rows: merged patches of 8)."""
    from transformers.models.gemma4.configuration_gemma4 import Gemma4VisionConfig
    from transformers.models.gemma4_unified.configuration_gemma4_unified import Gemma4UnifiedVisionConfig

    if model_type == "gemma4":
        sizes = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
        sizes |= dict(num_key_value_heads=2, head_dim=8, position_embedding_size=16)
        return Gemma4VisionConfig(patch_size=4, pooling_kernel_size=2, **sizes)
    return Gemma4UnifiedVisionConfig(
        patch_size=4, pooling_kernel_size=2, mm_embed_dim=16, mm_posemb_size=16, output_proj_dims=16
    )


# Gemma 4's images (h, w pixels): 9 tokens, past its sliding window (8), for gemma4; 8 for the unified
# model (its sliding layers let an image see itself past the window: images up to it, media.images)
GEMMA4 = {"gemma4": (24, 24), "gemma4_unified": (16, 32)}


# families whose processors give neither Qwen's grids nor [3, C, size, size] images: Fuyu's patch
# rows, a token each (no vision tower: a linear layer), 4 an image; Nemotron-H Omni's patch rows with
# (h, w) grids, 4 x 4 patches pixel-shuffled to 4 tokens
PATCH_ROWS = {"fuyu": 4, "inkling_mm_model": 4}  # (Inkling's: a [T, P, P, C] patch a token)
VQ_SIDE = {
    "chameleon": 4,
    "emu3": 4,
}  # VQ tokenizers' images: 4 x 4 pixels, 4 tokens (Emu3's 6: a row end a row)
HW_GRIDS = ("nemotron_h_omni",)


def build(model_type):
    config = zoo.tiny_config(model_type)
    if model_type in GEMMA4:
        config.vision_config = gemma4_vision(model_type)
        config.get_text_config().use_bidirectional_attention = "vision"  # (gemma4's default: None)
    vision = getattr(config, "vision_config", None)  # (Fuyu has none)
    for key, value in VISION.get(model_type, {}).items():
        setattr(vision, key, value)
    if model_type in MM_TOKENS:
        config.mm_tokens_per_image = MM_TOKENS[model_type]
    for key, value in CONFIG.get(model_type, {}).items():
        setattr(config, key, value)
    for sub, fields in SUBCONFIGS.get(model_type, {}).items():
        for key, value in fields.items():
            setattr(getattr(config, sub), key, value)
    if hasattr(vision, "out_hidden_size"):  # Qwen's merger projects to the text width
        vision.out_hidden_size = config.get_text_config().hidden_size
    torch.manual_seed(0)
    model = zoo.TASKS["image_text"][0].from_config(config).to(torch.float64).eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    # weights whose init is zero, behind which the tower would get no gradient to compare: Gemma 3's
    # projector, DeepSeek-VL hybrid's gate of its SAM tower's global features (neck and projection)
    projector = getattr(model.base_model, "multi_modal_projector", None)
    with torch.no_grad():
        if hasattr(projector, "mm_input_projection_weight"):
            weight = projector.mm_input_projection_weight
            weight.normal_(std=weight.shape[0] ** -0.5, generator=torch.Generator().manual_seed(1))
        if hasattr(model.base_model, "high_res_vision_alpha"):
            model.base_model.high_res_vision_alpha.fill_(0.5)
        for name, weight in model.named_parameters():  # Mllama's cross-attention layer's gates
            if name.endswith(("cross_attn_attn_gate", "cross_attn_mlp_gate")):
                weight.fill_(0.5)
    return model


def media_batch(config, video=False, seed=3, count=4):
    """The module docstring's batch: token ids, attention_mask, labels, the processor's media and
    token types (1: image, 2: video)."""
    gen = torch.Generator().manual_seed(seed)
    if config.model_type in media.CROSS:
        return _cross_batch(config, gen)
    qwen = config.model_type in GRIDS_OF
    count = PATCH_ROWS.get(config.model_type, count)
    image, video_id = config.image_token_id, getattr(config, "video_token_id", None)
    marks = [getattr(config, k, None) for k in ("vision_start_token_id", "vision_end_token_id")]
    special = {image, video_id, *marks, getattr(config.get_text_config(), "pad_token_id", None)}
    text = torch.tensor([t for t in range(*zoo.TOKENS) if t not in special])
    length = LENGTH.get(config.model_type, S)
    ids = text[torch.randint(len(text), (2, length), generator=gen)]
    types = torch.zeros_like(ids)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    three = GRIDS_FOR.get(config.model_type, GRIDS)
    grids = list(three[:2]) + ([] if video else [three[2]])
    if video and config.model_type in media.VIDEO_AS_IMAGE:  # (its forward takes images or a video)
        grids = []
    starts = STARTS_OF.get(config.model_type, STARTS)
    items = [(s, g, 1) for s, g in zip(starts, grids, strict=False)]
    clip = VIDEO_OF.get(config.model_type, VIDEO)
    items += [(starts[2], clip, 2)] if video else []
    counts = _counts(config) or [count] * 3
    for ((row, start), grid, kind), tokens in zip(items, counts + [count], strict=False):
        count = _grid_tokens(config.model_type, grid) if qwen else tokens
        if kind == 2 and config.model_type in media.FRAMES_TOGETHER:  # its frames merged in time
            count //= getattr(config.vision_config, media.FRAMES_TOGETHER[config.model_type] or "", 1)
        segments = [(start, count)]
        if kind == 2 and config.model_type in FRAMES:  # <t> <start> frame <end> <t> <start> frame <end>
            segments = [(start + 2 + 7 * t, count // grid[0]) for t in range(grid[0])]
        for first, tokens in segments:
            as_image = kind == 1 or config.model_type in media.VIDEO_AS_IMAGE
            ids[row, first : first + tokens] = image if as_image else video_id
            types[row, first : first + tokens] = kind
            if qwen and None not in marks:  # vision start and end marks, where the config has them
                ids[row, first - 1], ids[row, first + tokens] = marks
            if config.model_type in MARKS:
                ids[row, first - 1], ids[row, first + tokens] = MARKS[config.model_type](config)
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 3] = -100  # (as zoo.padded_batch: what the last padding position predicts is left out)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    vision = getattr(config, "vision_config", None)
    if config.model_type in GEMMA4:  # patch rows and their (x, y), the same size for every image
        (h, w), P = GEMMA4[config.model_type], vision.patch_size
        P *= vision.pooling_kernel_size if config.model_type == "gemma4_unified" else 1
        xs, ys = torch.meshgrid(torch.arange(w // P), torch.arange(h // P), indexing="xy")
        where = torch.stack([xs, ys], dim=-1).reshape(-1, 2)  # [patches, 2]
        pixels = torch.randn(3, len(where), 3 * P * P, generator=gen, dtype=torch.float64)
        batch |= {"pixel_values": pixels, "image_position_ids": where.expand(3, -1, -1).clone()}
        return batch | {"mm_token_type_ids": types}
    if config.model_type == "inkling_mm_model":
        P, T = vision.patch_size, vision.temporal_patch_size
        pixels = torch.randn(3 * count, T, P, P, vision.num_channels, generator=gen, dtype=torch.float64)
        return batch | {"pixel_values": pixels}
    if config.model_type == "deepseek_ocr2":  # global views (the processor's count of local ones: 0)
        side = vision.sam_config.image_size
        pixels = torch.randn(3, 3, side, side, generator=gen, dtype=torch.float64)
        return batch | {"pixel_values": pixels, "num_local_patches": torch.tensor([0, 0, 0])}
    if config.model_type in VQ_SIDE:
        side = VQ_SIDE[config.model_type]
        batch["pixel_values"] = torch.randn(3, 3, side, side, generator=gen, dtype=torch.float64)
        return batch | (
            {"image_sizes": torch.tensor([[side, side]] * 3)} if config.model_type == "emu3" else {}
        )
    if config.model_type in PATCH_ROWS:  # a [C * P * P] row a token
        width = config.num_channels * config.patch_size**2
        return batch | {"pixel_values": torch.randn(3 * count, width, generator=gen, dtype=torch.float64)}
    if config.model_type in HW_GRIDS:
        pixels = torch.randn(3 * 16, 3 * vision.patch_size**2, generator=gen, dtype=torch.float64)
        return batch | {"pixel_values": pixels, "image_grid_hw": torch.tensor([[4, 4]] * 3)}
    if qwen:
        # (Muse Spark's tower names no channels: its patch embedding takes 3, over patch_temporal frames)
        channels = getattr(vision, "in_channels", None) or getattr(vision, "num_channels", 3)
        temporal = getattr(vision, "temporal_patch_size", None) or getattr(vision, "patch_temporal", 1)
        width = channels * temporal * vision.patch_size**2
        rows = sum(t * h * w for t, h, w in grids)
        pixels = torch.randn(rows, width, generator=gen, dtype=torch.float64)
        if config.model_type in PATCHES:
            pixels = pixels.view(rows, channels * temporal, vision.patch_size, vision.patch_size)
        if config.model_type == "inkling2":  # a [P * m, P * m, C] patch a token
            side = vision.patch_size * vision.spatial_merge_size
            pixels = torch.randn(rows, side, side, channels, generator=gen, dtype=torch.float64)
        if grids:
            batch |= {"pixel_values": pixels, "image_grid_thw": torch.tensor(grids)}
        batch["mm_token_type_ids"] = types
        if (
            config.model_type == "video_llama_3"
        ):  # merge sizes of 2 (its processor's default is 1): Qwen's counts
            batch["image_merge_sizes"] = torch.tensor([2] * len(grids))
        if video:
            clip = VIDEO_OF.get(config.model_type, VIDEO)
            frames = clip[0] * clip[1] * clip[2]
            batch |= {"pixel_values_videos": torch.randn(frames, width, generator=gen, dtype=torch.float64)}
            batch |= {"video_grid_thw": torch.tensor([clip])}
        return batch
    if config.model_type in PACKED_SIZES:  # every slice's patches side by side, [1, C, P, patches * P]
        sizes = torch.tensor(PACKED_SIZES[config.model_type], dtype=torch.int32)
        P, patches = vision.patch_size, int(sizes.prod(-1).sum())
        pixels = torch.randn(1, vision.num_channels, P, patches * P, generator=gen, dtype=torch.float64)
        batch |= {"pixel_values": pixels, "target_sizes": sizes}
        if config.model_type == "minicpmv4_7":  # its canvas mRoPE reads the token types
            batch["mm_token_type_ids"] = types
        return batch
    if config.model_type == "lfm2_vl":  # Siglip2's NaFlex: padded patch rows, their shapes and mask
        P, patches = vision.patch_size, vision.num_patches
        batch["pixel_values"] = torch.randn(
            3, patches, vision.num_channels * P * P, generator=gen, dtype=torch.float64
        )
        batch["spatial_shapes"] = torch.tensor([[4, 4]] * 3)
        batch["pixel_attention_mask"] = torch.ones(3, patches, dtype=torch.long)
        return batch
    size = vision.image_size[0] if isinstance(vision.image_size, (list, tuple)) else vision.image_size
    if config.model_type in media.PER_ROW:  # row 0's images A and B, row 1's C and a padding image
        pixels = torch.randn(2, 2, vision.num_channels, size, size, generator=gen, dtype=torch.float64)
        if config.model_type == "granite_docling":  # which tiles are real; the fine route taken
            mask = torch.tensor([[True, True], [True, False]])
            return batch | {
                "pixel_values": pixels,
                "pixel_attention_mask": mask,
                "tile_fine_mask": mask[:, 0],
            }
        pixels[1, 1] = 0
        mask = torch.ones(2, 2, size, size, dtype=torch.long)
        mask[1, 1] = 0
        return batch | {"pixel_values": pixels, "pixel_attention_mask": mask}
    tiles = (TILES[config.model_type],) if config.model_type in TILES else ()
    batch["pixel_values"] = torch.randn(
        3, *tiles, vision.num_channels, size, size, generator=gen, dtype=torch.float64
    )
    if config.model_type in IMAGE_SIZES:
        batch["image_sizes"] = torch.tensor([[size, size]] * 3)
    if config.model_type == "llava_onevision":  # A and B one tile each, zero-padded; C 8 x 16
        batch["pixel_values"][:2, 1:] = 0
        batch["image_sizes"] = torch.tensor([[8, 8], [8, 8], [8, 16]])
        batch["batch_num_images"] = torch.tensor([2, 1])
    if config.model_type == "deepseek_vl_hybrid":  # each image at SAM's resolution too
        high = config.high_res_vision_config.image_size
        batch["high_res_pixel_values"] = torch.randn(3, 3, high, high, generator=gen, dtype=torch.float64)
    if config.model_type in media.BLOCKWISE:  # its processor's token types: its images' tokens see each other
        batch[media.BLOCKWISE[config.model_type].key] = types
    return batch


def _cross_batch(config, gen):
    """Mllama's batch (media.CROSS): an image token a CROSS_IMAGES image, every later token of its
    row seeing the image's tiles (`cross_attention_mask` [B, S, images, tiles]), row 1 left-padded
    by 3 and holding one image of the two slots a row."""
    text = torch.tensor([t for t in range(*zoo.TOKENS) if t not in (config.image_token_index, 0)])
    ids = text[torch.randint(len(text), (2, S), generator=gen)]
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    vision = config.vision_config
    tiles, side = vision.max_num_tiles, vision.image_size
    pixels = torch.zeros(2, 2, tiles, vision.num_channels, side, side, dtype=torch.float64)
    ratios, tiled = torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2, tiles, dtype=torch.long)
    sees = torch.zeros(2, S, 2, tiles, dtype=torch.long)
    for (row, at, ratio), slot in zip(CROSS_IMAGES, (0, 1, 0), strict=True):
        count = 1 if ratio == 1 else 2
        ids[row, at] = config.image_token_index
        pixels[row, slot, :count] = torch.randn(count, *pixels.shape[3:], generator=gen, dtype=torch.float64)
        ratios[row, slot], tiled[row, slot, :count] = ratio, 1
        sees[row, at:, slot, :count] = 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 3] = -100  # (as zoo.padded_batch: what the last padding position predicts is left out)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": labels,
        "pixel_values": pixels,
        "aspect_ratio_ids": ratios,
        "aspect_ratio_mask": tiled,
        "cross_attention_mask": sees,
    }


def _counts(config):
    """Images A, B and C's placeholder tokens where they differ (COUNTS, MiniCPM-V's slices), or None."""
    if config.model_type in PACKED_SIZES:
        per = 4 if config.downsample_mode == "4x" else 16
        return [h * w // per for h, w in PACKED_SIZES[config.model_type]]
    return list(COUNTS[config.model_type]) if config.model_type in COUNTS else None


def _grid_tokens(model_type, grid):
    """How many placeholder tokens an image of (t, h, w) patches takes."""
    t, h, w = grid
    if model_type == "hunyuan_vl":
        return (h // 2) * (w // 2 + 1) + 2
    if model_type == "inkling2":
        return t * h * w
    return (t * h * w) // 4  # Qwen: merged 2x2 patches


def tokens_an_image(model):
    """How many placeholder tokens one of media_batch's images takes (its features' rows), for the
    families without a grid (Qwen's are counted from it)."""
    config = model.config
    if config.model_type in GRIDS_OF or config.model_type in media.CROSS or _counts(config):
        return None
    if config.model_type in PATCH_ROWS or config.model_type in HW_GRIDS:
        return PATCH_ROWS.get(config.model_type, 4)
    one = media_batch(config, count=1)
    first = (slice(1), slice(1)) if config.model_type in media.PER_ROW else slice(1)  # (row 0's first)
    kwargs = {
        key: one[key][first] for key in ("pixel_values", *media.MODALITIES["image"].per_item) if key in one
    }
    kwargs |= {key: one[key] for key in media.SETTINGS if key in one}
    with torch.no_grad():
        out = model.base_model.get_image_features(**kwargs, return_dict=True)
    pooled = getattr(out, media.FIELD.get(config.model_type, "pooler_output"))
    if config.model_type in media.LAYERED:  # its first layer's features fill the placeholders
        pooled = out.deepstack_features[0][1]
    return (
        sum(p.shape[0] for p in pooled)
        if isinstance(pooled, (tuple, list))
        else pooled[0].numel() // pooled.shape[-1]
    )


def towers(model):
    """The parameter names of each module built from a vision sub-config of the model's config (its
    towers, not the projector, which gets gradients even where a zero weight cuts the tower off)."""
    configs = {id(c) for key, c in vars(model.config).items() if "vision_config" in key and c is not None}
    found = {}
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if id(config) in configs and not any(name.startswith(f"{outer}.") for outer in found):
            found[name] = {f"{name}.{k}" for k, _ in module.named_parameters()}
    return list(found.values())


def compare(group, model_type, layout="contiguous", video=False, block=None):
    """The worst difference / bound of logits, loss and gradients (zoo_cases._ratios), and what
    came out worst; the vision tower's gradients are among them. `block`: the queries a chunk
    with images that see each other attends at once (default: attention.IMAGE_QUERY_BLOCK)."""
    default = attention.IMAGE_QUERY_BLOCK  # (a worker of the suite's pool: reset below)
    attention.IMAGE_QUERY_BLOCK = default if block is None else block
    try:
        return _compare(group, model_type, layout, video)
    finally:
        attention.IMAGE_QUERY_BLOCK = default


def _compare(group, model_type, layout, video):
    model = build(model_type)
    batch = media_batch(model.config, video, count=tokens_an_image(model))
    one_process = copy.deepcopy(model)
    reference = zoo_cases._run(one_process, batch)
    decoder = next(name for name, m in model.named_modules() if m is model.get_decoder())
    vision = {k for k, g in reference[2].items() if g is not None and not k.startswith(decoder + ".")}
    vision -= {k for k in vision if k.startswith("lm_head")}
    tower = set().union(*towers(one_process)) or vision  # (Fuyu's is one linear layer, with no config)
    gradients = [reference[2][k] for k in tower if reference[2][k] is not None]
    # (a VQ tokenizer gets none: its ids are an argmin; the codes' embedding rows get theirs)
    trained = model_type not in VQ_SIDE
    assert any(g.abs().max() > 0 for g in gradients) or not trained, "the vision tower gets no gradient"
    hf.parallelize(model, group, layout=layout, verbose=False)
    logits, loss, grads = zoo_cases._run(model, hf.shard_batch(batch, group, layout=layout))
    # (a rank that encoded no item of its own: zeros for the vision tower and projector)
    grads = {
        k: torch.zeros_like(reference[2][k]) if g is None and k in vision else g for k, g in grads.items()
    }
    return zoo_cases._ratios(model, batch, reference, (logits, loss, grads), group, layout)


def packed_refused(group, model_type):
    """The ValueError of a family in media.BLOCKWISE given packed rows (position_ids restarting, no
    attention_mask) with its images."""
    model = build(model_type)
    hf.parallelize(model, group, verbose=False)
    batch = media_batch(model.config, count=tokens_an_image(model))
    del batch["attention_mask"]
    batch["position_ids"] = torch.arange(S).remainder(S // 2).expand(2, S)  # two documents a row
    try:
        model(**hf.shard_batch(batch, group))
    except ValueError as e:
        return str(e)
    return None


def video_refused(group, model_type):
    """The ValueError of a family whose images are split but whose videos are not, given a video."""
    model = build(model_type)
    hf.parallelize(model, group, verbose=False)
    batch = media_batch(model.config, video=True)
    try:
        model(**hf.shard_batch(batch, group))
    except ValueError as e:
        return str(e)
    return None


def one_image(batch, config, count):
    """media_batch's batch with its first image only (A, row 0): the other images' placeholder
    tokens made text, their pixels and types dropped; the labels follow the ids."""
    image = config.image_token_id
    placeholder = batch["input_ids"] == image  # [B, S]
    order = placeholder.flatten().cumsum(0).view_as(placeholder)  # [B, S]: 1.. over the placeholders
    text = batch["input_ids"][0, 0]  # a text token (row 0 starts with text)
    ids = torch.where(placeholder & (order > count), text, batch["input_ids"])
    one = dict(batch, input_ids=ids, labels=ids.masked_fill(batch["attention_mask"] == 0, -100))
    one["labels"][1, 3] = -100  # (as media_batch)
    one["pixel_values"] = batch["pixel_values"][:1]
    if "token_type_ids" in batch:
        one["token_type_ids"] = (ids == image).long()
    return one


def autocast(group, model_type, layout):
    """A float32 model under bfloat16 autocast (TRL's default `bf16=True`) given one image, fewer
    than the ranks, so that some rank encodes none: the CP loss (summed over the ranks) and every
    gradient (summed) against one process under the same autocast, each difference over its
    bound. Every matmul's inputs are rounded to bfloat16 (u = 2^-8) on each side, from float32
    values summed in another order, so a rounding may land one bfloat16 ulp (2u) apart; each
    layer adds at most that, relative, on each side: 2 * 2u * layers of the loss and of the
    largest gradient entry. (Features sent in two dtypes do not arrive at all: gloo fails.)"""
    model = build(model_type).to(torch.float32)
    count = tokens_an_image(model)
    batch = one_image(media_batch(model.config, count=count), model.config, count)
    batch["pixel_values"] = batch["pixel_values"].float()
    one_process = copy.deepcopy(model)
    hf.parallelize(model, group, layout=layout, verbose=False)
    results = []
    for m, given in ((one_process, batch), (model, hf.shard_batch(batch, group, layout=layout))):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(**given).loss
        loss.backward()
        results.append((loss.detach().float(), {k: p.grad for k, p in m.named_parameters()}))
    (want, want_grads), (loss, grads) = results
    dist.all_reduce(loss, group=group)
    apart, largest = 0.0, 0.0
    for key, w in want_grads.items():  # the same order on every rank: the all_reduces pair up
        if w is None:
            continue
        g = torch.zeros_like(w) if grads[key] is None else grads[key].clone()  # no image: no tower grad
        dist.all_reduce(g, group=group)
        apart, largest = max(apart, float((g - w).abs().max())), max(largest, float(w.abs().max()))
    bound = 4 * bounds.u(torch.bfloat16) * zoo.depth(model.config)
    return {
        "loss": float((loss - want).abs()) / (bound * float(want.abs())),
        "grads": apart / (bound * largest),
    }
