"""Shared helpers: argument checks, group queries and the sequence-major layout.

`group=None` means *no context parallelism* (a single rank), not the default process group.
"""

import torch
import torch.distributed as dist


def check_shard(x):
    """x must be [batch, local_sequence, ...]."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"`x` must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"`x` must be [batch, local_sequence, ...] (ndim >= 2), got shape {tuple(x.shape)}")


def check_count(name, value):
    """A token count: a non-negative Python int (bool is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`{name}` must be a non-negative int, got {value!r}")


def check_group(group):
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"`group` must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}"
        )


def world_size(group):
    """Number of CP ranks; 1 without CP."""
    return 1 if group is None else dist.get_world_size(group)


def rank(group):
    """This process's rank inside the CP group; 0 without CP."""
    return 0 if group is None else dist.get_rank(group)


def seq_major(t):
    """[B, S, ...] -> contiguous [S, B, ...]. A view, no copy, when B == 1 and t is contiguous."""
    return t.transpose(0, 1).contiguous()
