"""make bench's baselines (the list-and-cat, functional, DTensor and neighbour-ring gathers, a full
gather then sliced) and floors (the bare collectives, no autograd): what torch_impl is measured against."""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.nn.functional as dist_nn

from torch_impl import halo_plan
from torch_impl.halo import start_exchange
from torch_impl.layout import ShardPlan

# --- the baselines ----------------------------------------------------------------------------


def list_cat(x, group):
    return torch.cat(dist_nn.all_gather(x, group=group), dim=1)  # n parts, then one more copy


def funcol_gather(x, group):
    return funcol.wait_tensor(funcol.all_gather_tensor_autograd(x, gather_dim=1, group=group))


def dtensor_gather(x, group):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = DeviceMesh.from_group(group, x.device.type)
    full = DTensor.from_local(x, mesh, [Shard(1)]).redistribute(mesh, [Replicate()])
    return full.to_local(grad_placements=[Partial()])


def full_then_slice(x, group, halo_size):
    n, r, L = dist.get_world_size(group), dist.get_rank(group), x.shape[1]
    (window,) = ShardPlan.of("contiguous", n, r, L).windows(halo_size)
    return list_cat(x, group)[:, window.keys]  # [B, h + L, D]


class _NeighbourRing(torch.autograd.Function):
    """Rank r receives rank r-1's whole shard and concatenates it in front of its own."""

    @staticmethod
    def forward(ctx, x, group):
        r, n = dist.get_rank(group), dist.get_world_size(group)
        ctx.group = group
        prev = torch.empty_like(x) if r > 0 else None
        sends = [(r + 1, x.contiguous())] if r < n - 1 else []
        for work in start_exchange(sends, [(r - 1, prev)] if r > 0 else [], group):
            work.wait()
        return torch.cat([prev, x], dim=1) if r > 0 else x.clone()

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        r, n = dist.get_rank(group), dist.get_world_size(group)
        L = grad.shape[1] // (2 if r > 0 else 1)
        from_next = torch.empty_like(grad[:, -L:]) if r < n - 1 else None
        sends = [(r - 1, grad[:, :L].contiguous())] if r > 0 else []
        for work in start_exchange(sends, [(r + 1, from_next)] if r < n - 1 else [], group):
            work.wait()
        grad_x = grad[:, -L:]
        return (grad_x + from_next if from_next is not None else grad_x), None


def neighbour_ring(x, group, halo_size):
    h = min(dist.get_rank(group) * x.shape[1], halo_size)
    y = _NeighbourRing.apply(x, group)
    return y[:, y.shape[1] - x.shape[1] - h :]


# --- the floors: bare transport, no autograd --------------------------------------------------


class RawSequence:
    """all_gather_single (+ reduce_scatter_single) on a staged input; into preallocated buffers, or,
    with fresh=True, into new ones each call (what any gather that returns a new tensor pays)."""

    def __init__(self, x, group, fresh=False):
        self.n, self.group, self.fresh = dist.get_world_size(group), group, fresh
        self.x = x.transpose(0, 1).contiguous()  # [L, B, D], staged once
        self.out = self.x.new_empty((self.n * self.x.shape[0], *self.x.shape[1:]))  # [n*L, B, D]
        self.grad = torch.empty_like(self.x)  # [L, B, D]

    def forward(self):
        out = torch.empty_like(self.out) if self.fresh else self.out
        dist.all_gather_single(out, self.x, group=self.group)
        return out

    def forward_backward(self):
        out = self.forward()
        grad = torch.empty_like(self.grad) if self.fresh else self.grad
        dist.reduce_scatter_single(grad, out, group=self.group)


class RawHalo:
    def __init__(self, x, group, halo_size):
        r, L = dist.get_rank(group), x.shape[1]
        self.group, self.r = group, r
        self.plan = halo_plan(dist.get_world_size(group), L, halo_size)
        self.x = x.transpose(0, 1).contiguous()  # [L, B, D]
        self.halo = self.x.new_empty((min(r * L, halo_size), *self.x.shape[1:]))  # [h, B, D]
        self.back = {t: self.x.new_empty((t.length, *self.x.shape[1:])) for t in self.plan if t.src == r}

    def _run(self, pairs):
        for work in start_exchange(*pairs, self.group):
            work.wait()

    def forward(self):
        r, L = self.r, self.x.shape[0]
        sends = [(t.dst, self.x[L - t.length :]) for t in self.plan if t.src == r]
        recvs = [(t.src, self.halo[t.dst_start : t.dst_start + t.length]) for t in self.plan if t.dst == r]
        self._run((sends, recvs))

    def forward_backward(self):
        self.forward()
        sends = [
            (t.src, self.halo[t.dst_start : t.dst_start + t.length]) for t in self.plan if t.dst == self.r
        ]
        self._run((sends, [(t.dst, buf) for t, buf in self.back.items()]))
