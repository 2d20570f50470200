"""Shared helpers: group queries, the single-tensor collectives and the sequence-major layout.

`group=None` means *no context parallelism* (a single rank), not the default process group.
"""

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

Group = dist.ProcessGroup | DeviceMesh | None  # a CP group as the public functions take it

# torch >= 2.13 names the single-tensor collectives *_single; older releases (the GPU check's
# image, torch 2.11, which runs the package from its source tree) *_tensor.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def resolve_group(group):
    """The CP ProcessGroup, or None without CP; a 1-D DeviceMesh stands for its group."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"`group` must be a 1-D DeviceMesh, got a {group.ndim}-D one with dims "
                f"{group.mesh_dim_names}; pass its CP sub-mesh, e.g. mesh['cp']"
            )
        return group.get_group()
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            "`group` must be a torch.distributed.ProcessGroup, a 1-D DeviceMesh or None, "
            f"got {type(group).__name__}"
        )
    return group


def world_size(group):
    """Number of CP ranks; 1 without CP."""
    return 1 if group is None else dist.get_world_size(group)


def rank(group):
    """This process's rank inside the CP group; 0 without CP."""
    return 0 if group is None else dist.get_rank(group)


def seq_major(t):
    """[B, S, ...] -> contiguous [S, B, ...]. A view, no copy, when B == 1 and t is contiguous."""
    return t.transpose(0, 1).contiguous()
