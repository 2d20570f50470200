"""A hybrid block, conv + sliding-window attention + full attention, written once for CP and no CP.

Each rank holds x: [B, L, D], the global tokens [r*L, (r+1)*L). Every layer fetches only what it
needs from other ranks, through torch_impl:

1. causal depthwise conv1d, kernel K: its left context, `gather_halo(x, g, K - 1)`;
2. sliding-window causal attention, window W: keys and values from `gather_halo(k, g, W - 1,
   left_padding=W - 1 - h)`, so that every rank's key tile is [B, W - 1 + L, D] and tile column j
   holds the global key r*L - (W - 1) + j (the padding columns are keys before token 0, masked);
3. full causal attention: keys and values from `gather_sequence`, global positions and a bool
   padding mask from `gather_metadata`.

With group=None the same code is the single-process block over the whole sequence.
"""

import torch
from torch import nn
import torch.distributed as dist
import torch.nn.functional as F

from torch_impl import gather_halo, gather_metadata, gather_sequence


def cp_rank(group):
    return 0 if group is None else dist.get_rank(group)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def split(self, x):
        return self.qkv(x).chunk(3, dim=-1)  # 3 x [B, L, D]

    def attend(self, q, k, v, mask):
        """q: [B, Lq, D], k/v: [B, Lk, D], mask: bool [B or 1, Lq, Lk] (True: may attend)."""
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))  # [B, H, *, D/H]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])  # [B, H, Lq, D/H]
        return self.out(y.transpose(1, 2).flatten(2))  # [B, Lq, D]


class HybridBlock(nn.Module):
    def __init__(self, dim, heads, kernel, window):
        super().__init__()
        self.kernel, self.window = kernel, window
        self.conv = nn.Conv1d(dim, dim, kernel, groups=dim, bias=False)  # depthwise
        self.local_attn = Attention(dim, heads)
        self.global_attn = Attention(dim, heads)

    def causal_conv(self, x, group):
        """x: [B, L, D] -> [B, L, D]; output t sees tokens t-K+1 .. t."""
        K = self.kernel
        h = min(cp_rank(group) * x.shape[1], K - 1)
        tile = gather_halo(x, group, K - 1, left_padding=K - 1 - h)  # [B, K-1+L, D]
        return self.conv(tile.transpose(1, 2)).transpose(1, 2)  # [B, L, D]

    def sliding_window_attention(self, x, group):
        """Query at global position p attends keys p-W+1 .. p (those >= 0)."""
        W, L = self.window, x.shape[1]
        q, k, v = self.local_attn.split(x)
        h = min(cp_rank(group) * L, W - 1)
        k = gather_halo(k, group, W - 1, left_padding=W - 1 - h)  # [B, W-1+L, D]
        v = gather_halo(v, group, W - 1, left_padding=W - 1 - h)  # [B, W-1+L, D]
        i = torch.arange(L, device=x.device)[:, None]  # query i: global r*L + i
        j = torch.arange(W - 1 + L, device=x.device)[None]  # key column j: global r*L - (W-1) + j
        mask = (j >= i) & (j <= i + W - 1) & (j >= W - 1 - h)  # [L, W-1+L]
        return self.local_attn.attend(q, k, v, mask[None])

    def full_attention(self, x, group, positions, valid):
        """Causal attention over the whole sequence; padded keys (valid False) are masked."""
        q, k, v = self.global_attn.split(x)
        k, v = gather_sequence(k, group), gather_sequence(v, group)  # [B, S, D]
        key_pos, key_valid = gather_metadata(positions, group), gather_metadata(valid, group)  # [B, S]
        mask = (key_pos[:, None, :] <= positions[:, :, None]) & key_valid[:, None, :]  # [B, L, S]
        return self.global_attn.attend(q, k, v, mask)

    def forward(self, x, group, positions, valid):
        """x: [B, L, D]; positions: int64 [B, L], global; valid: bool [B, L]. Returns [B, L, D]."""
        x = x + self.causal_conv(x, group)
        x = x + self.sliding_window_attention(x, group)
        return x + self.full_attention(x, group, positions, valid)


def make_inputs(batch, seq_len, dim, pad, dtype, seed=0):
    """Global input, output cotangent, positions and the padding mask (the last `pad` tokens)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq_len, dim, generator=gen).to(dtype)
    cotangent = (torch.randn(batch, seq_len, dim, generator=gen) / seq_len**0.5).to(dtype)
    positions = torch.arange(seq_len).expand(batch, seq_len)
    valid = positions < seq_len - pad
    return x, cotangent, positions, valid


def make_block(dim, heads, kernel, window, dtype, seed=0):
    torch.manual_seed(seed)
    return HybridBlock(dim, heads, kernel, window).to(dtype)


def forward_backward(block, x, cotangent, group, positions, valid):
    """One forward and backward: (output, input grad, {parameter name: grad})."""
    x = x.detach().clone().requires_grad_(True)
    block.zero_grad(set_to_none=True)
    y = block(x, group, positions, valid)
    y.backward(cotangent)
    return y.detach(), x.grad, {name: p.grad.clone() for name, p in block.named_parameters()}


def cp_forward_backward(block, x, cotangent, group, positions, valid):
    """The CP run on this rank, from global tensors: its output and input grad shards, and the
    parameter grads summed over CP ranks (each rank's are partial sums over its tokens)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    L = x.shape[1] // n
    shard = slice(r * L, (r + 1) * L)
    y, grad_x, grads = forward_backward(
        block, x[:, shard], cotangent[:, shard], group, positions[:, shard], valid[:, shard]
    )
    for g in grads.values():
        dist.all_reduce(g, group=group)
    return y, grad_x, grads


def max_differences(reference, cp_results):
    """Max abs difference of output, input grad and each parameter grad: reference (global) vs the
    ranks' shards, in rank order."""
    y_ref, gx_ref, grads_ref = reference
    n = len(cp_results)
    L = y_ref.shape[1] // n
    diffs = {"output": 0.0, "input grad": 0.0}
    for r, (y, gx, grads) in enumerate(cp_results):
        shard = slice(r * L, (r + 1) * L)
        diffs["output"] = max(diffs["output"], (y.double() - y_ref[:, shard].double()).abs().max().item())
        diffs["input grad"] = max(
            diffs["input grad"], (gx.double() - gx_ref[:, shard].double()).abs().max().item()
        )
        for name, g in grads.items():
            d = (g.double() - grads_ref[name].double()).abs().max().item()
            diffs[f"grad {name}"] = max(diffs.get(f"grad {name}", 0.0), d)
    return diffs
