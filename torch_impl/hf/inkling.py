"""Inkling's and Inkling2's attention layers under CP: relative logits by global distance, per-query
sinks, and Inkling2's token-dependent short convs over a halo.

Each query's relative bias is a table over backward distances 0 .. E - 1 (E: the layer's
`rel_extent`), mixed from the query's own `relative_states`; the model spreads it into a dense
[L, L] bias from the rank's local rows (`arange`), which under CP would put every key at a local
distance. `RelativeTable` makes the module's `rel_logits_proj` return the table itself (its own
forward, asked for distances 0 .. E - 1), and `relative_attention` fetches the keys as for a full or
sliding layer and, per block of queries, reads each key's bias at its global distance (zero
outside [0, E)), then runs the model's own attention function with that bias and the block's sinks
on a dense mask. Inkling's log scaling of its full layers' queries (and their bias), which the
model computes from the rank's local rows (`arange`, 1 up to `log_scaling_n_floor`), is moved to
the global positions by the attention: the model's float32 factor divided out and the global one
applied, in the precision the model scales in (bit for bit the model's where its factor is 1,
rounded once more elsewhere; Llama 4's temperature tuning reads positions, so needs none of this).

Inkling2's full layers convolve their keys and values with taps that depend on each token
(`TokenConvHalo`): each rank sends the K - 1 masked inputs the next chunk's first tokens read
(gather_halo), and the model's own forward runs per chunk over them; a token whose document begins
within reach runs per piece of its document, reading nothing before its start. The static short
convs go through the conv halo of torch_impl.hf.recurrent.
"""

import inspect

import torch
from torch import nn
import torch.nn.functional as F

from torch_impl import _group
from torch_impl.halo import gather_halo
from torch_impl.hf._common import (
    attend_visible,
    by_document,
    check_stateless,
    fetch_kv,
    query_blocks,
    stepping_aside,
    window_rule,
)
from torch_impl.layout import ShardPlan

# attention classes whose log scaling (full layers, `log_scaling_n_floor` set) counts the local rows
LOCAL_LOG_SCALING = ("InklingAttention",)
TOKEN_CONV_ARGUMENTS = ["hidden_states", "dynamic_input", "past_key_values", "conv_mask"]


def is_relative(module):
    """Whether `module` is an attention layer with Inkling's relative logits: a `rel_logits_proj`
    holding a bank `proj` [d_rel, rel_extent] whose forward takes the relative states and the
    query and key positions."""
    relative = getattr(module, "rel_logits_proj", None)
    if not isinstance(getattr(relative, "proj", None), nn.Parameter) or not hasattr(relative, "rel_extent"):
        return False
    names = list(inspect.signature(type(relative).forward).parameters)[1:]
    return names == ["relative_states", "query_positions", "key_positions"]


def log_scale(module):
    """Inkling's full layers with log scaling: as a function of the positions [L], the factor [L]
    (the module's formula, in float32) it gives its queries and bias, which it computes from the
    rank's local rows; else None."""
    config = module.config
    if type(module).__name__ not in LOCAL_LOG_SCALING or module.is_sliding:
        return None
    if getattr(config, "log_scaling_n_floor", None) is None:
        return None

    def scale(positions):
        n = (positions + 1).float()
        return 1.0 + config.log_scaling_alpha * torch.log((n / config.log_scaling_n_floor).clamp(min=1.0))

    return scale


class RelativeTable:
    """Mixed into the class of an attention layer's `rel_logits_proj`: under CP its forward returns
    each query's bias per backward distance, [B, H, L, E] (the module's own forward over distances
    0 .. E - 1), which `relative_attention` reads at the global distances; in an unsharded call the
    model's own dense bias."""

    query_block = 256  # queries whose bias [B, H, block, keys] relative_attention makes at once

    def forward(self, relative_states, query_positions, key_positions):
        if stepping_aside():  # an unsharded call: the model's own bias
            return super().forward(relative_states, query_positions, key_positions)
        L, device = relative_states.shape[1], relative_states.device
        rows = torch.zeros(L, dtype=torch.long, device=device)  # every query at row 0
        back = -torch.arange(self.rel_extent, device=device)  # keys at 0, -1, ..: distances 0 .. E - 1
        return super().forward(relative_states, rows, back)  # [B, H, L, E]


def relative_attention(module, query, key, value, mask, position_bias, sinks=None, **kwargs):
    """A layer with relative logits on rank r: query [B, H, L, D], key/value [B, Hkv, L, D], the
    bias table position_bias [B, H, L, E] (RelativeTable), sinks [B, H, L, 1] or None, mask the
    LocalMask of its kind (full or sliding). Per block of a local chunk's queries, the model's own
    attention over the keys the block reaches, with the bias at their global distances and the
    block's sinks, on a dense mask. Returns ([B, L, H, D], None)."""
    context, (B, H, L, _) = mask.context, query.shape
    table, scale = position_bias, log_scale(module)  # [B, H, L, E]
    assert table.shape[-1] == module.rel_logits_proj.rel_extent, table.shape  # RelativeTable's
    assert all(keys.blocks is None for keys in mask.chunks), "no images that see later tokens here"
    if scale is not None:  # the model's factor at the global positions, in place of its local rows'
        given = scale(torch.arange(L, device=query.device))  # float32 [L]: the model's, by local row
        wanted = scale(_positions(context, query.device))  # float32 [B or 1, L]: at the global rows
        q = query.float()  # [B, H, L, D], in the precision the model scales in
        tau = (wanted.to(q.dtype) / given.to(q.dtype))[:, None, :, None]  # [B or 1, 1, L, 1]
        query = (q * tau).to(query.dtype)  # as the model's where its factor is 1; else rounded again
        table = (table.float() * tau).to(table.dtype)  # [B, H, L, E]
    key, value = fetch_kv(context, key, value, mask.reach)  # [B, Hkv, T, D]
    E, outs = table.shape[-1], []
    for keys, queries, local, cut in query_blocks(mask, module.rel_logits_proj.query_block):
        first = keys.chunk.first_key
        seen = window_rule(keys, mask.window, queries, cut, query.device).expand(B, -1, -1)  # [B, q, k]
        q = torch.arange(queries.start, queries.stop, device=query.device)
        k = torch.arange(first + cut.start, first + cut.stop, device=query.device)
        distance = q[:, None] - k[None]  # [q, k]
        bias = table[:, :, local].gather(-1, distance.clamp(0, E - 1).expand(B, H, -1, -1))  # [B, H, q, k]
        bias = bias.masked_fill((distance < 0) | (distance >= E), 0.0)
        block = {"position_bias": bias, "sinks": None if sinks is None else sinks[:, :, local]}
        k_, v_ = key[:, :, keys.rows][:, :, cut], value[:, :, keys.rows][:, :, cut]  # [B, Hkv, k, D]
        out, _ = attend_visible(module, query[:, :, local], k_, v_, seen, kwargs | block)
        outs.append(out)  # [B, q, H, D]
    return torch.cat(outs, dim=1), None


def _positions(context, device):
    """int64 [B or 1, L]: the global row of each local token, counted from its document's start in
    packed rows (each document as if alone, as its convs run under CP)."""
    rows = context.shard.rows(device)  # [L]
    if context.documents is None:
        return rows[None]
    return rows - context.documents.first_rows()[:, rows]  # [B, L]


def is_token_conv(module):
    """Whether `module` is Inkling2's token-dependent short conv: static taps `static_weight`
    [K, C] plus per-token taps from `weight_proj`, with the forward TokenConvHalo calls."""
    if not isinstance(getattr(module, "static_weight", None), nn.Parameter):
        return False
    names = list(inspect.signature(type(module).forward).parameters)[1:5]
    return isinstance(getattr(module, "weight_proj", None), nn.Linear) and names == TOKEN_CONV_ARGUMENTS


class TokenConvHalo:
    """Mixed into the class of Inkling2's token-dependent short conv (`cp_packed`: a Packed over
    the CP group, and `cp_layout`, set by apply_token_conv). Under CP, the model's own forward per
    local chunk over the chunk's K - 1 preceding inputs (masked by their owner, as the model masks
    them) and the chunk; the preceding rows' taps are never read (their outputs are dropped), so
    they take zeros for the tap-weights' input. Packed documents: per piece of a document, nothing
    before its start. An unsharded call runs the model's own forward."""

    def forward(self, hidden_states, dynamic_input, past_key_values=None, conv_mask=None, **kwargs):
        if self.cp_packed.aside():
            return super().forward(hidden_states, dynamic_input, past_key_values, conv_mask, **kwargs)
        check_stateless((), past_key_values)  # a cache would hold the shard's own inputs
        first, outs = self.cp_packed.first_rows(), []  # [B, S] or None
        group, reach, L = self.cp_packed.group, self.conv_kernel_size - 1, hidden_states.shape[1]
        masked = hidden_states
        if conv_mask is not None:  # as the model masks them
            masked = (hidden_states * conv_mask[:, :, None]).to(hidden_states.dtype)
        fetched = gather_halo(masked, group, reach, layout=self.cp_layout)  # [B, T, C]
        shard = ShardPlan.of(self.cp_layout, _group.world_size(group), _group.rank(group), L)
        for w in shard.windows(reach):
            before = w.start - w.first_key  # the rows of the halo
            halo = fetched[:, w.segment][:, :before]  # [B, before, C]
            x = torch.cat([halo, hidden_states[:, w.queries]], dim=1)  # [B, T, C]
            dyn = F.pad(dynamic_input[:, w.queries], (0, 0, before, 0))  # [B, T, Din]
            cmask = None if conv_mask is None else conv_mask[:, w.queries]  # [B, C]
            cmask = None if cmask is None else torch.cat([cmask.new_ones(cmask.shape[0], before), cmask], 1)
            outs.append(self._chunk(x, dyn, cmask, w, first, reach))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)  # [B, L, C]

    def _chunk(self, x, dyn, cmask, w, first, reach):
        """The chunk w's outputs [B, C, hidden] from x, dyn and cmask at global rows [first_key, end)."""

        def run(b, begin, stop):  # the model's forward over rows [begin, stop) of batch rows b
            at = slice(begin - w.first_key, stop - w.first_key)
            mask_ = None if cmask is None else cmask[b, at]
            return super(TokenConvHalo, self).forward(x[b, at], dyn[b, at], None, mask_)

        return by_document(run, first, w, reach)
