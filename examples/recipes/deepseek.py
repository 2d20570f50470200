"""Recipe: DeepSeek V3.2's sparse attention under CP, equal to one process.

    torchrun --standalone --nproc-per-node 2 -m examples.recipes.deepseek

Every layer is `indexed_attention`: each query attends to the `index_topk` earlier keys its
indexer scores highest. Rank r receives the MLA latents and indexer keys of the tokens before its
own, point to point (nothing of later ranks), runs the model's own indexer over them and attends
over the keys it picked. float64: the indexer's top-k and the MoE router's top-2 are discrete
choices from float32 scores, and in float32 a rounding difference between CP and one process can
flip a near tie (then the two runs part); in float64 they agree, to the float32 rounding that
transformers' RMS norms and router still apply (they compute in float32 whatever the dtype: a few
steps of 2^-24 of the logits, which stay below 1): 1e-6.
"""

import torch
import torch.distributed as dist
import transformers as tf

from examples.recipes.common import compare, finish
from torch_impl import hf


def deepseek_v32():
    torch.manual_seed(0)  # the same weights on every rank (or load the same checkpoint)
    config = tf.DeepseekV32Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,  # layer 0 a dense MLP, layer 1 MoE
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        index_topk=64,  # each query attends to 64 keys
        index_head_dim=32,
        index_n_heads=8,
        use_cache=False,
    )
    model = tf.DeepseekV32ForCausalLM(config).double()
    model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel on CPU
    return model


def main():
    dist.init_process_group("gloo")  # "nccl" with one GPU per rank
    group = dist.group.WORLD  # CP over every rank
    ids = torch.randint(0, 128, (1, 512), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}

    model = hf.parallelize(deepseek_v32(), group)
    out = model(**hf.shard_batch(batch, group))
    out.loss.backward()  # the indexer gets no gradient (transformers runs it under no_grad)

    one = deepseek_v32()(**batch)
    finish(compare("DeepSeek V3.2, index_topk 64 of 512", out, one, tolerance=1e-6))


if __name__ == "__main__":
    main()
