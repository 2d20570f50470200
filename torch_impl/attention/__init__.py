"""One CP rank's causal attention over the keys it holds, without an [L, T] mask or score matrix.

Rank r's L queries sit at global rows q_start .. q_start + L - 1; its T keys (gathered, or a halo
followed by its own) at global rows k_start .. q_start + L - 1. Query q sees key k iff

    k <= q,   q - k < window (when there is one),   documents[k] == documents[q] (packed
    sequences),   padding[k] (a padding key is seen by no one)

and a query that sees no key at all returns zeros. Two model-specific terms join the softmax:
soft-capping (Gemma 2), score -> softcap * tanh(score / softcap) before the mask, and sinks
(GPT-OSS), one learned logit per query head added to every query's denominator with no value, so
out' = out * sigmoid(lse - sink) (a query that sees no key still returns zeros). Memory is
O((L + T) * heads * head_dim) plus a kernel's workspace; no path builds a mask or score matrix that
grows with L * T.

Kernels (`kernels.choose_kernel`; the table with the reasons is in docs/hf.md): on CUDA, flash
attention aligned bottom-right for global layers without documents, padding, cap or sinks, and
`flex_attention` with a BlockMask built from `mask_mod` for the rest (the cap a `score_mod`, sinks
through its lse); on CPU, `tiled_attention`: query blocks over key tiles through the CPU flash op
(soft-capped: explicit block-sized scores), merged by log-sum-exp, sinks joined to the merged lse,
an exact backward recomputing each tile.

Packed documents cost what they need: the CPU tiles skip every tile that no query's document
reaches and leave tiles inside one document unmasked (`tile_plan`'s spans); on CUDA,
create_block_mask marks such blocks empty (flex_attention skips them) or full (no mask_mod call).
The CUDA rows are PyTorch's own fused kernels (`parity_tests/cuda/test_cuda.py` checks them against the
CPU tiles, `make gpu-check`). Modules: `rule` (the visibility rule and the arguments' checks),
`kernels` (`causal_attention` and the kernel table), `tiles` (the CPU tiles), `plan` (which
tiles, and how each is masked), `sparse_mla` (DeepSeek Sparse Attention's absorbed form,
`sparse_mla_attention`).
"""

from torch_impl.attention.kernels import causal_attention, choose_kernel
from torch_impl.attention.rule import mask_mod
from torch_impl.attention.sparse_mla import sparse_mla_attention
from torch_impl.attention.tiles import tiled_attention

__all__ = ["causal_attention", "choose_kernel", "mask_mod", "sparse_mla_attention", "tiled_attention"]
