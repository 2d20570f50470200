"""Zaya's Compressed Convolutional Attention projection (transformers' ZayaCCAProjection) under CP.

Its q and k are mixed along the sequence by two stacked causal convs (depthwise of kernel K0, then
grouped of kernel K1, over the projected q and k, zero-padded by K = K0 + K1 - 2 in front), and
half of each value head is the previous token's projection (the first token's: the projection of
a zero hidden state). So a token reads the K hidden states before it and nothing else: each local
chunk runs the module's own forward over the chunk with its K preceding hidden states
(gather_halo, gradients returned to their owners) and keeps its own tokens' q, k, v. The
sequence's first chunk runs without a halo, as one process pads it. The hidden states travel
already multiplied by the padding mask, as the module multiplies them.

Packed documents (where the model isolates them): each document piece of a chunk runs on its own
tokens and at most K before it within its document, as if the document ran alone.
"""

import torch
from torch import nn

from torch_impl import _group
from torch_impl.halo import gather_halo
from torch_impl.hf._common import check_stateless
from torch_impl.hf.documents import Packed
from torch_impl.layout import ShardPlan


def is_cca(module: nn.Module) -> bool:
    """Whether `module` is Zaya's CCA projection (its two convs and the delayed value path)."""
    return (
        type(module).__name__.endswith("CCAProjection")
        and isinstance(getattr(module, "conv_qk_depthwise", None), nn.Conv1d)
        and isinstance(getattr(module, "conv_qk_grouped", None), nn.Conv1d)
        and hasattr(module, "v_proj_delayed")
        and isinstance(getattr(module, "conv_kernel_size", None), int)
    )


class CCAHalo:
    """The module's forward under CP (see the module docstring); an unsharded call runs it as is."""

    def __init__(self, module, group, layout):
        self.module, self.group, self.layout = module, group, layout
        self.own = module.forward  # the bound forward, as the model defined it
        self.packed = Packed(group)

    def __call__(self, hidden_states, past_key_values=None, conv_mask=None):
        if self.packed.aside():
            return self.own(hidden_states, past_key_values, conv_mask)
        check_stateless((), past_key_values)  # a cache would hold the shard's own conv and v states
        if conv_mask is not None:
            hidden_states = hidden_states * conv_mask[:, :, None].to(hidden_states.dtype)
        K = self.module.conv_kernel_size
        reach = max(K, 1)  # the delayed value reads one token back
        n, r, L = _group.world_size(self.group), _group.rank(self.group), hidden_states.shape[1]
        x = gather_halo(hidden_states, self.group, reach, layout=self.layout)  # [B, T, H]
        first = self.packed.first_rows()  # [B, S] or None
        parts = [
            self.window(x[:, w.segment], w, reach, first)
            for w in ShardPlan.of(self.layout, n, r, L).windows(reach)
        ]
        return tuple(torch.cat(p, dim=1) if len(p) > 1 else p[0] for p in zip(*parts, strict=True))

    def window(self, x, w, reach, first):
        """(q, k, v) of the chunk w's own tokens from x, its hidden states of rows [w.first_key, w.end)."""
        C = w.end - w.start
        starts = None if first is None else first[:, w.start : w.end]  # [B, C]
        if starts is None or bool((starts <= w.first_key).all()):  # no document begins in reach
            return tuple(t[:, -C:] for t in self.own(x, None, None))
        rows = []
        for b, row in enumerate(starts.tolist()):
            cuts = [t for t in range(C) if t == 0 or row[t] == w.start + t] + [C]
            pieces = []
            for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
                begin = max(row[lo], w.start + lo - reach)  # within the document, at most reach back
                tokens = x[b : b + 1, begin - w.first_key : w.start + hi - w.first_key]
                pieces.append(tuple(t[:, -(hi - lo) :] for t in self.own(tokens, None, None)))
            rows.append(tuple(torch.cat(p, dim=1) for p in zip(*pieces, strict=True)))
        return tuple(torch.cat(p, dim=0) for p in zip(*rows, strict=True))
