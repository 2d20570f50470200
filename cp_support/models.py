"""The small transformers models (Gemma 3, LFM2, DeepSeek V3.2, Qwen3.5) from configs, with random weights:
the main job's (examples.train trains them, the benchmarks measure them) and the one-rank
benchmarks' (`capacity_model`: benchmarks.rank_capacity, benchmarks.packed_rows)."""

import torch

VOCAB = 256  # byte tokens (cp_support.corpus)


def build_model(name, seq_len, window, dtype, seed=0):
    """A small transformers hybrid LM with random weights, the same on every rank for the seed."""
    import transformers as tf

    torch.manual_seed(seed)
    common = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 192, "num_attention_heads": 4}
    common |= {"num_key_value_heads": 1, "max_position_embeddings": seq_len}
    if name == "gemma3":
        layer_types = ["sliding_attention"] * 5 + ["full_attention"]  # Gemma 3's 5:1 pattern
        config = tf.Gemma3TextConfig(
            **common,
            num_hidden_layers=len(layer_types),
            layer_types=layer_types,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=window,
        )
        model = tf.Gemma3ForCausalLM(config)
    elif name == "deepseek_v32":
        layer_types = ["indexed_attention"] * 4  # DeepSeek Sparse Attention in every layer
        config = tf.DeepseekV32Config(
            **common | {"num_key_value_heads": 4},  # MLA expands its latents to every head
            num_hidden_layers=len(layer_types),
            moe_intermediate_size=64,
            n_shared_experts=1,
            n_routed_experts=4,
            n_group=1,
            topk_group=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=16,
            index_topk=window,  # each query attends to the `--window` keys its indexer scores highest
            index_head_dim=32,
            index_n_heads=16,
            use_cache=False,
        )
        model = tf.DeepseekV32ForCausalLM(config)
        if dtype == torch.float64:  # grouped_mm has no float64 kernel on CPU
            model.set_experts_implementation("eager")
    elif name == "lfm2":
        layer_types = ["conv", "conv", "full_attention", "conv", "conv", "full_attention"]
        config = tf.Lfm2Config(**common, num_hidden_layers=len(layer_types), layer_types=layer_types)
        model = tf.Lfm2ForCausalLM(config)
    elif name == "qwen3_5":
        layer_types = ["linear_attention"] * 3 + ["full_attention"]  # Qwen3.5's 3:1 pattern
        config = tf.Qwen3_5TextConfig(
            **common,
            num_hidden_layers=len(layer_types),
            layer_types=layer_types,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        )
        model = tf.Qwen3_5ForCausalLM(config)
    else:
        raise ValueError(f"`--model` must be gemma3, lfm2, deepseek_v32 or qwen3_5, got {name!r}")
    return model.to(dtype)


WINDOWS = {"gemma3": 512, "gemma2": 512, "gpt_oss": 128}  # capacity_model's default sliding windows


def capacity_model(args, max_positions):
    """The benchmarks' one-rank model from their command-line `args`, one KV head, at args' sizes:
    Gemma 3's text model in the demo's layout (5 sliding layers then a global one, sdpa); Gemma 2
    (`--model gemma2`: attention logit soft-capping 50) or GPT-OSS (`gpt_oss`: attention sinks, 4
    experts of `--intermediate` (default hidden), 2 a token), sliding and global layers
    alternating, on eager attention (transformers has no sdpa path for either); or (`--model
    deepseek_v32`) capacity_dsa, (`--model qwen3_5`) capacity_qwen3_5."""
    import transformers as tf

    torch.manual_seed(0)
    if args.model == "deepseek_v32":
        return capacity_dsa(args, max_positions)
    if args.model == "qwen3_5":
        return capacity_qwen3_5(args, max_positions)
    if args.model == "mamba2":
        return capacity_mamba2(args, max_positions)
    if args.model == "minimax":
        return capacity_minimax(args, max_positions)
    if args.model == "deepseek_v4":
        return capacity_deepseek_v4(args, max_positions)
    period = 6 if args.model == "gemma3" else 2
    layer_types = [
        "full_attention" if i % period == period - 1 else "sliding_attention" for i in range(args.layers)
    ]
    head_dim = args.head_dim or args.hidden // args.heads
    common = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or 3 * args.hidden,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=args.heads,
        num_key_value_heads=1,
        head_dim=head_dim,
        sliding_window=args.window or WINDOWS[args.model],
        max_position_embeddings=max_positions,
    )
    if args.model == "gpt_oss":
        common["intermediate_size"] = args.intermediate or args.hidden
        config = tf.GptOssConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, attn_implementation="eager"
        )
        return tf.GptOssForCausalLM(config)
    if args.model == "gemma2":
        config = tf.Gemma2Config(**common, query_pre_attn_scalar=head_dim, attn_implementation="eager")
        return tf.Gemma2ForCausalLM(config)
    config = tf.Gemma3TextConfig(**common, query_pre_attn_scalar=head_dim, attn_implementation="sdpa")
    return tf.Gemma3ForCausalLM(config)


def capacity_qwen3_5(args, max_positions):
    """Qwen3.5's Gated DeltaNet layers alone (`--layers` of them), at its released head sizes: 16
    key and 16 value heads of dk = dv = 128, conv kernel 4, hidden `--hidden`, dense MLPs."""
    import transformers as tf

    config = tf.Qwen3_5TextConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or 3 * args.hidden,
        num_hidden_layers=args.layers,
        layer_types=["linear_attention"] * args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=1,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        max_position_embeddings=max_positions,
    )
    return tf.Qwen3_5ForCausalLM(config)


def capacity_mamba2(args, max_positions):
    """Mamba2 layers alone (`--layers`), at Nemotron-H's head sizes: heads of 64 dims, state 128, 8
    groups, conv kernel 4, scan chunks of 128; 32 heads (2 x `--hidden` = 2048 inner dims)."""
    import transformers as tf

    config = tf.Mamba2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_heads=2 * args.hidden // 64,
        head_dim=64,
        expand=2,
        state_size=128,
        n_groups=8,
        conv_kernel=4,
        chunk_size=128,
    )
    return tf.Mamba2ForCausalLM(config)


def capacity_minimax(args, max_positions):
    """MiniMax's lightning attention layers alone (`--layers`), at MiniMax-Text-01's head size:
    heads of 128 dims (`--hidden` / 128 of them), blocks of 256; one expert a token of
    `--intermediate` (default 3 x hidden), eager."""
    import transformers as tf

    config = tf.MiniMaxConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or 3 * args.hidden,
        num_hidden_layers=args.layers,
        layer_types=["linear_attention"] * args.layers,
        num_attention_heads=args.hidden // 128,
        num_key_value_heads=1,
        head_dim=128,
        block_size=256,
        num_local_experts=1,
        num_experts_per_tok=1,
        max_position_embeddings=max_positions,
    )
    model = tf.MiniMaxForCausalLM(config)
    model.set_experts_implementation("eager")
    return model


def capacity_deepseek_v4(args, max_positions):
    """DeepSeek V4's layer kinds once each: a sliding layer, CSA (windows of 4 and the window
    before, an indexer of 8 heads of 64 keeping `--topk` entries) and HCA (windows of 128), window
    128, one shared KV head of 128 (64 rotated), 8 query heads, hidden 512, 4 hyper-connection
    streams, 4 experts of 512 (2 a token, by token id: the fake group's received bytes are
    arbitrary, and a learned router could send a recomputation elsewhere), eager (transformers'
    only attention for it)."""
    import transformers as tf

    config = tf.DeepseekV4Config(
        vocab_size=args.vocab,
        hidden_size=512,
        moe_intermediate_size=512,
        num_hidden_layers=3,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe"] * 3,  # routed by token id: the same in a recomputation
        num_attention_heads=8,
        head_dim=128,
        partial_rotary_factor=0.5,
        q_lora_rank=256,
        o_groups=4,
        o_lora_rank=128,
        n_routed_experts=4,
        num_experts_per_tok=2,
        index_n_heads=8,
        index_head_dim=64,
        index_topk=args.topk,
        sliding_window=128,
        max_position_embeddings=max_positions,
        use_cache=False,
        attn_implementation="eager",
    )
    model = tf.DeepseekV4ForCausalLM(config)
    model.set_experts_implementation("eager")
    return model


def capacity_dsa(args, max_positions):
    """DeepSeek V3.2's sparse attention in both layers (dense MLPs), MLA at hidden 512 with 16 heads
    (nope 128 + rope 64, v 128, latents of 512 + 64), 8 indexer heads of 64, top-k `--topk` (256:
    S / 64 at L = 2048, n = 8)."""
    import transformers as tf

    config = tf.DeepseekV32Config(
        vocab_size=args.vocab,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=2,
        first_k_dense_replace=2,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=128,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        index_n_heads=8,
        index_head_dim=64,
        index_topk=args.topk,
        max_position_embeddings=max_positions,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return tf.DeepseekV32ForCausalLM(config)
