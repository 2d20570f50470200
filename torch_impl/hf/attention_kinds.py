"""The attention layers whose parts the adapter makes CP beside the registered attention function
(torch_impl.hf.attention), in one table, ATTENTIONS: how each kind is recognised (by the config's
layer type and the module's parts), what its refusal says, how its parts are made CP (a class
mixed into the module, its indexer or its compressor) and the path it reports. torch_impl.hf.kinds'
walk reads the refusals, torch_impl.hf.parallelize applies the rest."""

from collections.abc import Callable
import inspect
from typing import NamedTuple

from torch import nn

from torch_impl.hf._common import INDEXED, mix
from torch_impl.hf.block_sparse import BLOCK_SPARSE, BlockIndexer, is_block_sparse
from torch_impl.hf.compressed import COMPRESSED, CompressedEntries, is_compressor
from torch_impl.hf.indexed import AbsorbedMLA, BlockedIndexer, QSAIndexer
from torch_impl.hf.inkling import RelativeTable, is_relative


def layer_type(module):
    """The config's type for a module that knows its layer index (e.g. 'sliding_attention'), else None."""
    types, index = (
        getattr(getattr(module, "config", None), "layer_types", None),
        getattr(module, "layer_idx", None),
    )
    return types[index] if types and isinstance(index, int) and 0 <= index < len(types) else None


def is_qsa(module):
    """Qwen4's QSA layer: no MLA, an indexer that pools the keys a query sees into blocks of
    `compress_ratio` and keeps the `token_budget // compress_ratio` best blocks and the incomplete
    last one, with the forward QSAIndexer calls."""
    indexer = getattr(module, "indexer", None)
    if callable(getattr(module, "expand_kv", None)) or indexer is None:
        return False
    names = list(inspect.signature(indexer.forward).parameters)
    wanted = ["hidden_states", "position_embeddings", "attention_mask", "past_key_values"]
    return names == wanted and hasattr(indexer, "compress_ratio") and hasattr(indexer, "token_budget")


def _indexed_refusal(module):
    """Why an indexed_attention layer cannot be made exact, else None: it must be DeepSeek V3.2's /
    GLM-5's, MLA latents expanded by `expand_kv` through a `kv_b_proj` without bias (absorbed
    exactly), an indexer (or, GLM-5's shared layers, the previous layer's indices) with the forward
    the adapter calls, no attention dropout (Qwen4's QSA is its own kind, before this one)."""
    if not callable(getattr(module, "expand_kv", None)) or not hasattr(module, "indexer"):
        return f"is an {INDEXED!r} layer without MLA's expand_kv and an indexer, nor Qwen4's QSA"
    projection = getattr(module, "kv_b_proj", None)
    nope_dim = getattr(module, "qk_nope_head_dim", None)
    if not isinstance(projection, nn.Linear) or projection.bias is not None or nope_dim is None:
        return (
            f"is an {INDEXED!r} layer whose latents are not expanded by a `kv_b_proj` Linear without bias "
            "(with `qk_nope_head_dim`): the absorbed attention could not reproduce it"
        )
    if module.indexer is not None:
        names = list(inspect.signature(module.indexer.forward).parameters)[:6]
        expected = ["hidden_states", "q_resid", "position_embeddings", "attention_mask", "position_ids"]
        if names[:5] != expected or "past_key_values" not in names:
            return f"has an indexer whose forward takes {names}, not {expected}"
    if getattr(module.config, "attention_dropout", 0.0) > 0:
        return f"is an {INDEXED!r} layer with attention dropout, which is not supported"
    return None


def _compressed_refusal(module):
    if not is_compressor(getattr(module, "compressor", None)):
        kind = layer_type(module)
        return f"is a {kind!r} layer without DeepSeek V4's compressor (its forward and cache calls)"
    return None


def _block_sparse_refusal(module):
    if not is_block_sparse(module):
        return f"is a {BLOCK_SPARSE!r} layer without MiniMax-M3's indexer"
    if module.indexer.local_blocks > module.indexer.topk_blocks:  # ties among its kept blocks
        return (
            "keeps more local blocks than its top-k: they tie (+inf), and top-k's choice among them "
            "depends on how many keys it scores"
        )
    return None


def _absorbed(module):
    mix(module, AbsorbedMLA)
    if module.indexer is not None:
        mix(module.indexer, BlockedIndexer)


class AttentionKind(NamedTuple):
    """A kind of attention layer whose parts the adapter makes CP beside the registered attention
    function."""

    recognise: Callable  # (module, its layer type) -> bool
    apply: Callable  # (module): its parts' CP classes mixed in
    path: str  # what its CP forward does (model.cp_transport_paths)
    refusal: Callable | None = None  # (module) -> why CP cannot make it exact, or None

    def why(self, module) -> str | None:
        """Why `module`, of this kind, cannot be made exact; None where it can."""
        return self.refusal(module) if self.refusal is not None else None


# the first that recognises a module is its kind; any other attention layer takes the registered
# function alone (full, sliding, chunked)
ATTENTIONS = (
    AttentionKind(  # Inkling's (torch_impl.hf.inkling)
        lambda module, typed: is_relative(module) and typed not in (BLOCK_SPARSE, INDEXED, *COMPRESSED),
        lambda module: mix(module.rel_logits_proj, RelativeTable),
        "relative logits by global distance; the model's attention per block of queries on a dense "
        "[block, T] mask",
    ),
    AttentionKind(  # MiniMax-M3's (torch_impl.hf.block_sparse)
        lambda module, typed: typed == BLOCK_SPARSE,
        lambda module: mix(module.indexer, BlockIndexer),
        "its indexer per chunk over every rank's index keys; the model's block mask, dense [L, T] per head",
        refusal=_block_sparse_refusal,
    ),
    AttentionKind(  # DeepSeek V4's CSA and HCA (torch_impl.hf.compressed)
        lambda module, typed: typed in COMPRESSED,
        lambda module: mix(module.compressor, CompressedEntries),
        "each rank's windows compressed, the entries gathered; the sliding window's keys and the entries "
        "on a dense [L, T] mask",
        refusal=_compressed_refusal,
    ),
    AttentionKind(  # Qwen4's QSA (torch_impl.hf.indexed)
        lambda module, typed: typed == INDEXED and is_qsa(module),
        lambda module: mix(module.indexer, QSAIndexer),
        "QSA indexer per chunk over the causal prefix's keys; its picks a dense [L, T] mask",
    ),
    AttentionKind(  # DeepSeek Sparse Attention (torch_impl.hf.indexed)
        lambda module, typed: typed == INDEXED,
        _absorbed,
        "blocked indexer, absorbed sparse attention over the causal prefix's latents",
        refusal=_indexed_refusal,
    ),
)


def attention_kind(module) -> AttentionKind | None:
    """The first ATTENTIONS kind that recognises an attention module, else None."""
    return next((kind for kind in ATTENTIONS if kind.recognise(module, layer_type(module))), None)
