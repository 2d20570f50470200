"""The bytes a rank must receive, from the layer's sizes alone (what the tests and benchmarks count
at the c10d calls is compared with these)."""


def indexed_layer_bytes(config, n, L, r, item, indexer=True):
    """{(transport, direction): bytes} rank r receives for one indexed_attention layer."""
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    index = config.index_head_dim if indexer else 0  # GLM-5's shared layers have no indexer
    heads = config.num_attention_heads
    expanded = heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)
    return {
        ("torch_impl", "forward"): r * L * (latent + index) * item,
        ("torch_impl", "backward"): (n - 1 - r) * L * latent * item,
        ("allgather", "forward"): ((n - 1) * L * expanded + r * L * index) * item,
        ("allgather", "backward"): (n - 1) * L * expanded * item,
    }
