"""Indexed attention layers (`indexed_attention`) under CP: DeepSeek Sparse Attention (DeepSeek
V3.2, GLM-5) and Qwen4's QSA.

The causal prefix's indexer keys and MLA latents arrive point to point (`IndexedContext.prefix`);
the model's own indexer scores them one query block at a time (`BlockedIndexer`), and the attention
runs in absorbed form over the latents each query picked (`AbsorbedMLA`, `indexed_attention`).
Qwen4's QSA (no MLA): its indexer pools the keys a query sees into blocks and picks the top-k
blocks; the model's own indexer runs per local chunk over the prefix's indexer keys
(`QSAIndexer`), and the layer attends over the prefix's keys on that selection (`qsa_attention`).
"""

from typing import NamedTuple

import torch

from torch_impl.attention import sparse_mla_attention
from torch_impl.halo import gather_halo
from torch_impl.hf._common import attend_visible, stepping_aside
from torch_impl.sequence import gather_sequence


class IndexedContext:
    """One forward of an indexed_attention model under CP, on rank r of n (L tokens each).

    The base model's pre-hook hands it to the model as its mask (`attention_mask={"indexed_attention":
    context}`, so the model builds no [L, S] mask). DeepSeek Sparse Attention slices it like a 4-D
    mask for its indexer (`[:, 0, :, :]` is the context itself) and passes it to the attention;
    Qwen4's QSA ands its indexer's Selection into it (`dtype`, `__and__`: the Selection is what the
    attention gets). `visible` states which keys a query sees: earlier or itself, not padding, the
    same document. It holds no activations, so checkpointed layers recompute exactly what they
    computed.
    """

    def __init__(self, context):
        self.shard, self.group, documents = context.shard, context.group, context.documents
        self.local_len, self.layout = self.shard.local_len, self.shard.layout
        self.rows = self.shard.rows()  # int64 [L]: the queries' global rows
        self.padding = context.padding  # bool [B, S] by global position, or None
        self.documents = None if documents is None else documents.ids  # int [B, S], or None
        self.reach = None if documents is None else documents.reach  # per global chunk, or None
        self._trimmed = self._keys()

    @property
    def trimmed(self):
        """Whether `prefix` fetches only the documents' reach (not inside torch.compile, where
        each batch's reach would make a graph of its own)."""
        return self.reach is not None and not torch.compiler.is_compiling()

    @property
    def key_rows(self):
        """int64 [T]: the global rows of the keys `prefix` returns, ascending."""
        return self._trimmed[0] if self.trimmed else torch.arange(self.shard.end)

    def _keys(self):
        """(int64 [T]: the global rows of the keys `prefix` returns, ascending; the positions of
        gather_halo's output that hold them, or None for all): the causal prefix [0, end), or with
        packed documents the union of the chunks' windows back to their documents' starts."""
        if self.reach is None:
            return torch.arange(self.shard.end), None
        position = {}  # global row -> its first position in gather_halo's output
        for w in self.shard.windows(self.reach):
            for i, row in enumerate(range(w.first_key, w.end)):
                position.setdefault(row, w.segment.start + i)
        rows = sorted(position)
        keep = [position[row] for row in rows]
        return torch.tensor(rows), None if keep == list(range(len(keep))) else torch.tensor(keep)

    dtype = torch.bool  # Qwen4's attention reads its mask's dtype, then ands its selection into it

    def __getitem__(self, index):
        return self

    def __and__(self, selection):
        """Qwen4's `attention_mask & selected_token_mask`: QSAIndexer's Selection, which already
        holds only keys the query sees."""
        if not isinstance(selection, Selection):
            raise TypeError(f"an IndexedContext combines with a Selection, not {type(selection).__name__}")
        return selection

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
        """x: [B, L, ...] on every rank -> [B, T, ...]: the keys this rank's queries may see, at the
        global rows `key_rows`. Contiguous: the causal prefix 0 .. (r+1)*L - 1 received point to
        point (gather_halo with a halo of every earlier row); head_tail: the sequence gathered (its
        tail's prefix is most of it), cut at end; packed documents: gather_halo of each chunk's
        reach back to its document's start (head_tail: the two windows' union)."""
        if self.trimmed:
            keep = self._trimmed[1]
            halo = gather_halo(x, self.group, self.reach, layout=self.layout)  # per chunk: window, chunk
            return halo if keep is None else halo[:, keep.to(x.device)]
        if self.layout == "contiguous":
            return gather_halo(x, self.group, (self.shard.n - 1) * self.local_len)
        return gather_sequence(x, self.group, layout=self.layout)[:, : self.shard.end]  # a tail needs it all

    def positions(self, indices):
        """Global key rows (in key_rows) -> their positions in `prefix`'s output."""
        rows = self.key_rows.to(indices.device)
        return torch.searchsorted(rows, indices).clamp_max(len(rows) - 1)  # [B, L, k]


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
        if stepping_aside():  # an unsharded call: the model's own indexer
            return super().forward(
                hidden_states, q_resid, position_embeddings, attention_mask, position_ids, **kwargs
            )
        context, (B, L, _) = attention_mask, hidden_states.shape
        cos, sin = position_embeddings

        def rows(t, q0):
            return None if t is None else t[:, q0 : q0 + self.query_block]  # [., nq, ...]

        own = _Keys()
        ones = hidden_states.new_ones((B, L, 1), dtype=torch.bool)  # a mask over that single key
        super().forward(hidden_states, q_resid, position_embeddings, ones, position_ids, past_key_values=own)
        keys = _Keys(context.prefix(own.computed))  # [B, T, Di]
        key_rows, query_rows = context.key_rows.to(cos.device), context.rows.to(cos.device)
        selected = []
        for q0 in range(0, L, self.query_block):
            queries = query_rows[q0 : q0 + self.query_block]
            mask = context.visible(queries[None, :, None], key_rows[None, None])
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
            )  # [B, nq, k]: positions among the T keys
        return key_rows.to(selected[0].dtype)[torch.cat(selected, dim=1).long()]  # [B, L, k]: global rows


class AbsorbedMLA:
    """Mixed into the class of an indexed_attention module, per instance, like BlockedIndexer. Its
    `expand_kv` hands the MLA latents on unexpanded (k_pass [B, 1, L, r], k_rot [B, 1, L, dr]):
    the model passes them to `indexed_attention` as its key and value, and no per-head K or V of
    any token is made. The model's own expansion stays `super(AbsorbedMLA, module).expand_kv`."""

    def expand_kv(self, kv_nope, k_rot):
        if stepping_aside():  # an unsharded call: the model's own expansion
            return super().expand_kv(kv_nope, k_rot)
        return kv_nope, k_rot


def indexed_attention(module, query, key, value, context, indices=None, scaling=None, s_aux=None, **kwargs):
    """An indexed_attention layer on rank r: its queries over the keys its indexer selected.

    query: [B, H, L, dn + dr]; key, value: this rank's MLA latents k_pass [B, 1, L, r] and k_rot
    [B, 1, L, dr] (AbsorbedMLA); indices: [B, L, k] global key rows (GLM-5's shared layers: the
    previous layer's); s_aux: per-head sinks [H] (HY-V4's), or None.
    1. The latents of the causal prefix (r + dr values a token) arrive point to point with
       autograd (`IndexedContext.prefix`; backward: their gradients go back to their owners).
    2. `sparse_mla_attention` in absorbed form, through the module's own `kv_b_proj` weight and
       `scaling`, over the selected keys that the query may see.
    Returns ([B, L, H, dv], None).
    """
    prefix = context.prefix(torch.cat([key, value], dim=-1)[:, 0])  # [B, T, r + dr] at key_rows
    queries = context.rows.to(query.device)[None, :, None]  # [1, L, 1]: global rows
    valid = context.visible(queries, indices.long())  # [B, L, k]
    weight, nope_dim = module.kv_b_proj.weight, module.qk_nope_head_dim  # [H * (dn + dv), r]
    picks = context.positions(indices.long())  # [B, L, k]: rows of prefix
    out = sparse_mla_attention(
        query, prefix, weight, picks, valid, nope_dim=nope_dim, scale=scaling, sinks=s_aux
    )
    return out, None  # [B, L, H, dv]


class Selection(NamedTuple):
    """What QSAIndexer returns for this rank's queries: the forward's IndexedContext and, per
    query, the keys it attends over (bool [B, 1, L, T] against `context.key_rows`)."""

    context: IndexedContext
    mask: torch.Tensor


class QSAIndexer:
    """Mixed into the class of Qwen4's QSA indexer, per instance, like BlockedIndexer. Its forward
    runs the model's own indexer: once over this rank's rows to compute their indexer keys
    (against a single key: its per-query loop then pools nothing, a small cost beside the second
    run, and the keys come from the model's own code), then, after the prefix of those keys and of
    the rotary tables arrives (`IndexedContext.prefix`, no autograd: the selection is not
    differentiated), once per local chunk over the keys before the chunk's end, with the mask of
    the keys each query sees: the indexer pools those keys into blocks in the same order as one
    process and picks the same ones. Returns the Selection (its queries' picks among the prefix's
    keys)."""

    @torch.no_grad()
    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None):
        if stepping_aside():  # an unsharded call: the model's own indexer
            return super().forward(hidden_states, position_embeddings, attention_mask, past_key_values)
        context, (B, L, _) = attention_mask, hidden_states.shape
        own = _Keys()
        ones = hidden_states.new_ones((B, 1, L, 1), dtype=torch.bool)  # a mask over that single key
        super().forward(hidden_states, position_embeddings, ones, own)
        keys = context.prefix(own.computed)  # [B, T, Di]
        tables = [context.prefix(t.expand(B, -1, -1).contiguous()) for t in position_embeddings]  # [B, T, d]
        key_rows, query_rows = context.key_rows.to(keys.device), context.rows.to(keys.device)
        picks = keys.new_zeros((B, 1, L, len(key_rows)), dtype=torch.bool)  # [B, 1, L, T]
        for w in context.shard.windows(None):
            cut = int(torch.searchsorted(key_rows, w.end))  # the keys before the chunk's end: its own last
            queries = query_rows[w.queries]  # [C]
            seen = context.visible(queries[None, :, None], key_rows[None, None, :cut]).expand(B, -1, -1)
            picks[:, :, w.queries, :cut] = super().forward(
                hidden_states[:, w.queries],
                tuple(t[:, :cut] for t in tables),
                seen[:, None],  # [B, 1, C, cut]
                _Keys(keys[:, :cut]),
            )  # [B, 1, C, cut]
        return Selection(context, picks)


def qsa_attention(module, query, key, value, selection, **kwargs):
    """A QSA layer on rank r: query [B, H, L, D] over the keys its indexer selected. key, value
    [B, Hkv, L, D] arrive for the prefix with autograd (`IndexedContext.prefix`: their gradients
    go back to their owners), then the model's own attention function on the selection as its
    mask ([B, 1, L, T], in the form its mask function makes). Returns ([B, L, H, D], weights)."""
    context, picked = selection.context, selection.mask[:, 0]  # [B, L, T]
    D = key.shape[-1]
    both = context.prefix(torch.cat([key, value], dim=-1).transpose(1, 2))  # [B, T, Hkv, D + Dv]
    key, value = (t.transpose(1, 2) for t in both.split([D, both.shape[-1] - D], dim=-1))  # [B, Hkv, T, .]
    assert picked.shape[-1] == key.shape[2], (picked.shape, key.shape)  # the indexer's keys: the attention's
    return attend_visible(module, query, key, value, picked, kwargs)
