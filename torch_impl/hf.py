"""Hugging Face `transformers` models made context-parallel, each layer moving only what it needs.

    from torch_impl import hf

    model = hf.parallelize(model, group)  # in place; group: ProcessGroup, 1-D DeviceMesh or None
    local = hf.shard_batch(batch, group)  # global [B, S] tensors -> this rank's model kwargs
    out = model(**local)                  # out.logits: [B, S/n, vocab]; out.loss: this rank's share
    out.loss.backward()                   # parameter grads summed over the CP group = one process's

Rank r of n holds the global tokens [r*L, (r+1)*L), L = S/n. The adapter is one registered
attention implementation (`config._attn_implementation = "cp_transport"`, through transformers'
`AttentionInterface` and `AttentionMaskInterface`) and forward hooks on short convolutions:

| layer kind                              | forward transport (rank r)    | the math                  |
|-----------------------------------------|-------------------------------|---------------------------|
| full causal attention                   | K, V: gather_sequence;        | torch_impl.attention over |
|                                         | padding mask: gather_metadata | the keys up to its own,   |
| sliding-window attention, window W      | K, V: gather_halo(W - 1);     | queries at r*L, keys at   |
| (a query sees W keys, itself included)  | padding mask: gather_halo     | their global rows         |
| causal depthwise short conv, kernel K   | input, padding mask:          | the module's own forward; |
| (LFM2's `Lfm2ShortConv`)                | gather_halo(K - 1)            | the halo's outputs dropped|
| DeepSeek Sparse Attention (DeepSeek     | MLA latents and indexer keys  | the model's own indexer,  |
| V3.2, GLM-5: `indexed_attention`)       | of the causal prefix:         | blocked; sparse_mla_      |
|                                         | gather_halo((n-1)*L)          | attention (absorbed MLA)  |
|                                         |                               | over the picked latents   |

The model decides which layers slide: its mask factory (`create_sliding_window_causal_mask`) calls
this implementation's mask function with the window, which returns a `LocalMask` that the model
routes to those layers. The math is `torch_impl.attention.causal_attention` (fused kernels, no
[L, T] mask), except for layers whose model math it does not reproduce (soft-capping, attention
sinks, attention dropout): those keep the model's own mask and attention functions (`sdpa`, or its
module's `eager_attention_forward`) on a dense [L, T] mask. Packed sequences (position_ids that
restart, no attention_mask, no cache: when transformers isolates the documents) add document ids,
made once per forward from the gathered positions. Whatever this cannot make exact raises
`ValueError`: at `parallelize` (recurrent layers, cross or bidirectional attention, chunked
attention, unknown sequence convolutions, flash/flex kernels), or at the first call (a KV cache
past the first step, custom mask overlays, a 4-D mask).
"""

from collections.abc import Callable
import dataclasses
from functools import partial
import inspect
import logging
import re
import sys
from typing import NamedTuple

import torch
from torch import nn
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from transformers import AttentionInterface, PreTrainedConfig
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionMaskInterface,
    and_masks,
    causal_mask_function,
    find_packed_sequence_indices,
    packed_sequence_mask_function,
    sliding_window_causal_mask_function,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from torch_impl import _group, validation
from torch_impl.attention import causal_attention, sparse_mla_attention
from torch_impl.data_parallel import apply_ddp as apply_ddp  # re-exported: hf.apply_ddp, ...
from torch_impl.data_parallel import apply_fsdp as apply_fsdp
from torch_impl.data_parallel import gradient_divide_factor as gradient_divide_factor
from torch_impl.halo import gather_halo
from torch_impl.metadata import gather_metadata
from torch_impl.sequence import gather_sequence

IMPLEMENTATION = "cp_transport"
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention", "conv", "indexed_attention")
INDEXED = "indexed_attention"  # DeepSeek Sparse Attention (DeepSeek V3.2, GLM-5): MLA + an indexer's top-k
SHORT_CONVS = ("Lfm2ShortConv", "Lfm2MoeShortConv")  # causal depthwise conv of in_proj's gated output
RECURRENT = re.compile(r"Mamba|GatedDeltaNet|LinearAttention|Rwkv|RWKV|Recurrent|Retention|xLSTM|Ssm|SSM")
IGNORE_INDEX = -100
BATCH_KEYS = ("input_ids", "attention_mask", "labels", "position_ids")
DOCUMENTS = "cp_documents"  # the kwarg that carries packed sequences' document ids to the attention
log = logging.getLogger(__name__)


class LocalMask(NamedTuple):
    """What this implementation's mask function hands the model to route to its attention layers."""

    padding: torch.Tensor | None  # bool [B, L]: this rank's 2-D padding mask (True: a token), or None
    window: int | None  # sliding window W (a query sees W keys, itself included); None: full causal


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """Set on each attention module by `parallelize`: its CP group and the model's own math."""

    group: dist.ProcessGroup
    attend: Callable  # (module, q, k, v, mask, **kwargs) -> (out [B, L, H, D], weights)
    make_mask: Callable  # transformers' mask function for `attend` (sdpa_mask or eager_mask)
    dense: str | None  # why this layer keeps `attend` on a dense [L, T] mask; None: torch_impl.attention


# --- the registered attention and mask functions -------------------------------------------------


def local_mask(
    batch_size,
    q_length,
    kv_length,
    q_offset=0,
    kv_offset=0,
    attention_mask=None,
    local_size=None,
    allow_is_causal_skip=True,
    use_vmap=False,
    **kwargs,
):
    """transformers calls this once per forward per mask kind; the math waits for the gathered keys."""
    if q_offset != 0 or kv_offset != 0 or kv_length != q_length:
        raise ValueError(
            f"`{IMPLEMENTATION}` cannot attend over a KV cache (generation): the model asked for "
            f"{q_length} queries over {kv_length} keys at offsets {q_offset}, {kv_offset}"
        )
    if use_vmap:
        raise ValueError(
            f"`{IMPLEMENTATION}` supports causal and sliding-window masks (and packed sequences) only: this "
            "model asked for a mask overlay (bidirectional or blockwise tokens, or a non-causal config)"
        )
    return LocalMask(attention_mask, local_size)  # packed sequences: the documents come as a kwarg


def fetch_keys(group, key, value, padding, window):
    """This rank's keys and values, their padding mask, and the global position of the first key.

    key/value: [B, Hkv, L, D]; padding: bool [B, L] or None. Full attention (window None) gathers
    keys 0 .. S-1; a window W fetches only the h = min(r*L, W-1) keys before this rank's own.
    Returns key/value [B, Hkv, T, D] for the keys first_key .. (r+1)*L - 1, and the padding mask
    indexed by global key position ([B, (r+1)*L] or [B, S]; False before first_key), or None.
    """
    L = key.shape[2]
    if window is None:
        key = gather_sequence(key.transpose(1, 2), group).transpose(1, 2)  # [B, Hkv, S, D]
        value = gather_sequence(value.transpose(1, 2), group).transpose(1, 2)  # [B, Hkv, S, D]
        padding = None if padding is None else gather_metadata(padding, group)  # [B, S]
        return key, value, padding, 0
    start = _group.rank(group) * L  # this rank's first token
    first_key = start - min(start, window - 1)
    key = gather_halo(key.transpose(1, 2), group, window - 1).transpose(1, 2)  # [B, Hkv, h+L, D]
    value = gather_halo(value.transpose(1, 2), group, window - 1).transpose(1, 2)  # [B, Hkv, h+L, D]
    if padding is not None:
        padding = gather_halo(padding, group, window - 1, left_padding=first_key)  # [B, (r+1)*L]
    return key, value, padding, first_key


def attend(module, query, key, value, padding, documents, first_key, window, **kwargs):
    """The math for queries r*L .. (r+1)*L - 1 over keys from first_key: torch_impl.attention, or
    the model's own mask and attention functions for a layer marked dense.

    query: [B, H, L, D]; key/value: [B, Hkv, T, D] from global row first_key; padding (bool) and
    documents (int), when given, indexed by global key position. Returns ([B, L, H, D], weights).
    """
    plan, (B, _, L, _) = module.context_parallel, query.shape
    start = _group.rank(plan.group) * L
    if plan.dense is None:
        check_fused_kwargs(module, kwargs)
        rows = slice(first_key, start + L)  # the keys up to this rank's own: [first_key, (r+1)*L)
        out = causal_attention(
            query,
            key[:, :, : rows.stop - first_key],  # [B, Hkv, T', D]
            value[:, :, : rows.stop - first_key],  # [B, Hkv, T', D]
            start,
            first_key,
            window=window,
            scale=kwargs.get("scaling"),
            documents=None if documents is None else documents[:, rows],  # [B, T']
            padding=None if padding is None else padding[:, rows],  # [B, T']
        )  # [B, H, L, D]
        return out.transpose(1, 2).contiguous(), None
    mask_function = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    if documents is not None:
        mask_function = and_masks(mask_function, packed_sequence_mask_function(documents))
    mask = plan.make_mask(
        batch_size=B,
        q_length=L,
        kv_length=key.shape[2],
        q_offset=start,
        kv_offset=first_key,
        mask_function=mask_function,
        attention_mask=padding,
        allow_is_causal_skip=False,  # sdpa's is_causal would align the queries with keys 0 .. L-1
        dtype=query.dtype,
        device=query.device,
        config=module.config,
    )  # [B, 1, L, T]
    return plan.attend(module, query, key, value, mask, **kwargs)


def check_fused_kwargs(module, kwargs):
    """The attention arguments torch_impl.attention cannot honour (parallelize marks such layers
    dense; a model that passes them without saying so in its config is refused here)."""
    for name in ("softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"`{IMPLEMENTATION}`: {type(module).__name__} passed `{name}`, which the fused attention "
                "does not compute; torch_impl.hf.parallelize did not expect it for this model"
            )
    if kwargs.get("dropout", 0.0) > 0:
        raise ValueError(
            f"`{IMPLEMENTATION}`: {type(module).__name__} asked for attention dropout "
            f"{kwargs['dropout']}, which the fused attention does not apply"
        )


def check_call(module, attention_mask):
    """The plan `parallelize` set on the module, and the mask this implementation's mask function made."""
    if not isinstance(getattr(module, "context_parallel", None), AttentionPlan):
        raise ValueError(
            f"{type(module).__name__} uses attention `{IMPLEMENTATION}` but was not prepared by "
            "torch_impl.hf.parallelize"
        )
    if not isinstance(attention_mask, LocalMask):
        raise ValueError(
            f"`{IMPLEMENTATION}` needs the mask its mask function made (the model's own create_*_mask), "
            f"got {type(attention_mask).__name__}; custom 4-D masks cannot be split across CP ranks"
        )


def attention(module, query, key, value, attention_mask, **kwargs):
    """The registered implementation: query [B, H, L, D], key/value [B, Hkv, L, D] on rank r ->
    ([B, L, H, D], weights), equal to the single-process model's rows r*L .. (r+1)*L - 1."""
    if isinstance(attention_mask, IndexedContext):
        return indexed_attention(module, query, key, value, attention_mask, **kwargs)
    check_call(module, attention_mask)
    padding, window = attention_mask
    documents = kwargs.pop(DOCUMENTS, None)  # [B, S] for packed sequences, from ModelInputs
    key, value, padding, first_key = fetch_keys(module.context_parallel.group, key, value, padding, window)
    return attend(module, query, key, value, padding, documents, first_key, window, **kwargs)


AttentionInterface.register(IMPLEMENTATION, attention)
AttentionMaskInterface.register(IMPLEMENTATION, local_mask)


# --- DeepSeek Sparse Attention (indexed_attention layers) ----------------------------------------


class IndexedContext:
    """One forward of a DeepSeek Sparse Attention model under CP, on rank r of n (L tokens each).

    The base model's pre-hook hands it to the model as its mask (`attention_mask={"indexed_attention":
    context}`, so the model builds no [L, S] mask). The model slices it like a 4-D mask for its
    indexer (`[:, 0, :, :]` is the context itself) and passes it to the attention; `visible` states
    which keys a query sees: earlier or itself, not padding, the same document. It holds no
    activations, so checkpointed layers recompute exactly what they computed.
    """

    def __init__(self, group, local_len, padding, documents):
        self.group, self.local_len, self.start = group, local_len, _group.rank(group) * local_len
        self.padding, self.documents = padding, documents  # bool / int [B, S] by global position, or None

    def __getitem__(self, index):
        return self

    def visible(self, queries, keys):
        """bool [B or 1, nq, k]: query global rows `queries` [1, nq, 1] against key rows `keys`
        ([1, 1, T], or [B, nq, k])."""
        ok = keys <= queries
        per_token = self.padding if self.padding is not None else self.documents
        batch = None if per_token is None else torch.arange(len(per_token), device=keys.device)[:, None, None]
        if self.padding is not None:
            ok = ok & self.padding[batch, keys]
        if self.documents is not None:
            ok = ok & (self.documents[batch, keys] == self.documents[batch, queries])
        return ok

    def prefix(self, x):
        """x: [B, L, ...] on every rank -> [B, (r+1)*L, ...]: the causal prefix, global rows 0 ..
        (r+1)*L - 1, received point to point (gather_halo with a halo of every earlier row)."""
        return gather_halo(x, self.group, (_group.world_size(self.group) - 1) * self.local_len)


class _Keys:
    """A cache stand-in for one call of the model's indexer: `update_indexer` keeps the keys the
    indexer computed (this rank's rows) and answers with `keys` (scores against those)."""

    def __init__(self, keys=None):
        self.keys, self.computed = keys, None

    def update_indexer(self, k, layer_idx):
        self.computed = k  # [B, nq, Di]
        return k[:, :1] if self.keys is None else self.keys


class BlockedIndexer:
    """Mixed into the class of the model's own indexer, per instance (as FSDP2's fully_shard does),
    so that its parameters keep their names. Its forward runs the model's own indexer forward:
    once over this rank's rows to compute their indexer keys (against a single key), then, after
    the causal prefix of those keys arrives (`IndexedContext.prefix`, no autograd: the indexer is
    not trained), once per block of queries, each scoring only its block: the float32 scores
    [B, block, heads, (r+1)*L] never grow with L x S. Returns the top-k global key rows [B, L, k].
    """

    query_block = 256

    @torch.no_grad()
    def forward(
        self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None, **kwargs
    ):
        context, (B, L, _) = attention_mask, hidden_states.shape
        cos, sin = position_embeddings

        def rows(t, q0):
            return None if t is None else t[:, q0 : q0 + self.query_block]  # [., nq, ...]

        own = _Keys()
        ones = hidden_states.new_ones((B, L, 1), dtype=torch.bool)  # a mask over that single key
        super().forward(hidden_states, q_resid, position_embeddings, ones, position_ids, past_key_values=own)
        keys = _Keys(context.prefix(own.computed))  # [B, (r+1)*L, Di]
        T = context.start + L
        selected = []
        for q0 in range(0, L, self.query_block):
            queries = context.start + torch.arange(q0, min(q0 + self.query_block, L), device=cos.device)
            mask = context.visible(queries[None, :, None], torch.arange(T, device=cos.device)[None, None])
            mask = mask.expand(B, -1, -1)  # [B, nq, T]
            selected.append(
                super().forward(
                    rows(hidden_states, q0),
                    rows(q_resid, q0),
                    (rows(cos, q0), rows(sin, q0)),
                    mask,
                    rows(position_ids, q0),
                    past_key_values=keys,
                )
            )  # [B, nq, k]
        return torch.cat(selected, dim=1)


class AbsorbedMLA:
    """Mixed into the class of an indexed_attention module, per instance, like BlockedIndexer. Its
    `expand_kv` hands the MLA latents on unexpanded (k_pass [B, 1, L, r], k_rot [B, 1, L, dr]):
    the model passes them to `indexed_attention` as its key and value, and no per-head K or V of
    any token is made. The model's own expansion stays `super(AbsorbedMLA, module).expand_kv`."""

    def expand_kv(self, kv_nope, k_rot):
        return kv_nope, k_rot


_MIXED_CLASSES = {}


def _mix(module, mixin):
    """The module, its class swapped for `mixin` mixed into its own (its parameters keep their names)."""
    cls = type(module)
    if (mixin, cls) not in _MIXED_CLASSES:
        _MIXED_CLASSES[mixin, cls] = type(f"CP{cls.__name__}", (mixin, cls), {})
    module.__class__ = _MIXED_CLASSES[mixin, cls]
    return module


def indexed_attention(module, query, key, value, context, indices=None, scaling=None, **kwargs):
    """An indexed_attention layer on rank r: its queries over the keys its indexer selected.

    query: [B, H, L, dn + dr]; key, value: this rank's MLA latents k_pass [B, 1, L, r] and k_rot
    [B, 1, L, dr] (AbsorbedMLA); indices: [B, L, k] global key rows (GLM-5's shared layers: the
    previous layer's).
    1. The latents of the causal prefix (r + dr values a token) arrive point to point with
       autograd (`IndexedContext.prefix`; backward: their gradients go back to their owners).
    2. `sparse_mla_attention` in absorbed form, through the module's own `kv_b_proj` weight and
       `scaling`, over the selected keys that the query may see.
    Returns ([B, L, H, dv], None).
    """
    prefix = context.prefix(torch.cat([key, value], dim=-1)[:, 0])  # [B, (r+1)*L, r + dr]
    queries = context.start + torch.arange(query.shape[2], device=query.device)[None, :, None]  # [1, L, 1]
    valid = context.visible(queries, indices.long())  # [B, L, k]
    weight, nope_dim = module.kv_b_proj.weight, module.qk_nope_head_dim  # [H * (dn + dv), r]
    out = sparse_mla_attention(query, prefix, weight, indices, valid, nope_dim=nope_dim, scale=scaling)
    return out, None  # [B, L, H, dv]


# --- hooks on the model's own modules -------------------------------------------------------------


class Arguments:
    """A forward's arguments by name, whether passed by position or keyword, for forward pre-hooks."""

    def __init__(self, forward):
        self.names = list(inspect.signature(forward).parameters)

    def get(self, args, kwargs, name):
        i = self.names.index(name) if name in self.names else len(args)
        return args[i] if i < len(args) else kwargs.get(name)

    def replace(self, args, kwargs, **values):
        """(args, kwargs) with the named arguments set to new values, where they were passed."""
        args, kwargs = list(args), dict(kwargs)
        for name, value in values.items():
            i = self.names.index(name)
            if i < len(args):
                args[i] = value
            else:
                kwargs[name] = value
        return tuple(args), kwargs


# --- the model's inputs --------------------------------------------------------------------------


def global_positions(group, local_len, device):
    """[1, L]: the global positions r*L .. (r+1)*L - 1 of this rank's tokens."""
    first = _group.rank(group) * local_len
    return torch.arange(first, first + local_len, device=device)[None]


class ModelInputs:
    """A forward pre-hook on the base model, for what a rank cannot see in its own tokens.

    - position_ids: filled in with the global positions when absent. Given positions may restart
      (packed sequences); where transformers then isolates the documents (no attention_mask, no
      cache), the positions are gathered once per forward and their document ids, numbered as
      transformers' `find_packed_sequence_indices` numbers them over the whole sequence, reach
      every attention layer: the `cp_documents` kwarg ([B, S]; absent when nothing restarts).
    - indexed_attention models get one `IndexedContext` as their mask, with the padding mask
      gathered once per forward ([B, S]) and the documents, and no cache.
    - a KV cache that already holds tokens is refused (each rank's cache would hold its own keys).
    - with `validate` (parallelize's default), the ranks first compare their inputs in one
      all-gather of a few integers (`signature`): ranks given different shapes or arguments, or
      one whose own inputs were refused, raise ValueError on every rank instead of hanging or
      returning inconsistent shards. Skipped inside torch.compile (it reads the result on the host).
    """

    def __init__(self, module, group, indexed, validate):
        self.group, self.arguments, self.indexed = group, Arguments(module.forward), indexed
        self.validate = validate

    def __call__(self, module, args, kwargs):
        argument = partial(self.arguments.get, args, kwargs)
        tokens = argument("input_ids")
        tokens = argument("inputs_embeds") if tokens is None else tokens
        (B, L), cache, positions = tokens.shape[:2], argument("past_key_values"), argument("position_ids")
        padding, creates_cache = argument("attention_mask"), _creates_cache(module, argument)
        error = self.check(module, cache, padding)
        if self.validate and not torch.compiler.is_compiling():  # no rank left waiting
            fields = self.signature(argument, tokens, creates_cache)
            failed, differ = validation.compare_ranks(error is None, fields, tokens, self.group)
            if error is None and failed:
                error = f"`{IMPLEMENTATION}`: CP ranks {failed} rejected their inputs"
            elif error is None and differ:
                error = (
                    f"`{IMPLEMENTATION}`: CP ranks were given different inputs (1: passed, 0: not): "
                    f"{differ}; every rank must get its shard of the same global batch "
                    "(torch_impl.hf.shard_batch)"
                )
        if error:
            raise ValueError(error)
        documents = None
        if positions is not None and padding is None and cache is None and not creates_cache:
            everywhere = gather_metadata(positions.expand(B, -1).contiguous(), self.group)  # [B, S]
            documents = find_packed_sequence_indices(everywhere)  # [B, S], or None: no position restarts
        positions = global_positions(self.group, L, tokens.device) if positions is None else positions
        if self.indexed:
            padding = None if padding is None else gather_metadata(padding.bool(), self.group)  # [B, S]
            context = IndexedContext(self.group, L, padding, documents)
            return self.arguments.replace(
                args,
                kwargs,
                attention_mask={INDEXED: context},
                past_key_values=None,
                position_ids=positions,
                use_cache=False,
            )
        args, kwargs = self.arguments.replace(args, kwargs, position_ids=positions)
        return args, kwargs if documents is None else kwargs | {DOCUMENTS: documents}

    @staticmethod
    def signature(argument, tokens, creates_cache):
        """What must be the same on every CP rank: the shard's shape, which inputs were passed, and
        whether the model makes a cache (which decides whether packed positions are gathered)."""
        embeds = argument("input_ids") is None
        return {
            "batch": tokens.shape[0],
            "local tokens": tokens.shape[1],
            "inputs_embeds": int(embeds),
            "embedding width": tokens.shape[-1] if embeds else 0,
            "attention_mask": int(argument("attention_mask") is not None),
            "position_ids": int(argument("position_ids") is not None),
            "past_key_values": int(argument("past_key_values") is not None),
            "use_cache": int(creates_cache),
        }

    @staticmethod
    def check(module, cache, mask):
        """What is wrong with this rank's inputs, or None."""
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.ndim != 2):
            return (
                f"`{IMPLEMENTATION}`: `attention_mask` must be the 2-D padding mask [B, L]; custom 4-D masks "
                "(or prepared mask dicts) cannot be split across CP ranks"
            )
        if cache is not None and cache.get_seq_length() > 0:
            return (
                f"`{IMPLEMENTATION}`: {type(module).__name__} was called with a KV cache holding tokens; "
                "generation with a cache is not supported under CP"
            )
        return None


def _creates_cache(module, argument):
    """Whether the model will make itself a KV cache in this call, as transformers decides (its
    `merge_with_config_defaults`: use_cache, else the config's, off while checkpointing in training);
    with one it does not look for packed sequences."""
    use_cache = argument("use_cache")
    use_cache = getattr(module.config, "use_cache", False) if use_cache is None else use_cache
    return bool(use_cache) and not (getattr(module, "gradient_checkpointing", False) and module.training)


# --- short convolutions ---------------------------------------------------------------------------


class ShortConvHalo:
    """Forward hooks giving a causal depthwise short convolution (kernel K) its K-1 preceding tokens.

    Before: hidden_states [B, L, D] -> [B, h+L, D] and its 2-D padding mask -> [B, h+L] (all True
    where the model passed none: whether a mask is passed depends on this rank's tokens, the
    exchange must not), h = min(r*L, K-1). After: the output's first h positions are dropped.
    """

    def __init__(self, module, group):
        self.group, self.halo_size = group, module.conv.kernel_size[0] - 1
        self.arguments, self.received = Arguments(module.forward), 0

    def before(self, module, args, kwargs):
        x = self.arguments.get(args, kwargs, "hidden_states")  # [B, L, D]
        mask = self.arguments.get(args, kwargs, "attention_mask")  # [B, L] or None
        mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if mask is None else mask.bool()
        self.received = min(_group.rank(self.group) * x.shape[1], self.halo_size)
        return self.arguments.replace(
            args,
            kwargs,
            hidden_states=gather_halo(x, self.group, self.halo_size),  # [B, h+L, D]
            attention_mask=gather_halo(mask, self.group, self.halo_size),  # [B, h+L]
        )

    def after(self, module, args, kwargs, output):
        return output[:, self.received :]  # [B, L, D]


# --- parallelize ----------------------------------------------------------------------------------


def _refuse(name, module, why):
    return ValueError(f"torch_impl.hf.parallelize: {name or 'the model'} ({type(module).__name__}) {why}")


def _check_configs(model):
    """Model-wide refusals, from the model's config and its sub-models' (a catch-all after the walk)."""
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if not isinstance(config, PreTrainedConfig):
            continue
        if getattr(config, "is_encoder_decoder", False):
            raise _refuse(name, module, "is an encoder-decoder model: cross attention is not supported")
        if getattr(config, "attention_chunk_size", None):
            raise _refuse(name, module, "uses chunked attention, which is not supported")
        layer_types = set(getattr(config, "layer_types", None) or ())
        unsupported = sorted(layer_types - set(SUPPORTED_LAYER_TYPES))
        if unsupported:
            raise _refuse(
                name, module, f"has layers of types {unsupported}; supported: {SUPPORTED_LAYER_TYPES}"
            )
        if INDEXED in layer_types and layer_types != {INDEXED}:
            raise _refuse(name, module, f"mixes {INDEXED!r} layers with {sorted(layer_types - {INDEXED})}")


def _layer_type(module):
    """The config's type for a module that knows its layer index (e.g. 'sliding_attention'), else None."""
    types, index = (
        getattr(getattr(module, "config", None), "layer_types", None),
        getattr(module, "layer_idx", None),
    )
    return types[index] if types and isinstance(index, int) and 0 <= index < len(types) else None


def _kind(name, module):
    """'attention', 'short_conv', or None for a module that mixes no tokens itself; ValueError for a
    module that mixes them in a way CP cannot reproduce exactly."""
    layer_type = _layer_type(module)
    if layer_type is not None and layer_type not in SUPPORTED_LAYER_TYPES:
        raise _refuse(name, module, f"is a {layer_type!r} layer; supported: {SUPPORTED_LAYER_TYPES}")
    if hasattr(module, "is_causal") and hasattr(module, "config"):  # transformers' attention modules
        if not module.is_causal or getattr(module, "is_cross_attention", False):
            raise _refuse(
                name, module, "is bidirectional or cross attention; only causal attention is supported"
            )
        return "attention"
    if type(module).__name__ in SHORT_CONVS:
        return "short_conv"
    if RECURRENT.search(type(module).__name__):
        raise _refuse(
            name, module, "carries recurrent state along the sequence, which CP cannot split exactly"
        )
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        raise _refuse(name, module, "is a convolution over the sequence that the adapter does not know")
    return None


def _dense_reason(module):
    """Why a layer's math must stay the model's own on a dense mask, or None (torch_impl.attention)."""
    config = module.config
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping"
    if isinstance(getattr(module, "sinks", None), torch.Tensor):
        return "attention sinks"
    if getattr(config, "attention_dropout", 0.0) > 0:
        return "attention dropout"
    return None


def _check_indexed(name, module):
    """An indexed_attention layer is DeepSeek V3.2's / GLM-5's: MLA latents expanded by `expand_kv`
    through a `kv_b_proj` without bias (absorbed exactly), an indexer (or, GLM-5's shared layers,
    the previous layer's indices) with the forward the adapter calls, no attention dropout."""
    if not callable(getattr(module, "expand_kv", None)) or not hasattr(module, "indexer"):
        raise _refuse(name, module, f"is an {INDEXED!r} layer without MLA's expand_kv and an indexer")
    projection = getattr(module, "kv_b_proj", None)
    nope_dim = getattr(module, "qk_nope_head_dim", None)
    if not isinstance(projection, nn.Linear) or projection.bias is not None or nope_dim is None:
        raise _refuse(
            name,
            module,
            f"is an {INDEXED!r} layer whose latents are not expanded by a `kv_b_proj` Linear without bias "
            "(with `qk_nope_head_dim`): the absorbed attention could not reproduce it",
        )
    if module.indexer is not None:
        names = list(inspect.signature(module.indexer.forward).parameters)[:6]
        expected = ["hidden_states", "q_resid", "position_embeddings", "attention_mask", "position_ids"]
        if names[:5] != expected or "past_key_values" not in names:
            raise _refuse(name, module, f"has an indexer whose forward takes {names}, not {expected}")
    if getattr(module.config, "attention_dropout", 0.0) > 0:
        raise _refuse(name, module, f"is an {INDEXED!r} layer with attention dropout, which is not supported")


def _attention_plan(name, module, group):
    if _layer_type(module) == INDEXED:
        _check_indexed(name, module)
    implementation = module.config._attn_implementation
    if implementation == "sdpa":
        attend = ALL_ATTENTION_FUNCTIONS["sdpa"]
    elif implementation == "eager":
        attend = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if attend is None:
            raise _refuse(name, module, "uses eager attention but its module has no eager_attention_forward")
    else:
        raise _refuse(
            name,
            module,
            f"uses attention {implementation!r}; only 'sdpa' and 'eager' take the global query and key "
            "offsets of a CP rank (flash kernels align causal masks bottom-right)",
        )
    dense = None if _layer_type(module) == INDEXED else _dense_reason(module)
    return AttentionPlan(group, attend, ALL_MASK_ATTENTION_FUNCTIONS[implementation], dense)


def _plan(model, group):
    """(attention modules with their plans, short convs): every token-mixing module, or ValueError."""
    if not type(model)._can_set_attn_implementation():
        raise _refuse("", model, "does not route its attention through transformers' AttentionInterface")
    attentions, convs = [], {}
    for name, module in model.named_modules():
        if any(name.startswith(f"{conv}.") for conv in convs):
            continue  # inside a short conv, which is handled whole
        kind = _kind(name, module)
        if kind == "attention":
            attentions.append((module, _attention_plan(name, module, group)))
        elif kind == "short_conv":
            convs[name] = module
    _check_configs(model)
    return attentions, list(convs.values())


def apply_attention(model, attentions):
    """Every attention module gets its plan; the model switches to the registered implementation.
    Returns which math each layer kind takes."""
    paths = {}
    for module, plan in attentions:
        module.context_parallel = plan
        kind = _layer_type(module) or type(module).__name__
        paths[kind] = "torch_impl.attention" if plan.dense is None else f"dense [L, T] mask ({plan.dense})"
        if kind == INDEXED:
            paths[kind] = "blocked indexer, absorbed sparse attention over the causal prefix's latents"
            _mix(module, AbsorbedMLA)
            if module.indexer is not None:
                _mix(module.indexer, BlockedIndexer)
    model.set_attn_implementation(IMPLEMENTATION)
    return paths


def apply_inputs(model, group, validate):
    """The base model's inputs: global positions, documents, indexed_attention's context, the
    refusal of a filled KV cache and (validate) the cross-rank check."""
    base = model.base_model
    indexed = INDEXED in (getattr(base.config, "layer_types", None) or ())
    base.register_forward_pre_hook(ModelInputs(base, group, indexed, validate), with_kwargs=True)


def apply_short_conv(convs, group):
    """Every short convolution gets the hooks that fetch its K-1 preceding tokens. Returns which
    path they take."""
    for module in convs:
        halo = ShortConvHalo(module, group)
        module.register_forward_pre_hook(halo.before, with_kwargs=True)
        module.register_forward_hook(halo.after, with_kwargs=True)
    return {type(module).__name__: "its own forward over a halo of kernel - 1 tokens" for module in convs}


def parallelize(model, group, *, validate=True, verbose=True):
    """Make a transformers causal LM context-parallel over `group`, in place; returns the model.

    Every check runs before anything changes and before any communication, identically on every
    rank: a layer that cannot be made exact raises `ValueError` naming it and why. Without CP
    (`group` None or of size 1) the model is returned untouched.

    validate: at every forward, before any other communication, the CP ranks compare their inputs
        (the shard's shape, which arguments were passed) in one all-gather of a few integers, and
        raise `ValueError` on every rank where they differ or some rank's were refused. False
        skips that collective (it is skipped inside torch.compile either way).
    verbose: print on global rank 0 one line saying which path each layer kind takes. Either way it is
        logged (`torch_impl.hf`, INFO) and kept as `model.cp_transport_paths` ({layer kind: path}).
    """
    group = _group.resolve_group(group)
    if _group.world_size(group) == 1:
        return model
    if model.config._attn_implementation == IMPLEMENTATION:
        raise _refuse("", model, "is already context-parallel")
    attentions, convs = _plan(model, group)
    apply_inputs(model, group, validate)
    paths = apply_attention(model, attentions) | apply_short_conv(convs, group)
    model.cp_transport_paths = paths
    summary = (
        f"torch_impl.hf.parallelize: {type(model).__name__} over {_group.world_size(group)} CP ranks; "
        + "; ".join(f"{kind}: {path}" for kind, path in paths.items())
        + f"; inputs checked across ranks: {'yes' if validate else 'no'}"
    )
    log.info(summary)
    if verbose and dist.get_rank() == 0:
        print(summary, flush=True)
    return model


def _save_collectives(ctx, op, *args, **kwargs):
    if op.namespace == "_c10d_functional":
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_kwargs():
    """Activation checkpointing that keeps the outputs of the transport's collectives instead of
    recomputing them: `model.activation_checkpointing_enable(activation_checkpointing_kwargs=
    hf.checkpoint_kwargs())` (older transformers: `gradient_checkpointing_enable`). Required with
    torch.compile: recomputed inside a compiled backward, a collective whose output a rank does not
    need (rank 0's empty halo) is dropped by the compiler on that rank only, and its peers wait
    forever. (Eager recomputation runs every collective on every rank again, in order.)"""
    return {
        "use_reentrant": False,
        "context_fn": partial(create_selective_checkpoint_contexts, _save_collectives),
    }


def shard_batch(batch, group):
    """This rank's model kwargs from a global batch of [B, S] tensors; the same keys for every n.

    batch: `input_ids`, optionally `attention_mask` (1: token, 0: padding), `labels` (-100:
    ignored) and `position_ids` (e.g. restarting at every document of a packed row), as the model
    takes them without CP. Returns the [B, L] shards, `use_cache=False`, and for labels:
    `shift_labels`, shifted over the *global* sequence (the last token of shard r predicts the first
    of shard r+1), and `num_items_in_batch`, the global count of valid shifted labels, so that the
    ranks' losses add up to the single-process mean. With data parallelism too, wrap the model
    with `apply_fsdp` or `apply_ddp` (gradients summed over CP, averaged over DP); or set
    `num_items_in_batch` to the count over all DP batches and pass them `global_num_items=True`.
    Without CP (n = 1) the same keys, with the whole sequence.
    """
    group = _group.resolve_group(group)
    unknown = sorted(set(batch) - set(BATCH_KEYS))
    if unknown or "input_ids" not in batch:
        raise ValueError(
            f"`batch` must hold input_ids and optionally {BATCH_KEYS[1:]}, got keys {sorted(batch)}"
        )
    n, r = _group.world_size(group), _group.rank(group)
    B, S = batch["input_ids"].shape
    for key, value in batch.items():
        if tuple(value.shape) != (B, S):
            raise ValueError(
                f"`batch[{key!r}]` must be [B, S] = {(B, S)} like input_ids, got {tuple(value.shape)}"
            )
    if S % n:
        raise ValueError(f"the sequence length S={S} must be divisible by the CP size n={n}")
    L = S // n
    shard = slice(r * L, (r + 1) * L)
    local = {key: value[:, shard].contiguous() for key, value in batch.items()}  # [B, L] each
    local["use_cache"] = False
    if "labels" in batch:
        shifted = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)  # [B, S]: target of token t
        local["shift_labels"] = shifted[:, shard].contiguous()  # [B, L]
        local["num_items_in_batch"] = (shifted != IGNORE_INDEX).sum()
    return local
