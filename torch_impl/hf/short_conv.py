"""Causal depthwise short convolutions (LFM2's `Lfm2ShortConv`): their kernel - 1 preceding tokens."""

import functools

import torch

from torch_impl import _group
from torch_impl.halo import gather_halo
from torch_impl.hf._common import Arguments, stepping_aside
from torch_impl.layout import ShardPlan


class ShortConvHalo:
    """Forward hooks giving a causal depthwise short convolution (kernel K) its K-1 preceding tokens.

    Before: hidden_states [B, L, D] -> gather_halo(K - 1): per local chunk (one, contiguous; two,
    head_tail) its h = min(cC, K-1) preceding tokens, then the chunk; its 2-D padding mask likewise
    (all True where the model passed none: whether a mask is passed depends on this rank's tokens,
    the exchange must not). The convolution is causal over at most K-1 earlier positions, so each
    chunk's outputs see only their own segment. After: the outputs at the windows are dropped.
    """

    def __init__(self, module, group, layout="contiguous"):
        self.group, self.halo_size, self.layout = group, module.conv.kernel_size[0] - 1, layout
        self.arguments = Arguments(module.forward)

    def windows(self, local_len):
        n, r = _group.world_size(self.group), _group.rank(self.group)
        return ShardPlan.of(self.layout, n, r, local_len).windows(self.halo_size)

    def local_len(self, T):
        """The L whose halo output is T rows long (the hooks keep no state between them: a
        compiled, checkpointed layer may not carry it out of its graph); found once per shape."""
        n, r = _group.world_size(self.group), _group.rank(self.group)
        return _local_len(n, r, T, self.halo_size, self.layout)

    def before(self, module, args, kwargs):
        if stepping_aside():  # an unsharded call: the whole sequence is here
            return None
        x = self.arguments.get(args, kwargs, "hidden_states")  # [B, L, D]
        mask = self.arguments.get(args, kwargs, "attention_mask")  # [B, L] or None
        mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if mask is None else mask.bool()
        return self.arguments.replace(
            args,
            kwargs,
            hidden_states=gather_halo(x, self.group, self.halo_size, layout=self.layout),  # [B, T, D]
            attention_mask=gather_halo(mask, self.group, self.halo_size, layout=self.layout),  # [B, T]
        )

    def after(self, module, args, kwargs, output):
        if stepping_aside():
            return None
        kept = [output[:, w.own] for w in self.windows(self.local_len(output.shape[1]))]  # [B, C, D] each
        return kept[0] if len(kept) == 1 else torch.cat(kept, dim=1)  # [B, L, D]


@functools.cache
def _local_len(n, r, T, halo_size, layout):
    """ShortConvHalo.local_len's search: at most 2 * halo_size + 1 candidate lengths."""
    for L in range(max(1, T - 2 * halo_size), T + 1):
        if layout == "head_tail" and L % 2:
            continue
        if ShardPlan.of(layout, n, r, L).windows(halo_size)[-1].segment.stop == T:
            return L
    raise ValueError(f"no local length gives a short-conv halo of {T} rows")
