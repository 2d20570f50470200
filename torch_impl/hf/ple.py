"""Qwen4's per-layer embeddings (PLE, on the layers its config's `ple_layer_ids` names) under CP.

A PLE layer reads backwards in two ways: its n-gram embedding hashes each token id with the
`ngram_size - 1` ids before it (a segment restarting after each EOS id), and a depthwise conv of
kernel K and dilation `ngram_size` mixes the gated values of the (K - 1) * dilation tokens before
each token. The model reads both histories from a cache (`get_conv_state`, `update_conv_state`),
otherwise from nothing (EOS ids, zero inputs), which under CP would cut them at every shard edge.

`PLEHalo` runs the layer's own forward per local chunk over the chunk and the R = (K - 1) * dilation
rows before it (their hidden states from their owners, gather_halo: gradients return to them), and
hands the forward, through a cache stand-in, the ids before its first row (gather_halo of the ids,
which the model set to EOS at padding, R + ngram_size - 1 back, with the padding mask; EOS before
row 0 and before the row's document). The rows before the chunk are recomputed for the conv's
inputs and their outputs dropped, masked at padding as the model masks them. Packed documents: per
piece of a document, nothing before its start (as each document alone).
"""

import inspect

import torch

from torch_impl import _group
from torch_impl.halo import gather_halo
from torch_impl.hf._common import by_document, check_stateless
from torch_impl.layout import ShardPlan

PLE_ARGUMENTS = ["hidden_states", "input_ids", "past_key_values", "conv_mask"]


def is_ple(module):
    """Whether `module` is Qwen4's PLE layer: an n-gram embedding (`ple_embedding`: `context_len`
    ids back, `eos_token_id`) and a dilated depthwise `conv1d` of reach `short_conv_state_len`, with
    the forward PLEHalo calls."""
    ngram, conv = getattr(module, "ple_embedding", None), getattr(module, "conv1d", None)
    if not isinstance(conv, torch.nn.Conv1d) or not hasattr(module, "short_conv_state_len"):
        return False
    names = list(inspect.signature(type(module).forward).parameters)[1:]
    return hasattr(ngram, "context_len") and hasattr(ngram, "eos_token_id") and names == PLE_ARGUMENTS


class History:
    """The cache a PLE layer's forward reads, standing in for transformers' for one run: the ids
    before its first row (conv state 2), and no conv inputs before it (state 1: the run starts with
    the rows the chunk's first token reads)."""

    def __init__(self, ids):
        self.ids = ids  # int [b, ngram_size - 1]

    def get_conv_state(self, layer_idx, state_idx=0):
        return self.ids if state_idx == 2 else None

    def update_conv_state(self, states, layer_idx, state_idx=0, conv_kernel_size=None):
        return states


class PLEHalo:
    """Mixed into the class of Qwen4's PLE layer (`cp_packed`: a Packed over the CP group, and
    `cp_layout`, set by apply_token_conv). Under CP, the model's own forward per local chunk over
    the rows its conv reads before the chunk, given the ids before those (History); packed
    documents per piece of a document. An unsharded call runs the model's own forward."""

    def forward(self, hidden_states, input_ids, past_key_values=None, conv_mask=None):
        if self.cp_packed.aside():
            return super().forward(hidden_states, input_ids, past_key_values, conv_mask)
        check_stateless((), past_key_values)  # a cache would hold the shard's own history
        group, layout, L = self.cp_packed.group, self.cp_layout, hidden_states.shape[1]
        reach, back = self.short_conv_state_len, self.ple_embedding.context_len
        first = self.cp_packed.first_rows()
        states = gather_halo(hidden_states, group, reach, layout=layout)  # [B, T, hc * hidden]
        # the ids (the model set them to EOS at padding) and the padding mask (None on a rank without
        # padding: ones, as multiplying by them changes nothing), in one exchange
        mask = torch.ones_like(input_ids) if conv_mask is None else conv_mask.to(input_ids.dtype)
        both = gather_halo(torch.stack([input_ids, mask], dim=-1), group, reach + back, layout=layout)
        shard = ShardPlan.of(layout, _group.world_size(group), _group.rank(group), L)
        outs = []
        for w, v in zip(shard.windows(reach), shard.windows(reach + back), strict=True):
            chunk_states, chunk = states[:, w.segment], both[:, v.segment]  # [B, T, C], [B, T', 2]

            def run(b, begin, stop, w=w, v=v, chunk_states=chunk_states, chunk=chunk):
                rows = torch.arange(begin - back, stop, device=input_ids.device)  # [back + stop - begin]
                ids_ = chunk[b][:, (rows - v.first_key).clamp_min(0), 0]  # [b, back + stop - begin]
                start = rows.new_zeros(()) if first is None else first[b, begin][:, None]  # [b, 1] or []
                ids_ = ids_.masked_fill(rows < start, self.ple_embedding.eos_token_id)
                mask_ = chunk[b, begin - v.first_key : stop - v.first_key, 1]  # [b, stop - begin]
                x = chunk_states[b, begin - w.first_key : stop - w.first_key]
                return super(PLEHalo, self).forward(x, ids_[:, back:], History(ids_[:, :back]), mask_)

            outs.append(by_document(run, first, w, reach))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)  # [B, L, hc * hidden]
