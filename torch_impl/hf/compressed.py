"""DeepSeek V4's compressed attention layers under CP: CSA (`compressed_sparse_attention`: windows of
m tokens, each with the one before it, pooled by a softmax gate into one KV entry; an indexer picks
each query's top-k entries) and HCA (`heavily_compressed_attention`: windows of m' tokens pooled
alone), beside the layer's sliding window over the tokens themselves.

The compressed entries move instead of the tokens. A window belongs to the rank holding its last
token: each rank runs the model's own compressor (and CSA's indexer's) over its chunks' windows,
with the up to 2m - 1 hidden states before a chunk that its first windows read (gather_halo), then
the entries of every rank are gathered (gather_sequence, about 1/m of the tokens; backward: their
gradients go back to the rank that made them). The model's own compressor then runs once more for
this rank's queries over the gathered entries: their causal threshold and the indexer's top-k over
every entry a query may see, as in one process. `compressed_attention` attends over the sliding
window's keys (fetched as for a sliding layer) and the entries, on the model's own attention
function with its sinks.
"""

import inspect

import torch

from torch_impl.halo import gather_halo
from torch_impl.hf._common import RUNNING, stepping_aside
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
    fully_shard does, so that its parameters keep their names. Its forward returns what the
    model's does: every compressed entry of the whole sequence [B, 1, T, D] and this rank's
    queries' mask over them [B, 1, L, T] (0 or -inf), which it also keeps as `bias` for
    `compressed_attention` (the model drops it when its mask is not a tensor)."""

    bias = None

    def forward(self, hidden_states, q_residual, position_ids, past_key_values, layer_idx):
        if stepping_aside():  # an unsharded call: the model's own compressor
            return super().forward(hidden_states, q_residual, position_ids, past_key_values, layer_idx)
        if past_key_values is not None:
            raise ValueError("torch_impl.hf: DeepSeek V4's compressed layers take no KV cache under CP")
        entries = self.gather_entries(hidden_states, layer_idx)
        serving = _Windows(layer_idx, self.compress_rate, entries=entries)
        compressed, self.bias = super().forward(hidden_states, q_residual, position_ids, serving, layer_idx)
        return compressed, self.bias

    def gather_entries(self, hidden_states, layer_idx):
        """name -> [B, T, d]: the entries of every window of the sequence (the compressor's, and the
        indexer's for CSA, without autograd: it is not trained), in order."""
        context, m = RUNNING.context, self.compress_rate
        shard, (B, _, _) = context.shard, hidden_states.shape
        overlap = hasattr(self, "indexer")  # CSA: a window's entry also reads the window before it
        reach = 2 * m - 1 if overlap else m - 1  # from a chunk's first window's first token
        fetched = gather_halo(hidden_states, context.group, reach, layout=shard.layout)
        C, slots, made = shard.chunk_len, -(-shard.chunk_len // m), []  # slots: most windows a chunk owns
        for w in shard.windows(reach):
            owned = range(w.start // m, w.end // m)  # the windows whose last token is in the chunk
            first = max(0, owned.start - overlap) * m  # their first token, or CSA's window before
            rows = slice(w.segment.start + first - w.first_key, w.segment.stop)
            making = _Windows(layer_idx, m, first, skip=owned.start - first // m)
            dummy = self.indexer.q_b_proj.in_features if overlap else 1
            h = fetched[:, rows]
            zeros = h.new_zeros((B, h.shape[1], dummy))  # q_residual: the indexer's scores go unused
            super().forward(h, zeros, zeros[..., 0].long(), making, layer_idx)
            parts = [making.made["compressor"]] + ([making.made["indexer"].detach()] if overlap else [])
            part = torch.cat(parts, dim=-1)  # [B, len(owned), D (+ Di)]
            made.append(torch.nn.functional.pad(part, (0, 0, 0, slots - len(owned))))
        gathered = gather_sequence(torch.cat(made, dim=1), context.group, layout=shard.layout)
        count = [(c + 1) * C // m - c * C // m for c in range(shard.num_chunks)]
        keep = torch.cat([torch.arange(c * slots, c * slots + k) for c, k in enumerate(count)])
        entries = gathered[:, keep.to(gathered.device)]  # [B, T, D (+ Di)]
        D = self.head_dim
        if not overlap:
            return {"compressor": entries}
        return {"compressor": entries[..., :D], "indexer": entries[..., D:]}


def compressed_attention(module, query, key, value, mask, **kwargs):
    """A CSA or HCA layer on rank r: query [B, H, L, D] over its sliding window's keys and the
    compressed entries. key (= value, DeepSeek V4's shared KV): [B, 1, L + T, D], this rank's
    tokens then every entry (CompressedEntries); mask: the LocalMask of its sliding window. The
    window's keys arrive as for a sliding layer (once: K is V), then per local chunk the model's own
    attention function (its sinks) on a dense mask: the window's rule over the tokens, the
    compressor's `bias` over the entries. Returns ([B, L, H, D], None)."""
    if value is not key:
        raise ValueError(f"torch_impl.hf: {type(module).__name__} passed different keys and values")
    setup, context, (B, _, L, _) = module.context_parallel, mask.context, query.shape
    own, entries = key[:, :, :L], key[:, :, L:]  # [B, 1, L, D], [B, 1, T, D]
    own = own.transpose(1, 2)  # [B, L, 1, D]
    fetched = (
        gather_sequence(own, context.group, layout=context.shard.layout)
        if mask.reach is None
        else gather_halo(own, context.group, mask.reach, layout=context.shard.layout)
    ).transpose(1, 2)  # [B, 1, T', D]
    bias = module.compressor.bias  # [B, 1, L, T] 0 / -inf, or None without entries
    outs = []
    for keys in mask.chunks:
        w = keys.chunk
        both = torch.cat([fetched[:, :, keys.rows], entries], dim=2)  # [B, 1, Tc + T, D]
        q_rows = torch.arange(w.start, w.end, device=query.device)[:, None]  # [C, 1]
        k_rows = torch.arange(w.first_key, w.end, device=query.device)[None]  # [1, Tc]
        seen = (k_rows <= q_rows)[None]  # [1, C, Tc]
        if mask.window is not None:
            seen = seen & (q_rows - k_rows < mask.window)
        if keys.padding is not None:
            seen = seen & keys.padding[:, None, :]
        if keys.documents is not None:
            seen = seen & (keys.documents[:, None, :] == keys.documents[:, w.halo :, None])
        picked = torch.zeros((B, w.end - w.start, 0), dtype=torch.bool, device=query.device)
        if bias is not None:
            picked = bias[:, 0, w.queries] == 0  # [B, C, T]
        visible = torch.cat([seen.expand(B, -1, -1), picked], dim=-1)  # [B, C, Tc + T]
        dense = setup.make_mask(
            batch_size=B,
            q_length=visible.shape[1],
            kv_length=visible.shape[2],
            mask_function=lambda b, h, q, kv, visible=visible: visible[b, q, kv],
            allow_is_causal_skip=False,
            dtype=query.dtype,
            device=query.device,
            config=module.config,
        )  # [B, 1, C, Tc + T]
        out, _ = setup.attend(module, query[:, :, w.queries], both, both, dense, **kwargs)
        outs.append(out)  # [B, C, H, D]
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
