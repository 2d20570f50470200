"""Cases for test_recurrent, run on every rank of a worker pool's group: a linear-attention kernel
(transformers' own) made CP by torch_impl.hf.recurrent.ChunkState, on this rank's shard."""

from torch_impl.hf.recurrent import ChunkState
from torch_impl.layout import ShardPlan

NAMES = ("query", "key", "value", "g", "beta")


def kernel(name):
    """transformers' chunked kernel: "gdn" (Gated DeltaNet, Qwen3.5's) or "kda" (Kimi Linear's)."""
    if name == "gdn":
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

        return torch_chunk_gated_delta_rule
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    return chunk_kimi_delta_attention


def one_process(name, inputs, cotangent, l2norm):
    """The kernel over the whole sequence: its output [B, S, H, dv] and each input's gradient."""
    leaves = {key: inputs[key].clone().requires_grad_(True) for key in NAMES}
    out, _ = kernel(name)(*leaves.values(), use_qk_l2norm_in_kernel=l2norm)
    out.backward(cotangent)
    return out.detach(), {key: leaf.grad for key, leaf in leaves.items()}


def chunk_state(group, name, inputs, cotangent, layout, l2norm):
    """The kernel made CP on this rank's rows of the global inputs ([B, S, ...] each): its output
    [B, L, H, dv] and the gradients of this rank's inputs."""
    n, r = group.size(), group.rank()
    rows = ShardPlan.of(layout, n, r, inputs["query"].shape[1] // n).rows()  # [L]
    leaves = {key: inputs[key][:, rows].clone().requires_grad_(True) for key in NAMES}
    out, final = ChunkState(kernel(name), group, layout)(*leaves.values(), use_qk_l2norm_in_kernel=l2norm)
    assert final is None
    out.backward(cotangent[:, rows])
    return out.detach(), {key: leaf.grad for key, leaf in leaves.items()}


def refusals(group):
    """A parallelized Qwen3.5 called to make a cache (generation): each rank's ValueError message."""
    from parity_tests import hf_models
    from torch_impl import hf

    model = hf.parallelize(hf_models.build("qwen3_5"), group, verbose=False)
    local = hf.shard_batch(hf_models.make_batch(), group) | {"use_cache": True}
    try:
        model(**local)
    except ValueError as e:
        return str(e)
    return None
