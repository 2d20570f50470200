"""Deliberately wrong transports. The parity suite's self-check asserts that it catches each one."""

import torch
import torch.distributed as dist

import torch_impl
from torch_impl import halo as halo_module
from torch_impl.layout import ShardPlan


def halo_off_by_one(x, group, halo_size, left_padding=0):
    """A window one token early: global tokens [r*L - h - 1, r*L - 1) (clamped at token 0)."""
    full = torch_impl.gather_sequence(x, group)  # [B, n*L, ...]
    r, L = dist.get_rank(group), x.shape[1]
    h = min(r * L, halo_size)
    start = max(r * L - h - 1, 0)
    zeros = x.new_zeros((x.shape[0], left_padding, *x.shape[2:]))  # [B, left_padding, ...]
    return torch.cat([zeros, full[:, start : start + h], x], dim=1)


class _HaloGradToWrongOwner(torch.autograd.Function):
    """A right forward; backward returns every halo piece's gradient to rank dst - 1."""

    @staticmethod
    def forward(ctx, x, group, halo_size, left_padding):
        n, r, L = dist.get_world_size(group), dist.get_rank(group), x.shape[1]
        plan = torch_impl.halo_plan(n, L, halo_size)
        ctx.group, ctx.windows = group, ShardPlan.of("contiguous", n, r, L).windows(halo_size, left_padding)
        ctx.wrong_plan = tuple(t._replace(src=t.dst - 1) for t in plan)
        return halo_module._halo_forward(x, group, plan, ctx.windows)

    @staticmethod
    def backward(ctx, grad):
        return halo_module._halo_backward(grad, ctx.group, ctx.wrong_plan, ctx.windows), None, None, None


def halo_grad_to_wrong_owner(x, group, halo_size, left_padding=0):
    return _HaloGradToWrongOwner.apply(x, group, halo_size, left_padding)


def sequence_wrong_rank_order(x, group):
    """The shards gathered in reverse group-rank order."""
    n = dist.get_world_size(group)
    return torch_impl.gather_sequence(x, group).unflatten(1, (n, x.shape[1])).flip(1).flatten(1, 2)
