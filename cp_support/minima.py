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


def halo_tokens_moved(r, n, L, halo_size):
    """Tokens rank r must receive in forward+backward: its halo, then the gradients of the tokens
    later ranks' halos took from it (None for a full gather: 2 * (n-1) * L)."""
    if halo_size is None:
        return 2 * (n - 1) * L
    got = min(r * L, halo_size)
    lent = sum(
        max(0, min((r + 1) * L, d * L) - max(r * L, d * L - min(d * L, halo_size))) for d in range(r + 1, n)
    )
    return got + lent
