"""MiniMax-M3's block-sparse attention layers (`minimax_m3_sparse`) under CP.

Its indexer scores each query against every key (one shared index key a token, rotated at its
row), max-pools the scores over blocks of `block_size` key slots counted from row 0, always keeps
the query's own `local_blocks` blocks and picks the top `topk_blocks`; `build_block_mask` turns the
picks into a per-head mask [B, H, L, S]. Under CP the model's own indexer runs twice: once over
this rank's rows for their index keys, then, after every rank's keys arrive (gather_sequence, no
autograd: the picks are not differentiated in one process either), once per local chunk over the
keys before the chunk's end, which hold every block its queries may pick, at the same slots as
one process. `block_sparse_attention` gathers K and V with autograd and runs the model's own
attention function on the model's own block mask, joined with the chunk's causal and padding
rule. Rows whose picks would read what a query that sees no key holds are refused
(`check_rows`): padding before a real token, packed rows.
"""

import inspect

import torch
import torch.nn.functional as F

from torch_impl.hf._common import RUNNING, fetch_kv, stepping_aside
from torch_impl.sequence import gather_sequence

BLOCK_SPARSE = "minimax_m3_sparse"


def is_block_sparse(module):
    """MiniMax-M3's sparse layer: an indexer with the forward `BlockIndexer` calls, its block
    size, top-k and local blocks, and `build_block_mask`."""
    indexer = getattr(module, "indexer", None)
    if indexer is None or not callable(getattr(indexer, "build_block_mask", None)):
        return False
    names = list(inspect.signature(indexer.forward).parameters)
    wanted = ["hidden_states", "position_embeddings", "past_key_values", "position_ids"]
    return names == wanted and all(hasattr(indexer, a) for a in ("block_size", "topk_blocks", "local_blocks"))


def check_rows(context):
    """ValueError (on every rank alike: from the forward's gathered rows) for rows whose picks
    depend on what each implementation makes of a query that sees no key. The indexer pools every
    key slot before the query, padding included (the model's own TODO): with padding before a
    real token its picks read the padding rows' states (eager and sdpa differ there in one
    process, and CP gives zeros); in packed rows (position_ids restarting) its slots from row 0
    land in earlier documents, where most queries see no key."""
    why = None
    if context.documents is not None:
        why = "packed rows: its blocks are key slots from row 0, compared with restarting position_ids"
    elif context.padding is not None and bool((~context.padding[:, :-1] & context.padding[:, 1:]).any()):
        why = "padding before a real token: the indexer pools the padding's keys into its blocks"
    if why is not None:
        raise ValueError(
            f"torch_impl.hf: MiniMax-M3's sparse layers cannot take {why}, so its picks depend on "
            "what the padding rows or the queries that see no key hold, which each implementation "
            "fills in its own way; pass right-padded or unpadded rows"
        )


class _IndexKeys:
    """A cache stand-in for one call of the indexer: `update_index` keeps the index keys it
    computed (this rank's rows) and answers with `keys` [B, 1, T, D] (one key where None)."""

    def __init__(self, layer_idx, keys=None):
        self.layers = {layer_idx: self}
        self.keys, self.computed = keys, None

    def update_index(self, k):
        self.computed = k  # [B, 1, nq, D]
        return k[:, :, :1] if self.keys is None else self.keys


class BlockIndexer:
    """Mixed into the class of MiniMax-M3's indexer, per instance, as FSDP2's fully_shard does.
    Returns this rank's queries' picks [B, H_idx, L, topk] (global block ids, -1 for none), from a
    run per local chunk over the keys before its end."""

    @torch.no_grad()
    def forward(self, hidden_states, position_embeddings, past_key_values, position_ids):
        if stepping_aside():  # an unsharded call: the model's own indexer
            return super().forward(hidden_states, position_embeddings, past_key_values, position_ids)
        if past_key_values is not None:
            raise ValueError("torch_impl.hf: MiniMax-M3's sparse layers take no KV cache under CP")
        context = RUNNING.context
        check_rows(context)
        own = _IndexKeys(self.layer_idx)
        # its own keys, against one key: positions 0 keep its local blocks in that one block's range
        super().forward(hidden_states, position_embeddings, own, torch.zeros_like(position_ids))
        keys = gather_sequence(own.computed[:, 0], context.group, layout=context.shard.layout)  # [B, S, D]
        cos, sin = position_embeddings
        picks = []
        for w in context.shard.windows(None):
            rows = w.queries
            picked = super().forward(
                hidden_states[:, rows],
                (cos[:, rows], sin[:, rows]),
                _IndexKeys(self.layer_idx, keys[:, None, : w.end]),
                position_ids[:, rows],
            )  # [B, H_idx, C, k'], k' = min(topk, blocks before the chunk's end)
            picks.append(F.pad(picked, (0, self.topk_blocks - picked.shape[-1]), value=-1))
        return torch.cat(picks, dim=2)  # [B, H_idx, L, topk]


def block_sparse_attention(module, query, key, value, mask, block_indices, **kwargs):
    """A MiniMax-M3 sparse layer on rank r: query [B, H, L, D] over the keys its indexer's blocks
    hold. K and V of the whole sequence arrive with autograd (the full layers' fetch; backward:
    their gradients go back to their owners); per local chunk, the model's own `build_block_mask`
    over the chunk's keys [0, end) joined with the chunk's causal and padding rule, then the
    model's own attention function. Returns ([B, L, H, D], None)."""
    assert mask.reach is None, mask.reach  # block ids count key slots from row 0 (no packed rows)
    setup, position_ids, B = module.context_parallel, kwargs.get("position_ids"), query.shape[0]
    key, value = fetch_kv(mask.context, key, value, mask.reach)  # [B, Hkv, S, D]
    outs = []
    for keys in mask.chunks:
        w, rows = keys.chunk, keys.chunk.queries
        q = torch.arange(w.start, w.end, device=query.device)[:, None]
        k = torch.arange(w.first_key, w.end, device=query.device)[None]
        seen = (k <= q)[None]  # [1, C, T]
        if keys.padding is not None:
            seen = seen & keys.padding[:, None, :]
        dense = module.indexer.build_block_mask(
            block_indices[:, :, rows],  # [B, H_idx, C, topk]
            seen.expand(B, -1, -1)[:, None],  # [B, 1, C, T] bool
            k.shape[-1],
            query.dtype,
            query.device,
            None if position_ids is None else position_ids[:, rows],  # (read only without a mask)
        )  # [B, H, C, T] additive
        kv = key[:, :, keys.rows], value[:, :, keys.rows]  # [B, Hkv, T, D] each
        out, _ = setup.attend(module, query[:, :, rows], *kv, dense, **kwargs)
        outs.append(out)  # [B, C, H, D]
    return torch.cat(outs, dim=1), None


def own_block_mask(module, query, key, attention_mask, block_indices, position_ids=None, **kwargs):
    """An unsharded call's mask for a sparse layer: the one the model makes itself with eager and
    sdpa attention (not with another implementation, such as this adapter's), from the picks.
    kwargs: the attention call's others."""
    if position_ids is None:  # the model's own default
        position_ids = torch.arange(key.shape[2] - query.shape[2], key.shape[2], device=query.device)
    position_ids = (position_ids if position_ids.ndim > 1 else position_ids[None]).expand(query.shape[0], -1)
    return module.indexer.build_block_mask(
        block_indices, attention_mask, key.shape[2], query.dtype, query.device, position_ids
    )
