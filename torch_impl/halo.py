"""gather_halo: only the preceding causal window, by point-to-point transport, with exact gradients."""

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from torch_impl import _group, validation


class Transfer(NamedTuple):
    """One piece of a halo: the last `length` tokens of rank `src`'s shard, for rank `dst`'s halo."""

    src: int  # group rank that owns the tokens; it sends its local tokens [L - length, L)
    dst: int  # group rank whose halo holds them, at halo positions [dst_start, dst_start + length)
    dst_start: int
    length: int


def halo_plan(world_size, local_len, halo_size):
    """Every transfer of a halo exchange, for both directions: forward src -> dst, backward dst -> src.

    Rank r's halo is the global tokens [r*L - h, r*L) with h = min(r*L, halo_size). The rank s places
    earlier sends its last min(L, h - (s-1)*L) tokens, which land right before those of rank r - s + 1.
    """
    plan = []
    for dst in range(1, world_size):
        h = min(dst * local_len, halo_size)
        for s in range(1, dst + 1):
            length = min(local_len, h - (s - 1) * local_len)
            if length <= 0:
                break
            plan.append(Transfer(dst - s, dst, h - (s - 1) * local_len - length, length))
    return tuple(plan)


def start_exchange(sends, recvs, group):
    """Post every (peer group rank, tensor) send and receive as one batch; returns the work handles."""
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, peer), group) for peer, t in sends]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, peer), group) for peer, t in recvs]
    return dist.batch_isend_irecv(ops) if ops else []


def _halo_forward(x, group, plan, halo_len, left_padding):
    """x: [B, L, ...] -> [B, left_padding + halo_len + L, ...]; pieces land in views of one buffer."""
    r, L = _group.rank(group), x.shape[1]
    sent = [t for t in plan if t.src == r]
    longest = max([t.length for t in sent] + [0])
    tail = _group.seq_major(x[:, L - longest :])  # [longest, B, ...]; a view when B == 1
    out = x.new_empty((left_padding + halo_len + L, x.shape[0], *x.shape[2:]))  # [T, B, ...]
    halo = out[left_padding : left_padding + halo_len]  # [halo_len, B, ...]
    works = start_exchange(
        [(t.dst, tail[longest - t.length :]) for t in sent],  # [length, B, ...]
        [(t.src, halo[t.dst_start : t.dst_start + t.length]) for t in plan if t.dst == r],
        group,
    )
    out[:left_padding].zero_()  # [left_padding, B, ...]
    out[left_padding + halo_len :].copy_(x.transpose(0, 1))  # [L, B, ...]
    for work in works:
        work.wait()
    return out.transpose(0, 1)  # [B, T, ...]


def _halo_backward(grad, group, plan, halo_len, left_padding):
    """grad: [B, left_padding + halo_len + L, ...] -> [B, L, ...]: local part plus the returned halo grads."""
    r = _group.rank(group)
    local = grad[:, left_padding + halo_len :].transpose(0, 1)  # [L, B, ...]
    halo = grad[:, left_padding : left_padding + halo_len]  # [B, halo_len, ...]
    returned = [t for t in plan if t.src == r]  # the tails this rank sent; their grads come back
    bufs = [local.new_empty((t.length, *local.shape[1:])) for t in returned]  # [length, B, ...]
    works = start_exchange(
        [
            (t.src, _group.seq_major(halo[:, t.dst_start : t.dst_start + t.length]))
            for t in plan
            if t.dst == r
        ],
        [(t.dst, buf) for t, buf in zip(returned, bufs, strict=True)],
        group,
    )
    if returned:  # grad_output is not ours to add into
        local = local.clone(memory_format=torch.contiguous_format)  # [L, B, ...]
    for work in works:
        work.wait()
    for buf in bufs:
        local[local.shape[0] - buf.shape[0] :] += buf  # [length, B, ...]: the tail that was sent
    return local.transpose(0, 1)  # [B, L, ...]


def halo_all_to_all(x, group, halo_size, left_padding=0):
    """gather_halo's exchange as one functional all_to_all_single: the path torch.compile traces.

    Each rank sends every peer the tail that peer's halo needs and receives its own halo, with the
    per-peer split sizes of halo_plan (zero for every pair that exchanges nothing, so the payload
    is the same minimum). Pieces arrive in rank order, which is halo order (farthest first).
    Backward: the all_to_all with the splits swapped returns each piece's gradient to its owner,
    where autograd adds it onto the tail it came from. Same arguments and result as gather_halo.
    """
    n, r, L = _group.world_size(group), _group.rank(group), x.shape[1]
    sends, recvs = [0] * n, [0] * n
    for t in halo_plan(n, L, halo_size):
        if t.src == r:
            sends[t.dst] = t.length
        if t.dst == r:
            recvs[t.src] = t.length
    xs = x.transpose(0, 1)  # [L, B, ...]
    tails = torch.cat([xs[L - k :] for k in sends])  # [sum(sends), B, ...], one tail per peer in order
    halo = funcol.all_to_all_single_autograd(tails, recvs, sends, group)  # [h, B, ...]
    zeros = xs.new_zeros((left_padding, *xs.shape[1:]))  # [left_padding, B, ...]
    return torch.cat([zeros, halo, xs]).transpose(0, 1)  # [B, left_padding + h + L, ...]


class _GatherHalo(torch.autograd.Function):
    """Exchange only the preceding window and return its gradients to its owners.

    Forward: (1) plan the transfers; (2) post sends of this rank's needed tails and receives straight
    into the halo's views of one output buffer; (3) zero the padding and copy x behind the halo.
    Backward: (1) the same plan; (2) send each halo piece's gradient back to its owner; (3) add the
    received gradients onto the tails of a copy of the local part's gradient.
    """

    @staticmethod
    def forward(ctx, x, group, halo_size, left_padding):
        ctx.group, ctx.left_padding = group, left_padding
        ctx.plan = halo_plan(_group.world_size(group), x.shape[1], halo_size)
        ctx.halo_len = min(_group.rank(group) * x.shape[1], halo_size)
        return _halo_forward(x, group, ctx.plan, ctx.halo_len, left_padding)

    @staticmethod
    def backward(ctx, grad_output):
        grad_x = _halo_backward(grad_output, ctx.group, ctx.plan, ctx.halo_len, ctx.left_padding)
        return grad_x, None, None, None


def gather_halo(x, group, halo_size, left_padding=0, *, validate=None):
    """Prepend only the preceding causal window using point-to-point transport.

    forward: p2p receives from ranks r-1, r-2, ... (ceil(halo_size/L) at most, each sending only the
    tail needed); backward: the same pieces' gradients sent back to their owners and added.

    Args:
        x: [batch, local_sequence, ...], rank r holding global tokens [r*L, (r+1)*L).
        group: the CP process group (or a 1-D DeviceMesh), or None for a single rank (no CP).
        halo_size: most preceding tokens to fetch, normally window - 1 (attention) or kernel - 1 (conv).
        left_padding: zero positions made locally before the halo (never sent), e.g. to align a
            key tile with global key coordinates. It may differ between ranks.
        validate: check first that all CP ranks called with matching inputs (see
            torch_impl.validation); None follows the CP_TRANSPORT_VALIDATE environment variable.

    Returns:
        [batch, left_padding + h + local_sequence, ...] with h = min(r * local_sequence, halo_size):
        left_padding zeros, the global tokens [r*L - h, r*L), then x; dtype of x. Without CP it is x
        itself when left_padding == 0. With batch > 1 it is a strided view of a sequence-major buffer.

    Backward: the gradient of the local part plus, from every later rank whose halo held some of this
    rank's tokens, the gradient of those tokens. The zeros' gradient is dropped.
    """
    group = _group.resolve_group(group)
    validation.check("gather_halo", group, validate, x, halo_size, left_padding)
    if _group.world_size(group) == 1 and left_padding == 0:
        return x
    if torch.compiler.is_compiling():
        return halo_all_to_all(x, group, halo_size, left_padding)
    return _GatherHalo.apply(x, group, halo_size, left_padding)
