"""gather_sequence: forward all-gather into one allocation, backward reduce-scatter."""

import torch

from torch_impl import _group, validation


def all_gather(x, group, layout="contiguous"):
    """x: [B, L, ...] -> [B, n*L, ...] in global order, filled by all_gather_single.

    The buffer is sequence-major, so every rank's shard lands in one contiguous block; the result is
    its transposed view (contiguous when B == 1). B > 1 stages one copy of the local shard.
    head_tail: the heads gathered into the first half (chunk r from rank r: in order), the tails
    into the second (rank order is chunk 2n-1, 2n-2, ...), whose blocks are then reversed in place.
    """
    n = _group.world_size(group)
    if n == 1:
        return x
    xs = _group.seq_major(x)  # [L, B, ...]
    out = xs.new_empty((n * xs.shape[0], *xs.shape[1:]))  # [n*L, B, ...]
    if layout == "contiguous":
        _group.all_gather_single(out, xs, group=group)
        return out.transpose(0, 1)  # [B, n*L, ...]
    C, half = xs.shape[0] // 2, out.shape[0] // 2
    _group.all_gather_single(out[:half], xs[:C], group=group)  # heads: chunks 0 .. n-1
    _group.all_gather_single(out[half:], xs[C:], group=group)  # tails: chunks 2n-1 .. n
    _reverse_blocks(out[half:], n)
    return out.transpose(0, 1)  # [B, n*L, ...]


def _reverse_blocks(t, n):
    """Reverse the order of t's n equal blocks along dim 0, in place, swapping them through a
    scratch of an eighth of a block (the peak stays within 1 + 1/(16n) of the gathered sequence)."""
    blocks = t.unflatten(0, (n, -1))  # [n, C, ...]
    step = max(1, -(-blocks.shape[1] // 8))
    scratch = torch.empty_like(blocks[0, :step])
    for i in range(n // 2):
        for row in range(0, blocks.shape[1], step):
            a, b = blocks[i, row : row + step], blocks[n - 1 - i, row : row + step]
            part = scratch[: a.shape[0]]
            part.copy_(a)
            a.copy_(b)
            b.copy_(part)


def reduce_scatter(grad, group, layout="contiguous"):
    """grad: [B, n*L, ...] (global order) -> [B, L, ...]: this rank's chunks summed over ranks, by
    reduce_scatter_single (head_tail: one for the heads, one for the tails in rank order)."""
    n = _group.world_size(group)
    if n == 1:
        return grad
    gs = _group.seq_major(grad)  # [n*L, B, ...]
    out = gs.new_empty((gs.shape[0] // n, *gs.shape[1:]))  # [L, B, ...]
    if layout == "contiguous":
        _group.reduce_scatter_single(out, gs, group=group)
        return out.transpose(0, 1)  # [B, L, ...]
    C, half = out.shape[0] // 2, gs.shape[0] // 2
    _group.reduce_scatter_single(out[:C], gs[:half], group=group)
    tails = gs[half:]
    if (
        torch.compiler.is_compiling()
        or tails.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr()
    ):
        tails = tails.clone()  # a view of grad_output, which is not ours to reorder
    _reverse_blocks(tails, n)  # rank order
    _group.reduce_scatter_single(out[C:], tails, group=group)
    return out.transpose(0, 1)  # [B, L, ...]


class _GatherSequence(torch.autograd.Function):
    """Gather directly into one allocation; reduce-scatter the backward gradient."""

    @staticmethod
    def forward(ctx, x, group, layout):
        ctx.group, ctx.layout = group, layout
        return all_gather(x, group, layout)

    @staticmethod
    def backward(ctx, grad_output):
        return reduce_scatter(grad_output, ctx.group, ctx.layout), None, None


def gather_sequence(
    x: torch.Tensor, group: _group.Group, *, layout: str = "contiguous", validate: bool | None = None
) -> torch.Tensor:
    """Gather contiguous sequence shards with their autograd edges.

    forward: all-gather; backward: reduce-scatter.

    Args:
        x: [batch, local_sequence, ...], rank r's chunks of the global sequence (`layout`).
        group: the CP process group (or a 1-D DeviceMesh), or None for a single rank (no CP).
        layout: "contiguous" (rank r holds global tokens [r*L, (r+1)*L)) or "head_tail" (chunks r
            and 2n-1-r of L/2 tokens; torch_impl.layout).
        validate: check first that all CP ranks called with matching inputs (see
            torch_impl.validation); None follows the CP_TRANSPORT_VALIDATE environment variable.

    Returns:
        [batch, n * local_sequence, ...], the global sequence in order, dtype of x. Without CP
        (None or a group of size 1) it is x itself. With batch > 1 it is a strided view of a
        sequence-major buffer; call .contiguous() if batch-major memory is needed.

    Backward: the gradient of each of rank r's tokens is the sum over ranks k of grad_out_k at
    that token's global position.
    """
    group = _group.resolve_group(group)
    validation.check("gather_sequence", group, validate, x, layout=layout)
    if _group.world_size(group) == 1:
        return x
    return _GatherSequence.apply(x, group, layout)
