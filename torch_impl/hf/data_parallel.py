"""Data parallelism for a CP model: gradients summed over CP, reduced over DP as the loss says.

Under CP each rank's loss is its *share* of its data-parallel batch's loss (`hf.shard_batch` passes
the batch's global label count as `num_items_in_batch`), so the CP ranks' gradients must be summed.
DDP and FSDP2 average over their whole group instead: wrapped as they are over a DP x CP mesh, the
gradients come out divided by the CP size. These wrappers reduce over the flattened dp x cp ranks
(CP ranks hold the same parameters) with the divide factor that makes them one process's:

| the loss on each DP batch                             | `global_num_items` | gradients            |
|-------------------------------------------------------|--------------------|----------------------|
| its own mean (shard_batch's `num_items_in_batch`)     | False (default)    | sum over CP, mean    |
|                                                       |                    | over DP (DDP's usual)|
| a share of the mean over all DP batches (the count of | True               | sum over every rank  |
| valid labels all-reduced over DP, as examples.train)  |                    |                      |

    model = hf.parallelize(model, mesh["cp"])
    model = hf.apply_fsdp(model, mesh)         # or: model = hf.apply_ddp(model, mesh)

`mesh` is a DeviceMesh with dims named "dp" and "cp" (other names: `dp_dim`, `cp_dim`), or a 1-D
mesh named "cp" (no data parallelism).
"""

from torch import nn
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel


def _flat_mesh(mesh, dp_dim, cp_dim):
    """(the 1-D mesh of every dp x cp rank, the DP size)."""
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if not isinstance(mesh, DeviceMesh) or set(names) not in ({dp_dim, cp_dim}, {cp_dim}):
        raise ValueError(
            f"`mesh` must be a DeviceMesh with dims named {(dp_dim, cp_dim)} (or a 1-D one named "
            f"{cp_dim!r}), got {type(mesh).__name__} with dims {tuple(names)}; see `dp_dim`, `cp_dim`"
        )
    if mesh.ndim == 1:
        return mesh, 1
    return mesh[dp_dim, cp_dim]._flatten(f"{dp_dim}_{cp_dim}"), mesh[dp_dim].size()


def gradient_divide_factor(
    mesh: DeviceMesh, *, global_num_items: bool = False, dp_dim: str = "dp", cp_dim: str = "cp"
) -> int:
    """What the gradients summed over every dp x cp rank are divided by: the DP size, or 1 when
    each rank's loss is already its share of the mean over all DP batches (`global_num_items`)."""
    _, dp = _flat_mesh(mesh, dp_dim, cp_dim)
    return 1 if global_num_items else dp


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    global_num_items: bool = False,
    dp_dim: str = "dp",
    cp_dim: str = "cp",
    **fsdp_kwargs,
) -> nn.Module:
    """FSDP2 over the flattened dp x cp ranks, in place: each decoder layer (the classes in the
    model's `_no_split_modules`, as transformers names them) and then the root are `fully_shard`ed
    with `fsdp_kwargs`, and every FSDP module's gradient divide factor is set (table above). On
    backends without a pre-scaled sum (gloo), reductions use a plain sum and FSDP2 divides
    afterwards. Returns the model."""
    flat = _flat_mesh(mesh, dp_dim, cp_dim)[0]
    factor = gradient_divide_factor(mesh, global_num_items=global_num_items, dp_dim=dp_dim, cp_dim=cp_dim)
    layers = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in layers:
            fully_shard(module, mesh=flat, **fsdp_kwargs)
    fully_shard(model, mesh=flat, **fsdp_kwargs)
    plain_sum = dist.get_backend(flat.get_group()) != "nccl"
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(factor))
            module.set_force_sum_reduction_for_comms(plain_sum)
    return model


def _all_reduce_divided(state, bucket):
    """DDP comm hook: the bucket divided by `factor`, then summed over `group`."""
    group, factor = state
    buffer = bucket.buffer()
    if factor != 1:
        buffer.div_(factor)
    work = dist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


def apply_ddp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    global_num_items: bool = False,
    dp_dim: str = "dp",
    cp_dim: str = "cp",
    **ddp_kwargs,
) -> nn.Module:
    """DistributedDataParallel over the flattened dp x cp ranks, with a comm hook that divides by
    the factor of the table above instead of DDP's group size. Returns the DDP module (call it as
    the model: `ddp(**local).loss`). `ddp_kwargs` go to DistributedDataParallel (e.g.
    `find_unused_parameters=True` for DeepSeek V3.2, whose indexer is not trained)."""
    flat = _flat_mesh(mesh, dp_dim, cp_dim)[0]
    factor = gradient_divide_factor(mesh, global_num_items=global_num_items, dp_dim=dp_dim, cp_dim=cp_dim)
    ddp = DistributedDataParallel(model, process_group=flat.get_group(), **ddp_kwargs)
    ddp.register_comm_hook((flat.get_group(), factor), _all_reduce_divided)
    return ddp
