"""gather_sequence: forward all-gather into one allocation, backward reduce-scatter."""

import torch

from torch_impl import _group, validation


def all_gather(x, group):
    """x: [B, L, ...] -> [B, n*L, ...], filled by one all_gather_single.

    The buffer is sequence-major, so every rank's shard lands in one contiguous block; the result is
    its transposed view (contiguous when B == 1). B > 1 stages one copy of the local shard.
    """
    n = _group.world_size(group)
    if n == 1:
        return x
    xs = _group.seq_major(x)  # [L, B, ...]
    out = xs.new_empty((n * xs.shape[0], *xs.shape[1:]))  # [n*L, B, ...]
    _group.all_gather_single(out, xs, group=group)
    return out.transpose(0, 1)  # [B, n*L, ...]


def reduce_scatter(grad, group):
    """grad: [B, n*L, ...] -> [B, L, ...]: this rank's block summed over ranks (one reduce_scatter_single)."""
    n = _group.world_size(group)
    if n == 1:
        return grad
    gs = _group.seq_major(grad)  # [n*L, B, ...]
    out = gs.new_empty((gs.shape[0] // n, *gs.shape[1:]))  # [L, B, ...]
    _group.reduce_scatter_single(out, gs, group=group)
    return out.transpose(0, 1)  # [B, L, ...]


class _GatherSequence(torch.autograd.Function):
    """Gather directly into one allocation; reduce-scatter the backward gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, group)

    @staticmethod
    def backward(ctx, grad_output):
        return reduce_scatter(grad_output, ctx.group), None


def gather_sequence(x, group, *, validate=None):
    """Gather contiguous sequence shards with their autograd edges.

    forward: all-gather; backward: reduce-scatter.

    Args:
        x: [batch, local_sequence, ...], rank r holding global tokens [r*L, (r+1)*L).
        group: the CP process group (or a 1-D DeviceMesh), or None for a single rank (no CP).
        validate: check first that all CP ranks called with matching inputs (see
            torch_impl.validation); None follows the CP_TRANSPORT_VALIDATE environment variable.

    Returns:
        [batch, n * local_sequence, ...] with the shards in group-rank order, dtype of x. Without CP
        (None or a group of size 1) it is x itself. With batch > 1 it is a strided view of a
        sequence-major buffer; call .contiguous() if batch-major memory is needed.

    Backward: rank r's gradient is the sum over ranks k of grad_out_k[:, r*L:(r+1)*L].
    """
    group = _group.resolve_group(group)
    validation.check("gather_sequence", group, validate, x)
    if _group.world_size(group) == 1:
        return x
    return _GatherSequence.apply(x, group)
