"""Causal depthwise short convolutions (LFM2's `Lfm2ShortConv`): their kernel - 1 preceding tokens."""

import torch

from torch_impl import _group
from torch_impl.halo import gather_halo
from torch_impl.hf._common import Arguments


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
