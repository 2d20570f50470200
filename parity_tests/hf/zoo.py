"""Every causal-LM family of the pinned transformers as a tiny model with random weights, built from
its config (no downloads), for the model sweep (tools.model_sweep, `make models`).

`tiny_config(model_type)` shrinks the config class's defaults (hidden 32, 4 heads, 2 KV heads, head
dim 8, a vocabulary of 96, windows and attention chunks of WINDOW = 8 tokens against SEQ_LEN = 32)
and keeps one layer of every kind its layer lists name; `FAMILY` adds what a family needs beyond
that (fields its default leaves unset, a layer kind its default lacks); `SKIPPED` says why a family
cannot be run here at all. `build` makes the float64 model; `CASES` are the sweep's batches.
"""

import inspect

import torch
import transformers
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoModelForImageTextToText, PreTrainedConfig
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

MODEL_TYPES = tuple(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
# the image-text-to-text classes, swept on text-only batches (`task="image_text"`)
IMAGE_TEXT_TYPES = tuple(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
TASKS = {  # task: (the auto class, its mapping of model types to class names)
    "causal_lm": (AutoModelForCausalLM, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
    "image_text": (AutoModelForImageTextToText, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES),
}
VOCAB = 96
SEQ_LEN = 32
WINDOW = 8

SIZES = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 128,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "index_head_dim": 16,
    "index_n_heads": 16,  # DeepSeek Sparse Attention's indexer: fewer heads score exact ties (ReLU zeros)
    "index_topk": 5,
    "sliding_window": WINDOW,
    "attention_chunk_size": WINDOW,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "decoder_sparse_step": 1,
    "vocab_size": VOCAB,
    "use_cache": False,
    # encoder-decoder / gpt2-style / misc names of the same sizes
    "encoder_ffn_dim": 48,
    "decoder_ffn_dim": 48,
    "ffn_dim": 48,
    "d_ff": 48,
    "dff": 48,
    "dim_ff": 48,
    "d_inner": 48,
    "ffn_hidden_size": 48,
    "feed_forward_size": 48,
    "intermediate_size_mlp": 48,
    "dense_intermediate_size": 48,
    "shared_intermediate_size": 16,
    "encoder_layers": 1,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "embedding_size": 32,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_head_dim": 8,
    "linear_num_heads": 4,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 8,
    "shared_experts_intermediate_size": 16,
    "moe_shared_expert_intermediate_size": 16,
    "num_encoder_layers": 1,
    "num_decoder_layers": 2,
    "num_decoder_attention_heads": 4,
    "num_encoder_attention_heads": 4,
    "moe_num_experts": 4,
    "moe_num_shared_experts": 1,
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 8,
}
ALWAYS = {"head_dim", "num_key_value_heads"}  # set even where the default is None (None = derived, or breaks)


def tiny(cls, extra=None):
    """An instance of config class `cls` with SIZES where it has such fields, `extra` on top."""
    extra = dict(extra or {})
    default = cls()
    params = set(inspect.signature(cls.__init__).parameters)
    amap = getattr(default, "attribute_map", {}) or {}
    rev = {v: k for k, v in amap.items()}

    def name(k):  # the __init__ parameter that sets attribute k (directly or via attribute_map, either way)
        for c in (k, amap.get(k), rev.get(k)):
            if c and c in params:
                return c
        return None

    d0 = default.to_dict()

    def get(n):  # per-layer-heterogeneous configs raise on ambiguous global attributes
        try:
            return getattr(default, n, None)
        except Exception:
            return d0.get(n)

    kw = {}
    for k, v in SIZES.items():
        n = name(k)
        v0 = get(n) if n else None
        if n and ((v0 is not None and v0 is not False and v0 != 0) or k in ALWAYS):  # 0 / None = feature off
            kw[n] = v
    if get("kv_lora_rank"):  # MLA: no GQA, head_dim (if any) = rope part
        kw[name("num_key_value_heads")] = kw[name("num_attention_heads")]
        if name("head_dim"):
            kw[name("head_dim")] = SIZES["qk_rope_head_dim"]
    # per-layer lists (layer_types, mlp_layer_types, ...): one layer per distinct kind, in order of
    # first use, all the same length (padded with their last kind); a layer_types in `extra` as is
    ltn, nln = name("layer_types"), name("num_hidden_layers")
    n0 = get("num_hidden_layers")
    per_layer = {}
    for k, v in default.to_dict().items():
        if (
            k in params
            and isinstance(v, list)
            and len(v) > 1
            and (len(v) == n0 or k == ltn)
            and all(isinstance(x, str) for x in v)
        ):
            per_layer[k] = extra.pop(k) if k in extra else list(dict.fromkeys(v))
    if ltn and ltn in extra:
        per_layer[ltn] = extra.pop(ltn)
    n = max([2] + [len(v) for v in per_layer.values()])
    for k, v in per_layer.items():
        kw[k] = (v + [v[-1]] * n)[:n]
    if nln:
        kw[nln] = n
    plc = d0.get("per_layer_config")
    if plc and ltn in kw and "per_layer_config" not in extra:
        # heterogeneous layers: tiny layer i takes the overrides of the first default layer of its
        # kind, sizes scaled like the global ones (gemma4: full-attention head_dim = 2 x sliding's)
        def scaled(k, v):
            base, small = d0.get(k), kw.get(name(k) or k)
            if isinstance(v, int) and isinstance(base, int) and isinstance(small, int) and base:
                return max(1, round(small * v / base))
            return v

        lt0, new = d0[ltn], {}
        for i, kind in enumerate(kw[ltn]):
            j = lt0.index(kind) if kind in lt0 else None
            ov = plc.get(f"{j:02d}", plc.get(str(j), plc.get(j))) if j is not None else None
            if ov:
                new[i] = {k: scaled(k, v) for k, v in ov.items()}
        kw["per_layer_config"] = new
    for k, v in default.to_dict().items():
        if (
            (k.endswith("token_id") or k.endswith("token_index"))
            and isinstance(v, int)
            and v >= 64
            and k in params
        ):
            kw[k] = VOCAB - 1 - (sum(map(ord, k)) % 16)
    for sub, subcls in (getattr(default, "sub_configs", {}) or {}).items():
        cur = getattr(default, sub, None)
        if cur is None or sub not in params:
            continue
        if not (
            isinstance(subcls, type) and issubclass(subcls, PreTrainedConfig)
        ):  # AutoConfig / spec: use the default's class
            subcls = type(cur) if isinstance(cur, PreTrainedConfig) else None
        if subcls:
            kw[sub] = tiny(subcls, extra.pop(sub, None)).to_dict()
    kw.update(extra)
    return cls(**kw)


MAMBA2 = dict(mamba_n_heads=4, mamba_d_state=8, mamba_chunk_size=16)
FAMILY = {
    "bamba": MAMBA2 | dict(attn_layer_indices=[1]),
    "falcon_h1": MAMBA2 | dict(mamba_d_ssm=64),
    "codegen": dict(rotary_dim=4),
    "gptj": dict(rotary_dim=4),
    "deepseek_v2": dict(num_experts_per_tok=2),  # default None
    # --- defaults that do not build in transformers 5.23.0 (and ALWAYS: head_dim, num_key_value_heads)
    "cohere_compass_text": dict(  # rope_parameters must be keyed by layer type (default {} -> KeyError)
        rope_parameters={"full_attention": dict(rope_type="default", rope_theta=1e4, mrope_section=[2, 1, 1])}
    ),
    "dbrx": dict(
        attn_config=dict(kv_n_heads=2, rope_theta=1e4, clip_qkv=8.0)
    ),  # attention reads both unconditionally
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1),  # defaults None
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),  # default layer_types None
    # attention soft-capping at the scale of these weights' scores (0.04): capped, not linear (at
    # its default of 50 the cap is the identity here, and torch_impl.attention's form of it rounds
    # to a few u of the cap, far more than of the score)
    "gemma2": dict(attn_logit_softcapping=0.02),
    "vaultgemma": dict(attn_logit_softcapping=0.02),
    # chunked and NoPE layers; the NoPE layer's query scale steps every 4 rows (its default: 8192)
    "llama4_text": dict(no_rope_layers=[1, 0], floor_scale=4),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=WINDOW),
    "mamba2": dict(num_heads=4, head_dim=16, state_size=8, n_groups=2, chunk_size=16),
    "nemotron_h": dict(ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, chunk_size=16),
    "reformer": dict(
        is_decoder=True,
        attn_layers=["local", "lsh"],
        attention_head_size=8,
        axial_pos_shape=[4, 8],
        axial_pos_embds_dim=[16, 16],
        local_attn_chunk_length=8,
        lsh_attn_chunk_length=8,
    ),
    "longcat_flash": dict(num_layers=1, zero_expert_num=2),  # num_hidden_layers = 2 * num_layers
    "qwen4_exp_text": dict(
        hc_lowrank=8,
        indexer_n_heads=4,
        indexer_kv_heads=1,
        indexer_head_dim=8,
        indexer_budget=16,
        indexer_compress_ratio=4,
        # per-layer embeddings (off by default) on its linear layer: n-grams of 3 ids (2 back), a
        # conv of kernel 4 and dilation 3 (9 back, past head_tail's 8-token chunks)
        ple_layer_ids=[1],
        eos_token_id=1,
        heads_per_ngram=2,
        ngram_vocab_size_base=40,
        make_ngram_vocab_size_divisible_by=8,
    ),  # QSA indexer fields default None
    "zaya": dict(num_experts_per_tok=1, router_hidden_size=16),  # only top-1 supported
    "zamba": dict(
        layers_block_type=[
            "linear_attention",
            "hybrid",
            "hybrid",
        ],  # one hybrid layer: tie_weights_keys error
        attention_head_dim=16,
        mamba_dt_rank=4,
    ),
    "zamba2": dict(mamba_d_state=8, chunk_size=16, adapter_rank=8),
    "blt": dict(
        decoder_config=dict(hidden_size_global=32),
        local_attention_window_len=WINDOW,
        encoder_hash_byte_group_vocab=64,
    ),
    "modernbert-decoder": dict(local_attention=2 * WINDOW),  # sliding_window = local_attention // 2
    "doge": dict(keep_window_size=WINDOW),
    # lightning attention first (the last layer's decay rate is ~0) in blocks of 6: chunks of 8 and
    # 16 end mid-block
    "minimax": dict(block_size=6, layer_types=["linear_attention", "full_attention"]),
    "xlstm": dict(chunk_size=16),
    "minimax_m3_vl_text": dict(
        layer_types=["full_attention", "minimax_m3_sparse"],
        mlp_layer_types=["dense", "sparse"],
        index_block_size=4,
        index_topk_blocks=2,
        index_n_heads=2,  # one block selection per KV head
    ),  # default: no sparse/dense layers
    # relative logits out to 12 tokens back (default 1024: past the whole row), log scaling of the
    # full layers' queries from row 4 on (Inkling's from the rank's local rows, which the adapter
    # moves to the global ones; Inkling2's from position_ids)
    "inkling_text": dict(rel_extent=12, log_scaling_n_floor=4),
    "inkling2_text": dict(rel_extent=12, log_scaling_n_floor=4),
    "roc_bert": dict(
        pronunciation_embed_dim=32, pronunciation_vocab_size=VOCAB, shape_embed_dim=32, shape_vocab_size=VOCAB
    ),
    "rembert": dict(input_embedding_size=32, output_embedding_size=32),
    "cpmant": dict(dim_head=8, position_bias_num_buckets=32, position_bias_max_distance=128),
    "fuyu": dict(patch_size=4),
    "gemma3": dict(vision_config=dict(image_size=16, patch_size=4)),
    "got_ocr2": dict(
        vision_config=dict(
            image_size=16,
            patch_size=4,
            mlp_dim=48,
            output_channels=32,
            window_size=2,
            global_attn_indexes=[1],
        )
    ),
    "phi4_multimodal": dict(
        audio_config=dict(
            num_blocks=2, ext_pw_out_channel=32, depthwise_separable_out_channel=32, nemo_conv_channels=32
        ),
        vision_config=dict(image_size=28, crop_size=28, patch_size=14),
    ),
    "moss_transcribe_diarize": dict(audio_config=dict(max_source_positions=16, num_mel_bins=8)),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    "granitemoehybrid": MAMBA2
    | dict(layer_types=["linear_attention", "full_attention"]),  # default: mamba only
    "lfm2": dict(layer_types=["conv", "full_attention"]),  # default: attention only
    "deepseek_v4": dict(
        head_dim=16,
        partial_rotary_factor=0.5,
        o_lora_rank=16,
        o_groups=2,
        # windows of 3 and 6 tokens: some cross the shard edges (16; head_tail's 8, 24)
        compress_rates={"compressed_sparse_attention": 3, "heavily_compressed_attention": 6},
        layer_types=["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
    ),
    # the last num_kv_shared_layers layers reuse the kv of the last earlier layer of their type
    "gemma3n_text": dict(
        layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2, laurel_rank=8
    ),
    "dots3_note_text": dict(
        head_dim=20
    ),  # SWA layers: head_dim = their qk_nope_head_dim (12) + qk_rope_head_dim
    "git": dict(vision_config=dict(image_size=8, patch_size=4)),
    "musicgen": dict(decoder=dict(num_codebooks=2)),
    "musicgen_melody": dict(decoder=dict(num_codebooks=2)),
    # --- image-text classes whose defaults do not build or run tiny in transformers 5.23.0
    "vipllava": dict(vision_feature_layer=[-2, -1]),  # the default's (-2, -5, -8, -11, 6): past a tiny tower
    "aria": dict(projector_patch_to_query_dict={16: 4}),  # a tiny image's 4 x 4 patches to 4 queries
    "kimi_k25": dict(projection_hidden_size=32),  # its projector's norm: the vision width (default 1152)
    "deepseek_vl_hybrid": dict(  # SAM's high-resolution tower at 32 x 32 (default 1024)
        high_res_vision_config=dict(
            image_size=32, patch_size=4, output_channels=32, window_size=2, global_attn_indexes=[1]
        )
    ),
    "janus": dict(  # its VQ-VAE (image generation only) shrunk: 118M parameters at the tiny sizes otherwise
        vq_config=dict(
            embed_dim=8,
            num_embeddings=16,
            base_channels=32,
            channel_multiplier=[1, 2],
            num_res_blocks=1,
            projection_dim=32,
            image_token_embed_dim=32,
        )
    ),
    "cosmos3_edge": dict(  # mRoPE's sections must sum to head_dim / 2; image ids clear of TOKENS
        text_config=dict(rope_parameters=dict(rope_type="default", rope_theta=1e8, mrope_section=[2, 1, 1])),
        projector_hidden_size=48,
        image_token_id=80,
        video_token_id=81,
        vision_start_token_id=82,
        vision_end_token_id=83,
    ),
    "glm5_next": dict(  # index_topk a multiple of index_kpool: pools of 3 tokens across the shard edges
        text_config=dict(index_kpool=3, index_topk=6),
        vision_config=dict(out_hidden_size=32, projection_intermediate_size=48),
    ),
    "granite_docling": dict(  # its connector ends at the text width; DeepStack taps both ViT layers
        vision_config=dict(out_hidden_size=32, deepstack_visual_indexes=[0, 1], image_size=32, patch_size=4)
    ),
    "molmo2": dict(  # the adapter's feature layers within the 2-layer ViT
        adapter_config=dict(vision_feature_layer=[1, 0], text_hidden_size=32),
        vision_config=dict(image_size=[16, 16], patch_size=4),
        image_patch_id=81,
    ),
    "muse_spark": dict(  # one entry per audio stage; its audio and vision features at the text width
        audio_config=dict(patch_sizes=[4, 2], hidden_sizes=[16, 32], depths=[2, 2], out_hidden_size=32),
        text_config=dict(moe_hidden_size=32),
        vision_config=dict(patch_size=4, pos_emb_height=4, pos_emb_width=4, max_position_embeddings=16),
        out_hidden_size=128,
        projector_hidden_size=48,
    ),
    "muse_glimmer": dict(  # Muse Spark's tower, without audio: its features at the text width
        vision_config=dict(patch_size=4, pos_emb_height=4, pos_emb_width=4),
        out_hidden_size=128,
        projector_hidden_size=48,
    ),
    # vocabulary_map (default None): the image placeholder and 8 VQ codes; the VQ shrunk to 8 codes
    "chameleon": dict(
        vocabulary_map={"<image>": 72} | {"IMGIMG" + chr(ord("A") + i) + "Z": 64 + i for i in range(8)},
        vq_config=dict(
            embed_dim=8,
            num_embeddings=8,
            latent_channels=8,
            resolution=16,
            base_channels=32,
            channel_multiplier=[1, 2],
            num_res_blocks=1,
        ),
    ),
    "emu3": dict(
        vocabulary_map={"<image>": 72, "<|extra_200|>": 73}
        | {f"<|visual token{i:06d}|>": 64 + i for i in range(8)},
        vq_config=dict(
            codebook_size=8,
            base_channels=32,
            channel_multiplier=[1, 1],
            attn_resolutions=[1],
            num_res_blocks=1,
        ),
    ),
    # its projector's fields default None; the Q-Former's heads are the vision width / 64
    "granite4_vision": dict(
        downsample_rate="2/4",
        deepstack_layer_map=[[-2, 0]],
        spatial_target_layers=[1, 2, 3, 4],
        image_grid_pinpoints=[[16, 32], [32, 16], [32, 32]],
        text_config=dict(num_hidden_layers=5),  # a layer per injection, as the checkpoint's
        vision_config=dict(hidden_size=64, image_size=16, patch_size=4),
        qformer_config=dict(num_hidden_layers=1, cross_attention_frequency=1),
    ),
    "cohere_compass": dict(
        vision_config=dict(
            out_hidden_size=32, deepstack_visual_indexes=[0], patch_size=4, num_position_embeddings=16
        ),
    ),
    "deepseek_ocr2": dict(  # mlp_layer_types and num_experts_per_tok default None
        text_config=dict(mlp_layer_types=["dense", "sparse"], num_experts_per_tok=2),
        vision_config=dict(
            sam_config=dict(
                image_size=32,
                patch_size=4,
                output_channels=32,
                downsample_channels=[32, 32],
                window_size=2,
                global_attn_indexes=[1],
            )
        ),
    ),
    "diffusion_gemma": dict(  # its MoE fields default None
        text_config=dict(num_experts=4, top_k_experts=2, moe_intermediate_size=16), canvas_length=WINDOW
    ),
    "ernie4_5_vl_moe": dict(  # expert widths [text, vision]; mRoPE sections over head_dim 8
        text_config=dict(
            moe_intermediate_size=[16, 16],
            rope_parameters=dict(rope_type="default", rope_theta=5e5, mrope_section=[1, 1, 2]),
        )
    ),
    "hunyuan_vl": dict(  # xdrope's 4 axes (position, width, height, image) over 4 frequencies
        text_config=dict(
            rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[1, 1, 1, 1])
        )
    ),
    "step3p7": dict(  # sliding layers beside full ones (its text model makes the sliding mask either way)
        text_config=dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
    ),
}
# mRoPE's sections over head_dim 8's 4 frequencies (the default's are a real model's, [16, 24, 24])
MROPE = dict(rope_type="default", rope_theta=1e6, mrope_section=[1, 1, 2])
MROPE = dict(text_config=dict(rope_parameters=MROPE))
FAMILY |= {"qwen2_vl": MROPE, "qwen2_5_vl": MROPE, "paddleocr_vl": MROPE}
FAMILY["qwen4_exp"] = dict(text_config=FAMILY["qwen4_exp_text"])
FAMILY["cohere_compass"]["text_config"] = FAMILY["cohere_compass_text"]
FAMILY["inkling2"] = dict(  # its projector ends at the text width (the default: a real model's)
    text_config=FAMILY["inkling2_text"], vision_config=dict(text_hidden_size=32, projection_hidden_dim=48)
)
FAMILY["nemotron_h_omni"] = dict(
    text_config=FAMILY["nemotron_h"],
    # video_temporal_patch_size must equal the model config's (2): tiny() builds the vision config
    # from its class's bare default, where it is None
    vision_config=dict(video_temporal_patch_size=2, patch_size=4, max_img_size=32),
    vision_hidden_size=32,
    projector_hidden_size=48,
    image_token_id=80,  # default None
)
# GLM-4.1V / 4.5V / 4.6V (glmga: 4.6V's model): rotary over half of each head, as their checkpoints,
# and head_dim 16 for mRoPE's 4 frequencies (sections [t, h, w]); the merger ends at the text width
GLM_V = dict(
    text_config=dict(
        head_dim=16,
        rope_parameters=dict(
            rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5, mrope_section=[1, 1, 2]
        ),
    ),
    vision_config=dict(out_hidden_size=32),
)
FAMILY |= {"glm4v": GLM_V, "glm46v": GLM_V, "glmga": GLM_V, "glm4v_moe": GLM_V}
FAMILY["glm_ocr"] = MROPE | dict(vision_config=dict(out_hidden_size=32))  # GLM-OCR rotates whole heads
# the thinkers' media ids (vision_start / end, audio_end: keys of the released configs that the config
# classes do not declare, read by get_rope_index even for text)
OMNI_IDS = dict(
    audio_start_token_id=67,
    audio_end_token_id=68,
    user_token_id=69,
    vision_start_token_id=70,
    vision_end_token_id=71,
)
FAMILY["qwen2_5_omni_thinker"] = (
    MROPE
    | OMNI_IDS
    | dict(
        audio_token_index=64,
        image_token_index=65,
        video_token_index=66,
        vision_config=dict(out_hidden_size=32, fullatt_block_indexes=[1]),  # a windowed block, a full one
        audio_config=dict(output_dim=32),
    )
)
FAMILY["qwen3_omni_moe_thinker"] = OMNI_IDS | dict(
    audio_token_id=64,
    image_token_id=65,
    video_token_id=66,
    vision_config=dict(out_hidden_size=32, deepstack_visual_indexes=[1]),
    audio_config=dict(output_dim=32, downsample_hidden_size=32),
)
FAMILY["llama4"] = dict(text_config=FAMILY["llama4_text"])
FAMILY["gemma3n"] = dict(text_config=FAMILY["gemma3n_text"])  # (needs timm for its vision tower anyway)
FAMILY["dots3_note"] = dict(
    text_config=FAMILY["dots3_note_text"],
    vision_config=dict(adapter_in_dim=32, adapter_out_dim=32),
    audio_config=dict(adapter_input_size=32, adapter_out_dim=32),
)


POST = {  # model type: what its model needs after it is built
    "xmod": lambda m: m.set_default_language("en_XX"),  # its language adapters need a language
}
# families whose float64 models make float32 temporaries holding finfo(float64).min (xglm's attention:
# torch.full((), min) overflows; prophetnet's masks: 0 * inf = NaN), or hold float32-valued buffers
# (minimax: its lightning attention's decays, made at construction): they run with float64 as
# torch's default dtype
DEFAULT_FLOAT64 = ("xglm", "prophetnet", "minimax")


# timm imports torchvision, whose wheel for the pinned torch (2.13.0, a CPU build) does not load
# beside it ("operator torchvision::nms does not exist"); PyPI has no CPU build of it
TIMM = "its vision tower is timm's, which needs torchvision: none loads beside the pinned CPU torch"
SKIPPED = {  # model type: why the sweep cannot run it here
    "gemma3n": TIMM,
    "fast_vlm": TIMM,
    "perception_lm": TIMM,
    "gemma4_assistant": "not a standalone causal LM: it takes the main model's embeddings and KV",
    "gemma4_unified_assistant": "not a standalone causal LM: it takes the main model's embeddings and KV",
    "musicgen": "an audio model: input_ids of codebooks [B * codebooks, S], labels [B, S, codebooks]",
    "musicgen_melody": "an audio model: input_ids of codebooks [B * codebooks, S], labels [B, S, codebooks]",
    "git": (
        "its loss drops the first (image_size / patch_size)^2 + 1 logits, the image tokens it prepends "
        "only when given pixel_values: text-only labels do not line up"
    ),
}


# built from the class the task names: the auto classes look EvollaConfig up under its alias type
# "EvollaModel", which their mappings do not list
DIRECT = ("evolla",)


def tiny_config(model_type):
    """The family's tiny config; encoders used as causal LMs (BERT, RoBERTa, ...) as decoders."""
    cls = CONFIG_MAPPING[model_type]
    decoder = {"is_decoder": True} if "is_decoder" in inspect.signature(cls.__init__).parameters else {}
    return tiny(cls, decoder | FAMILY.get(model_type, {}))


def build(model_type, dtype=torch.float64, seed=0, task="causal_lm"):
    """The family's tiny model (its causal-LM class, or for task "image_text" its image-text-to-text
    class) in `dtype`, weights drawn from `seed`, eval mode, eager experts (grouped_mm has no
    float64 kernel on CPU). ValueError for a family in SKIPPED."""
    if model_type in SKIPPED:
        raise ValueError(f"{model_type}: {SKIPPED[model_type]}")
    config = tiny_config(model_type)
    torch.manual_seed(seed)
    if model_type in DIRECT:
        model = getattr(transformers, TASKS[task][1][model_type])._from_config(config)
    else:
        model = TASKS[task][0].from_config(config)
    model = model.to(dtype).eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    if model_type in POST:
        POST[model_type](model)
    return model


# --- the sweep's batches -------------------------------------------------------------------------

TOKENS = (4, 64)  # token ids are drawn from here: clear of the special ids the configs are given
DOCUMENTS = ((5, 7, 1, 10, 1, 8), (9, 23))  # packed rows: starts mid-shard, on a shard edge (16), 1-token


def _text(config):
    return config.get_text_config()


# families whose real tokens read what left padding's rows hold (rows that see no key, which each
# implementation fills in its own way): the adapter refuses their left-padded rows
RIGHT_PADDED = {"minimax_m3_vl_text": "its sparse layers' indexer pools the padding's keys into its blocks"}


def padded_batch(config, seed=1, left=None):
    """Rows of SEQ_LEN tokens: one whole, one right-padded by 5, one left-padded by 3 (right-padded
    for a family in RIGHT_PADDED, unless `left`), with the model's pad token at the padding (as a
    tokenizer pads) and labels -100 there and at the left-padded row's first token, the one its
    last padding position would predict: a query that sees no key is left to each implementation
    (transformers' eager and sdpa differ; CP gives zeros)."""
    left = _text(config).model_type not in RIGHT_PADDED if left is None else left
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(*TOKENS, (3, SEQ_LEN), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -5:] = 0
    attention_mask[2, slice(None, 3) if left else slice(-3, None)] = 0
    pad = getattr(_text(config), "pad_token_id", None)
    if isinstance(pad, int) and 0 <= pad < VOCAB:
        input_ids = input_ids.masked_fill(attention_mask == 0, pad)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[2, 3] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def packed_batch(config, seed=2):
    """Packed rows (DOCUMENTS): position_ids restarting at every document, no attention_mask."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(*TOKENS, (len(DOCUMENTS), SEQ_LEN), generator=gen)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCUMENTS])
    return {"input_ids": input_ids, "position_ids": positions, "labels": input_ids.clone()}


def typed_batch(config, seed=1):
    """padded_batch with the token types a vision-language processor returns for text (all 0),
    under both names (the case passes the one the model's forward takes)."""
    batch = padded_batch(config, seed)
    zeros = torch.zeros_like(batch["input_ids"])
    return batch | {"token_type_ids": zeros, "mm_token_type_ids": zeros}


CASES = {  # name: (layout, batch)
    "padded": ("contiguous", padded_batch),
    "padded, head_tail": ("head_tail", padded_batch),
    "packed": ("contiguous", packed_batch),
}
# the image-text-to-text sweep's: text-only batches, with a processor's token types too
IMAGE_TEXT_CASES = CASES | {"padded, token types": ("contiguous", typed_batch)}


def depth(config):
    """How many decoder layers the text model has."""
    return getattr(_text(config), "num_hidden_layers", None) or 1


def width(config):
    """The text model's hidden size."""
    return getattr(_text(config), "hidden_size", None) or 1


def heads(config):
    """The text model's attention heads (the most of any layer, where layers differ: dots3's)."""
    text = _text(config)
    layers = getattr(text, "per_layer_config", None)
    if layers:
        return max(getattr(layer, "num_attention_heads", None) or 1 for layer in layers)
    return getattr(text, "num_attention_heads", None) or 1


def describe(model_type, task="causal_lm"):
    """{"class": the task's class, "layers": its config's layer types} for the matrix."""
    names = TASKS[task][1]
    try:
        config = _text(tiny_config(model_type))
    except Exception:  # a family whose default config transformers itself refuses
        return {"class": names[model_type], "layers": "?"}
    kinds = sorted(set(getattr(config, "layer_types", None) or ()))
    if not kinds:
        kinds = ["sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"]
    return {"class": names[model_type], "layers": ", ".join(kinds)}
