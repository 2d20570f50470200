"""DeepSeek V4's compressed attention layers under CP: CSA (`compressed_sparse_attention`: windows of
m tokens, each with the one before it, pooled by a softmax gate into one KV entry; an indexer picks
each query's top-k entries) and HCA (`heavily_compressed_attention`: windows of m' tokens pooled
alone), beside the layer's sliding window over the tokens themselves.

The compressed entries move instead of the tokens. A window belongs to the rank holding its last
token: each rank runs the model's own compressor (and CSA's indexer's) over its chunks' windows,
with the hidden states before a chunk that its first windows read (gather_halo: fewer than m, CSA
fewer than 2m; with chunks a multiple of m, none and m), then
the entries of every rank are gathered (gather_sequence, about 1/m of the tokens; backward: their
gradients go back to the rank that made them). The model's own compressor then runs once more for
this rank's queries over the gathered entries: their causal threshold and the indexer's top-k over
every entry a query may see, as in one process. `compressed_attention` attends over the sliding
window's keys (fetched as for a sliding layer) and the entries, on the model's own attention
function with its sinks.
"""

import inspect

import torch
import torch.nn.functional as F

from torch_impl.halo import gather_halo
from torch_impl.hf._common import (
    RUNNING,
    attend_visible,
    fetch_kv,
    query_blocks,
    stepping_aside,
    window_rule,
)
from torch_impl.sequence import gather_sequence

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
COMPRESSED = (CSA, HCA)


class _Windows:
    """A cache stand-in for one call of a compressor and its indexer (DeepSeek V4's cache layer's
    three methods). Making (`entries` None): the call's hidden states start at a window's start,
    `skip` whole windows that another rank owns (CSA's previous window, read for its overlap) and
    end at the chunk's end; what the model compresses is kept in `made` and the model sees no
    entries (its scores and mask of this call are not used). Serving: nothing is compressed and
    the model gets the gathered entries of every rank (`entries`: name -> [B, T, d])."""

    def __init__(self, layer_idx, rate, first=0, skip=0, entries=None):
        self.layers = {layer_idx: self}
        self.rate, self.first, self.skip, self.entries, self.made = rate, first, skip, entries, {}

    def store_compression_weights(self, name, kv, gate):
        usable = 0 if self.entries is not None else kv.shape[1] // self.rate * self.rate
        return kv[:, :usable], gate[:, :usable], self.first

    def update_overlap_state(self, name, chunk_kv, chunk_gate, head_dim):
        return None, None  # CSA's previous window is in the call itself

    def update_compressor_states(self, name, compressed):
        if self.entries is not None:
            return self.entries[name]
        self.made[name] = compressed[:, self.skip :]  # [B, windows, d]
        return compressed[:, :0]


class CompressedEntries:
    """Mixed into the class of a DeepSeek V4 compressor (CSA's or HCA's), per instance, as FSDP2's
    fully_shard does, so that its parameters keep their names. Its forward returns every
    compressed entry of the whole sequence [B, 1, T, D] as the model's does, and keeps which of
    them this rank's queries see as `visible` (bool [B, L, T], or None without entries) for
    `compressed_attention`; the model's own mask over them (a float [B, 1, L, T], which the model
    drops when its mask is not a tensor) is not made. The model's compressor runs for `query_block`
    queries at a time: its indexer scores [B, block, heads, T] of them at once."""

    query_block = 256
    visible = None

    def forward(self, hidden_states, q_residual, position_ids, past_key_values, layer_idx):
        if stepping_aside():  # an unsharded call: the model's own compressor
            return super().forward(hidden_states, q_residual, position_ids, past_key_values, layer_idx)
        if past_key_values is not None:
            raise ValueError("torch_impl.hf: DeepSeek V4's compressed layers take no KV cache under CP")
        entries = self.gather_entries(hidden_states, layer_idx)
        serving = _Windows(layer_idx, self.compress_rate, entries=entries)
        blocks = []
        L = hidden_states.shape[1]
        for q0 in range(0, L, self.query_block):
            n = min(self.query_block, L - q0)
            rows = torch.arange(q0, q0 + n, device=hidden_states.device)
            rows = rows.repeat(2) if n == 1 else rows  # one query alone: the model's decoding path
            compressed, bias = super().forward(
                hidden_states[:, rows], q_residual[:, rows], position_ids[:, rows], serving, layer_idx
            )  # [B, 1, T, D], [B, 1, block, T] 0 / -inf (None: no entries)
            blocks.append(None if bias is None else bias[:, 0, :n] == 0)
        self.visible = None if blocks[0] is None else torch.cat(blocks, dim=1)  # [B, L, T]
        return compressed, None

    def gather_entries(self, hidden_states, layer_idx):
        """name -> [B, T, d]: the entries of every window of the sequence (the compressor's, and the
        indexer's for CSA, without autograd: it is not trained), in order."""
        context, m = RUNNING.context, self.compress_rate
        shard, (B, _, _) = context.shard, hidden_states.shape
        overlap = int(hasattr(self, "indexer"))  # CSA: a window's entry also reads the window before
        C, slots, made = shard.chunk_len, -(-shard.chunk_len // m), []  # slots: most windows a chunk owns
        # per global chunk, the tokens before it that its first window (CSA: and the one before) reads
        reach = tuple(c * C - max(0, c * C // m - overlap) * m for c in range(shard.num_chunks))
        fetched = gather_halo(hidden_states, context.group, reach, layout=shard.layout)  # [B, T', hidden]
        q_rank = self.indexer.q_b_proj.in_features if overlap else 1  # the indexer's q_residual width
        for w in shard.windows(reach):
            owned = range(w.start // m, w.end // m)  # the windows whose last token is in the chunk
            first = w.first_key  # their first token, or CSA's window before
            making = _Windows(layer_idx, m, first, skip=owned.start - first // m)
            h = fetched[:, w.segment]  # [B, end - first, hidden]
            zeros = h.new_zeros((B, h.shape[1], q_rank))  # q_residual: the indexer's scores go unused
            super().forward(h, zeros, zeros[..., 0].long(), making, layer_idx)
            parts = [making.made["compressor"]] + ([making.made["indexer"].detach()] if overlap else [])
            part = torch.cat(parts, dim=-1)  # [B, len(owned), D (+ Di)]
            made.append(F.pad(part, (0, 0, 0, slots - len(owned))))  # [B, slots, D (+ Di)]
        gathered = gather_sequence(torch.cat(made, dim=1), context.group, layout=shard.layout)
        count = [(c + 1) * C // m - c * C // m for c in range(shard.num_chunks)]
        keep = torch.cat([torch.arange(c * slots, c * slots + k) for c, k in enumerate(count)])
        entries = gathered[:, keep.to(gathered.device)]  # [B, T, D (+ Di)]
        if not overlap:
            return {"compressor": entries}
        return {"compressor": entries[..., : self.head_dim], "indexer": entries[..., self.head_dim :]}


def compressed_attention(module, query, key, value, mask, **kwargs):
    """A CSA or HCA layer on rank r: query [B, H, L, D] over its sliding window's keys and the
    compressed entries. key (= value, DeepSeek V4's shared KV): [B, 1, L + T, D], this rank's
    tokens then every entry (CompressedEntries); mask: the LocalMask of its sliding window. The
    window's keys arrive as for a sliding layer (once: K is V), then per block of a local chunk's
    queries the model's own attention function (its sinks) on a dense mask: the window's rule over
    the keys the block reaches, the compressor's `visible` over the entries. Returns ([B, L, H, D],
    None)."""
    if value is not key:
        raise ValueError(f"torch_impl.hf: {type(module).__name__} passed different keys and values")
    context, (B, _, L, _) = mask.context, query.shape
    assert all(keys.blocks is None for keys in mask.chunks), "no images that see later tokens here"
    own, entries = key[:, :, :L], key[:, :, L:]  # [B, 1, L, D], [B, 1, T, D]
    fetched, _ = fetch_kv(context, own, own, mask.reach)  # [B, 1, T', D]: sent once, K is V
    visible, module.compressor.visible = module.compressor.visible, None  # [B, L, T], or None
    if visible is None:
        visible = torch.zeros((B, L, 0), dtype=torch.bool, device=query.device)
    outs = []
    for keys, queries, local, cut in query_blocks(mask, module.compressor.query_block):
        seen = window_rule(keys, mask.window, queries, cut, query.device)  # [B or 1, block, Tb]
        both = torch.cat([fetched[:, :, keys.rows][:, :, cut], entries], dim=2)  # [B, 1, Tb + T, D]
        seen = torch.cat([seen.expand(B, -1, -1), visible[:, local]], dim=-1)  # [B, block, Tb + T]
        out, _ = attend_visible(module, query[:, :, local], both, both, seen, kwargs)
        outs.append(out)  # [B, block, H, D]
    return torch.cat(outs, dim=1), None


def is_compressor(module):
    """A DeepSeek V4 compressor the adapter can drive: its forward and cache calls are the ones
    `CompressedEntries` and `_Windows` stand in for."""
    forward = getattr(type(module), "forward", None)
    if forward is None:
        return False
    names = list(inspect.signature(forward).parameters)[1:]
    wanted = ["hidden_states", "q_residual", "position_ids", "past_key_values", "layer_idx"]
    return names == wanted and hasattr(module, "compress_rate") and hasattr(module, "head_dim")
