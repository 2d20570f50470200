"""Hugging Face `transformers` models made context-parallel, each layer moving only what it needs.

    from torch_impl import hf

    model = hf.parallelize(model, group)  # in place; group: ProcessGroup, 1-D DeviceMesh or None
    local = hf.shard_batch(batch, group)  # global [B, S] tensors -> this rank's model kwargs
    out = model(**local)                  # out.logits: [B, S/n, vocab]; out.loss: this rank's share
    out.loss.backward()                   # parameter grads summed over the CP group = one process's

Rank r of n holds the global tokens [r*L, (r+1)*L), L = S/n (or, with `layout="head_tail"` given
to both calls, chunks r and 2n-1-r of S/2n tokens: balanced causal work). The adapter is one registered
attention implementation (`config._attn_implementation = "cp_transport"`, through transformers'
`AttentionInterface` and `AttentionMaskInterface`), forward hooks on short convolutions, and
linear-attention modules run with CP versions of their conv and chunked kernel. Full attention
gathers K and V (side by side, one `gather_sequence`), sliding windows and short convolutions
fetch `gather_halo`'s W - 1 or K - 1 preceding tokens, chunked attention its chunk's reach, linear
recurrences receive the earlier chunks' state (`gather_state`), DeepSeek Sparse Attention the
causal prefix's latents; docs/hf.md ("Layer kinds") has the table of what each receives and how
its math is kept exact.

The padding mask (the model's attention_mask) is gathered once per forward by the pre-hook, a
byte a token, and every attention layer cuts its keys' rows from it.

The model decides which layers slide: its mask factory (`create_sliding_window_causal_mask`) calls
this implementation's mask function with the window, which returns a `LocalMask` that the model
routes to those layers, carrying the forward's `Context` (packed documents, attention chunks) that
the pre-hook on the module receiving the inputs made (`inputs`: also the positions the model would
make over the whole sequence, and the refusal of non-text inputs; a multimodal model's encoders
are left alone). The math is `torch_impl.attention.causal_attention` (fused kernels, no
[L, T] mask; Gemma 2's soft-capping and GPT-OSS's sinks included), except attention dropout in
train mode, which it does not apply: such calls keep the model's own mask and attention functions
(`sdpa`, or its module's `eager_attention_forward`) on a dense [L, T] mask. Packed sequences
(position_ids that restart, no attention_mask, no cache: when transformers isolates the documents)
add document ids, made once per forward from the gathered positions. Whatever this cannot make
exact raises `ValueError`: at `parallelize` (recurrent layers but Gated DeltaNet, KDA, Mamba2,
Mamba, MiniMax's lightning attention and RG-LRU; cross attention but Mllama's over its images,
which every rank holds whole; bidirectional attention, attention outside
transformers' AttentionInterface or editing its own mask, unknown sequence convolutions,
flash/flex kernels), or at the first call (a KV cache past the first step, custom mask overlays, a
4-D mask, non-text inputs). Which families are exact and which are refused, and why:
docs/models.md (`make models`).

Modules: `kinds` (which kind each token-mixing module is, or the refusal), `parallelize` (each
kind made CP), one per layer kind (`attention`: full and sliding; `recurrent`: linear attention and
short convs, with `RECURRENCES` their table; `indexed`: DeepSeek Sparse Attention and Qwen4's QSA;
...: docs/design.md names them all), `inputs` (the base model's pre-hook), `batch` (`shard_batch`),
`heads` (sequence classification),
`trainer` (`ContextParallelMixin`: transformers' Trainer and TRL's SFTTrainer, RewardTrainer,
DPOTrainer, KTOTrainer, GRPOTrainer and RLOOTrainer; `whole_rows`: TRL's fused LM head called
with whole rows, sharded and its outputs gathered; `rl`: GRPO's and RLOO's generation).
"""

from torch_impl.hf._common import IMPLEMENTATION
from torch_impl.hf.batch import shard_batch
from torch_impl.hf.data_parallel import apply_ddp, apply_fsdp, gradient_divide_factor
from torch_impl.hf.parallelize import checkpoint_kwargs, parallelize
from torch_impl.hf.trainer import ContextParallelMixin

__all__ = [
    "IMPLEMENTATION",
    "ContextParallelMixin",
    "apply_ddp",
    "apply_fsdp",
    "checkpoint_kwargs",
    "gradient_divide_factor",
    "parallelize",
    "shard_batch",
]
