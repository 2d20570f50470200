"""Tiny transformers models with random weights, built from configs (no downloads), for the hf tests.

Windows are chosen against the tests' S = 24 tokens: at n = 4 ranks (L = 6) Gemma 3's window of
10 (halo 9) and Mistral's of 14 (halo 13) reach back two and three shards; at n = 2 (L = 12)
Mistral's reaches back to the start of rank 0's shard.
"""

from functools import partial

import torch

from parity_tests.hf import zoo

VOCAB = 64
SEQ_LEN = 24


def _small_config(**overrides):
    return {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,  # GQA
        "head_dim": 8,
        "max_position_embeddings": 128,
        **overrides,
    }


def _dsa():
    """DeepSeek Sparse Attention at test size: MLA (latents of 16 + 8 dims a token), an indexer
    choosing 5 of up to 24 keys with 16 heads (fewer heads score exact ties: ReLU zeros), a dense
    MLP then MoE."""
    return {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "kv_lora_rank": 16,
        "q_lora_rank": 24,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 12,
        "index_topk": 5,
        "index_head_dim": 16,
        "index_n_heads": 16,
        "first_k_dense_replace": 1,
        "max_position_embeddings": 128,
        "use_cache": False,
    }


def _eager_experts(model):
    model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel on CPU
    return model


def _built_in_float64(make):
    """`make()` with float64 as torch's default dtype, so that buffers made at construction
    (MiniMax's lightning decays) are float64, not float32-rounded values cast up."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return make()
    finally:
        torch.set_default_dtype(default)


def _configs(head_dim=8):
    import transformers as tf

    _small = partial(_small_config, head_dim=head_dim)
    configs = {
        "gemma3": lambda: tf.Gemma3ForCausalLM(
            tf.Gemma3TextConfig(
                **_small(num_hidden_layers=3, sliding_window=10, query_pre_attn_scalar=16),
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                final_logit_softcapping=30.0,
            )
        ),
        "gemma2": lambda: tf.Gemma2ForCausalLM(  # attention logit soft-capping: eager attention
            tf.Gemma2Config(
                **_small(num_hidden_layers=2, sliding_window=10, query_pre_attn_scalar=16),
                attn_logit_softcapping=0.02,  # these weights' scores reach 0.04: capped, not linear
            )
        ),
        "mistral": lambda: tf.MistralForCausalLM(
            tf.MistralConfig(**_small(num_hidden_layers=2, sliding_window=14))
        ),
        "lfm2": lambda: tf.Lfm2ForCausalLM(
            tf.Lfm2Config(
                **_small(num_hidden_layers=4),
                layer_types=["conv", "full_attention", "conv", "full_attention"],
                conv_bias=True,
            )
        ),
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**_small(num_hidden_layers=2))),
        "gpt_oss": lambda: _eager_experts(  # attention sinks, eager attention
            tf.GptOssForCausalLM(
                tf.GptOssConfig(**_small(num_hidden_layers=2, sliding_window=10), num_local_experts=4)
            )
        ),
        "deepseek_v32": lambda: _eager_experts(tf.DeepseekV32ForCausalLM(tf.DeepseekV32Config(**_dsa()))),
        "glm_moe_dsa": lambda: _eager_experts(  # layer 1 reuses layer 0's top-k ("shared")
            tf.GlmMoeDsaForCausalLM(tf.GlmMoeDsaConfig(**_dsa(), indexer_types=["full", "shared"]))
        ),
        # Gated DeltaNet: grouped values (2 key heads, 4 value heads), dv != dk; conv kernel 4
        "qwen3_5": lambda: tf.Qwen3_5ForCausalLM(
            tf.Qwen3_5TextConfig(
                **_small(num_hidden_layers=3),
                layer_types=["linear_attention", "full_attention", "linear_attention"],
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                linear_key_head_dim=8,
                linear_value_head_dim=12,
            )
        ),
        # Kimi Delta Attention (a per-channel decay) with MLA full attention and MoE
        "kimi_linear": lambda: _eager_experts(
            tf.KimiLinearForCausalLM(
                tf.KimiLinearConfig(
                    **_small(num_hidden_layers=2, num_key_value_heads=4),
                    moe_intermediate_size=16,
                    kv_lora_rank=16,
                    qk_rope_head_dim=8,
                    qk_nope_head_dim=8,
                    v_head_dim=8,
                    num_experts=4,
                    num_experts_per_token=2,
                    mlp_layer_types=["dense", "sparse"],
                    layer_types=["linear_attention", "full_attention"],
                    linear_head_dim=8,
                    linear_num_heads=4,
                    pad_token_id=0,
                    use_cache=False,
                )
            )
        ),
        # Mamba2 (SSD) then attention; scan chunks of 8 tokens, so a shard of 6 or 12 straddles them
        "bamba": lambda: tf.BambaForCausalLM(
            tf.BambaConfig(
                **_small(num_hidden_layers=2),
                attn_layer_indices=[1],
                mamba_n_heads=4,
                mamba_d_head=8,
                mamba_n_groups=1,
                mamba_d_state=4,
                mamba_d_conv=4,
                mamba_expand=1,
                mamba_chunk_size=8,
                pad_token_id=0,
            )
        ),
        # MiniMax: lightning attention (a decay per head, blocks of 5 tokens: shards end mid-block)
        # then attention, MoE
        "minimax": lambda: _built_in_float64(
            lambda: _eager_experts(
                tf.MiniMaxForCausalLM(
                    tf.MiniMaxConfig(
                        **_small(num_hidden_layers=2),
                        layer_types=["linear_attention", "full_attention"],
                        block_size=5,
                        num_local_experts=4,
                        num_experts_per_tok=2,
                        pad_token_id=0,
                    )
                )
            )
        ),
        # Mamba (a per-channel selective scan, normed dt, B, C) then attention with MoE
        "jamba": lambda: _eager_experts(
            tf.JambaForCausalLM(
                tf.JambaConfig(
                    **_small(num_hidden_layers=2),
                    attn_layer_period=2,
                    attn_layer_offset=1,
                    num_experts=4,
                    mamba_d_state=4,
                    mamba_d_conv=4,
                    mamba_expand=1,
                    mamba_dt_rank=4,
                    use_cache=False,
                )
            )
        ),
        # MiniMax-M3's block-sparse layers beside full ones (the sweep's tiny config)
        "minimax_m3": lambda: zoo.build("minimax_m3_vl_text"),
        # Inkling's relative logits and short convs (the sweep's; Inkling2's router runs in float32,
        # which a float64 model cannot)
        "inkling": lambda: zoo.build("inkling_text"),
        # Qwen4: Gated DeltaNet with per-layer embeddings (n-grams, a dilated conv), QSA (the sweep's)
        "qwen4_ple": lambda: zoo.build("qwen4_exp_text"),
        # refused by parallelize
        "t5": lambda: tf.T5ForConditionalGeneration(
            tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=1, num_heads=4)
        ),
        "deepseek_v4": lambda: tf.DeepseekV4ForCausalLM(  # compressed attention (exact)
            tf.DeepseekV4Config(
                vocab_size=VOCAB,
                hidden_size=32,
                moe_intermediate_size=16,
                num_hidden_layers=2,
                layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
                num_attention_heads=4,
                head_dim=16,
                q_lora_rank=16,
                o_lora_rank=16,
                n_routed_experts=4,
                num_experts_per_tok=2,
                index_head_dim=16,
                qk_rope_head_dim=8,
                index_topk=4,
            )
        ),
        "gemma3_bidirectional": lambda: tf.Gemma3ForCausalLM(
            tf.Gemma3TextConfig(**_small(num_hidden_layers=1), use_bidirectional_attention=True)
        ),
    }
    # refused: Qwen3.5 (Gated DeltaNet, which the adapter knows) holding a recurrence it does not
    # know, named with the family's prefix (which the check for unknown recurrences reads past)
    configs["qwen3_5_unknown_recurrence"] = lambda: _with_unknown_recurrence(configs["qwen3_5"]())
    # refused: a compressed layer whose compressor is not DeepSeek V4's (another forward)
    configs["deepseek_v4_other_compressor"] = lambda: _with_other_compressor(configs["deepseek_v4"]())
    return configs


def _with_other_compressor(model):
    model.model.layers[0].self_attn.compressor = torch.nn.Identity()
    return model


def _with_unknown_recurrence(model):
    model.model.layers[0].retention = type("Qwen3_5Retention", (torch.nn.Module,), {})()
    return model


SUPPORTED = (
    "gemma3",
    "gemma2",
    "mistral",
    "lfm2",
    "llama",
    "gpt_oss",
    "qwen3_5",
    "kimi_linear",
    "bamba",
    "jamba",
)
INDEXED = ("deepseek_v32", "glm_moe_dsa")  # DeepSeek Sparse Attention
REFUSED = {  # model -> what the error names
    "qwen3_5_unknown_recurrence": "model.layers.0.retention (Qwen3_5Retention) carries recurrent state",
    "t5": "encoder.block.0.layer.0.SelfAttention (T5Attention) is bidirectional or cross attention",
    "gemma3_bidirectional": "model.layers.0.self_attn (Gemma3Attention) is bidirectional",
    "deepseek_v4_other_compressor": "model.layers.0.self_attn (DeepseekV4Attention) is a "
    "'compressed_sparse_attention' layer without DeepSeek V4's compressor",
}


def build(name, dtype=torch.float64, seed=0, head_dim=8):
    """The named tiny model in `dtype`, its weights drawn from `seed` (`head_dim`: of the models
    that are not DeepSeek Sparse Attention; CUDA's flex_attention needs 16 or more)."""
    torch.manual_seed(seed)
    return _configs(head_dim)[name]().to(dtype)


# per row: document lengths; starts 0, 5, 12, 13, 23 (12: a shard edge for n = 2, 4; one-token
# documents at 12 and at the last token) and 0, 9 (9 .. 23 spans three shards for n = 4)
DOCUMENTS = ((5, 7, 1, 10, 1), (9, 15))


def make_packed_batch(with_mask=False, seed=2):
    """input_ids, position_ids restarting at 0 at every document start, labels; with_mask: also an
    all-ones attention_mask (transformers then keeps each row causal as a whole)."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (len(DOCUMENTS), SEQ_LEN), generator=gen)
    positions = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in DOCUMENTS])
    batch = {"input_ids": input_ids, "position_ids": positions, "labels": input_ids.clone()}
    return batch | ({"attention_mask": torch.ones_like(input_ids)} if with_mask else {})


def make_batch(batch=2, seq_len=SEQ_LEN, pad=5, seed=1, left=False):
    """input_ids, attention_mask (row 1 padded by `pad` tokens, on the right or `left`) and labels
    (-100 on padding)."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (batch, seq_len), generator=gen)
    attention_mask = torch.ones(batch, seq_len, dtype=torch.long)
    if batch > 1 and pad:
        attention_mask[1, slice(0, pad) if left else slice(seq_len - pad, None)] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def build_head(head, family="llama", pad_token_id=0, seed=0, num_labels=2):
    """A tiny float64 model of `family` (llama; mistral: a window of 14) with the named head class
    (e.g. "ForSequenceClassification"), num_labels and pad_token_id as given."""
    import transformers as tf

    windows = {"llama": {}, "mistral": {"sliding_window": 14}}
    classes = {"llama": "Llama", "mistral": "Mistral"}
    config = getattr(tf, classes[family] + "Config")(
        **_small_config(num_hidden_layers=2, **windows[family]),
        num_labels=num_labels,
        pad_token_id=pad_token_id,
    )
    torch.manual_seed(seed)
    return getattr(tf, classes[family] + head)(config).to(torch.float64)


def make_classification_batch(left=False, pad_token_id=0, seed=3):
    """input_ids without the pad token but where padded (row 0 whole, row 1 by 7 tokens, row 2 by
    20: its last real token on the first of 2 or 4 ranks; `left` padding or right), the mask, and
    one label per row."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (3, SEQ_LEN), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    for row, pad in ((1, 7), (2, 20)):
        attention_mask[row, slice(0, pad) if left else slice(SEQ_LEN - pad, None)] = 0
    input_ids = input_ids.masked_fill(attention_mask == 0, pad_token_id)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": torch.tensor([0, 1, 1])}


def _words(tokens):
    """examples/recipes/trainer_data's word-level tokenizer with a processor's special `tokens`."""
    from examples.recipes import trainer_data

    words = trainer_data.tokenizer()
    words.add_special_tokens({"additional_special_tokens": list(tokens.values())})
    return words


def _with_tokens(model_class, config, tokens, dtype):
    """`model_class` from `config` with its `<key>_token_id`s those of _words(tokens), seeded."""
    words = _words(tokens)
    for key, token in tokens.items():
        setattr(config, f"{key}_token_id", words.convert_tokens_to_ids(token))
    torch.manual_seed(0)
    return model_class(config).to(dtype)


QWEN_TOKENS = {"vision_start": "<|vision_start|>", "image": "<|image_pad|>", "vision_end": "<|vision_end|>"}
QWEN_IMAGE = "".join(QWEN_TOKENS.values())  # Qwen2-VL's text for an image


def qwen2_vl_processor():
    """Qwen2-VL's processor for images, built in memory (examples/recipes/trainer_data's tokenizer
    with Qwen's three image tokens; images resized to 56 x 56 pixels: 4 x 4 patches of 14, 4
    placeholder tokens once merged 2 x 2). Qwen2VLProcessor itself also needs a video processor,
    which needs torchvision (not installed here): this one has none (no videos)."""
    import transformers as tf
    from transformers.processing_utils import ProcessorMixin

    class Qwen2VLImageProcessor(tf.Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = None
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    words = _words(QWEN_TOKENS)
    images = tf.Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56)
    return Qwen2VLImageProcessor(image_processor=images, tokenizer=words)


def qwen2_vl(dtype=torch.float64):
    """A tiny Qwen2-VL (zoo's config: mRoPE sections [1, 1, 2], a vision tower of width 32) whose
    image tokens are qwen2_vl_processor()'s."""
    import transformers as tf

    from parity_tests.hf import zoo

    config = zoo.tiny_config("qwen2_vl")
    config.vision_config.embed_dim = 32
    config.vision_config.hidden_size = config.get_text_config().hidden_size
    return _with_tokens(tf.Qwen2VLForConditionalGeneration, config, QWEN_TOKENS, dtype)


GEMMA4_TOKENS = {"boi": "<|image>", "image": "<|image|>", "eoi": "<image|>"}
GEMMA4_IMAGE = GEMMA4_TOKENS["image"]  # the processor puts its marks around an image's tokens


def gemma4_processor():
    """Gemma 4's processor for images, built in memory (trainer_data's tokenizer with Gemma 4's
    three image tokens). Its image processor resizes an image to its smallest budget of soft tokens
    (70), at the tiny tower's patches of 4 pooled 2 x 2: 64 x 64 pixels, 64 placeholder tokens.
    Gemma4Processor itself also needs a video processor and an audio feature extractor: this
    one has neither (no videos, no audio)."""
    import transformers as tf
    from transformers.processing_utils import ProcessorMixin

    class Gemma4ImageProcessor(tf.Gemma4Processor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_seq_length = 0  # (counts come from the image processor)
            self.boi_token, self.image_token, self.eoi_token = GEMMA4_TOKENS.values()
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token = self.video_token_id = self.audio_token = self.audio_token_id = None
            self.boa_token = self.eoa_token = ""  # (its input check reads them even without audio)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    words = _words(GEMMA4_TOKENS)
    images = tf.Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)
    return Gemma4ImageProcessor(image_processor=images, tokenizer=words)


def gemma4(dtype=torch.float64):
    """A tiny Gemma 4 (zoo's config: a sliding layer of window 8 and a full one; media_cases'
    vision tower) whose image tokens are gemma4_processor()'s, its images bidirectional on the
    sliding layers (`use_bidirectional_attention="vision"`)."""
    import transformers as tf

    from parity_tests.hf import media_cases

    config = zoo.tiny_config("gemma4")
    config.vision_config = media_cases.gemma4_vision("gemma4")
    config.get_text_config().use_bidirectional_attention = "vision"
    return _with_tokens(tf.Gemma4ForConditionalGeneration, config, GEMMA4_TOKENS, dtype)


GLM4V_TOKENS = {
    "image_start": "<|begin_of_image|>",
    "image": "<|image|>",
    "image_end": "<|end_of_image|>",
    "video_start": "<|begin_of_video|>",
    "video_end": "<|end_of_video|>",
}
GLM4V_IMAGE = "".join(GLM4V_TOKENS[key] for key in ("image_start", "image", "image_end"))


def glm4v_processor():
    """GLM-4.1V's processor for images, built in memory as qwen2_vl_processor() (its image
    processor resizes to 56 x 56 pixels: 4 x 4 patches of 14, 4 placeholder tokens once merged
    2 x 2; no video processor, which needs torchvision)."""
    import transformers as tf
    from transformers.processing_utils import ProcessorMixin

    class Glm4vImageProcessor(tf.Glm4vProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = GLM4V_TOKENS["image"], None
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = None
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
            self.video_start_id, self.video_end_id = (
                tokenizer.convert_tokens_to_ids(GLM4V_TOKENS[key]) for key in ("video_start", "video_end")
            )

    words = _words(GLM4V_TOKENS)
    images = tf.Glm4vImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": 56 * 56})
    return Glm4vImageProcessor(image_processor=images, tokenizer=words)


def glm4v(dtype=torch.float64):
    """A tiny GLM-4.1V (zoo's config: mRoPE sections [1, 1, 2] of its partial rotary) whose image
    tokens are glm4v_processor()'s."""
    import transformers as tf

    config = zoo.tiny_config("glm4v")
    config.vision_config.out_hidden_size = config.get_text_config().hidden_size
    return _with_tokens(tf.Glm4vForConditionalGeneration, config, GLM4V_TOKENS, dtype)
