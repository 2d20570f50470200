"""Reductions over a sharded row: a value per batch row from the whole sequence, on every rank.

A loss that is not a token mean needs them: DPO and KTO sum each row's log-probs over its
completion, a reward model reads the row's last real token. Each rank reduces its own tokens to
[B, ...] and one all-reduce of those values completes the row (bytes independent of the sequence
length). Every rank then holds the same value and uses it in its own way, so backward all-reduces
the ranks' gradients of it: a rank whose loss is its share of the row's loss (the shares adding up
to one process's, as `hf.shard_batch`'s token mean) gets one process's gradient at its tokens.
`jax_reference` defines them (`psum` and its transpose).
"""

import torch
import torch.distributed as dist

from torch_impl import _group, validation
from torch_impl.layout import ShardPlan


def _all_reduce(x, group, op=dist.ReduceOp.SUM):
    """A reduced copy of x over the group (x is not modified)."""
    out = x.clone()
    dist.all_reduce(out, op=op, group=group)
    return out


class _SumOverRanks(torch.autograd.Function):
    """forward: all-reduce (sum); backward: all-reduce (sum) of the ranks' gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


def _along(mask, x):
    """bool [B, L] -> [B, L, 1, ...], broadcasting against x: [B, L, ...]."""
    return mask.reshape(*mask.shape, *(1,) * (x.dim() - 2))


def _positions(x, group, layout):
    """int64 [L]: the global position of each of this rank's tokens (torch_impl.layout)."""
    return ShardPlan.of(layout, _group.world_size(group), _group.rank(group), x.shape[1]).rows(x.device)


def _complete(partial, group):
    """The row values from every rank's partial ones: all-reduced, with the gradient all-reduced
    back; the partial ones themselves without CP."""
    return partial if _group.world_size(group) == 1 else _SumOverRanks.apply(partial, group)


def sum_sequence(
    x: torch.Tensor,
    group: _group.Group,
    mask: torch.Tensor | None = None,
    *,
    validate: bool | None = None,
) -> torch.Tensor:
    """Each row's sum over the whole sequence, on every rank.

    forward: the sum over the local tokens, then all-reduce; backward: all-reduce of the ranks'
    gradients, which every local token (where `mask`) receives.

    Args:
        x: [batch, local_sequence, ...], this rank's tokens (any layout: a sum does not care).
        group: the CP process group (or a 1-D DeviceMesh), or None for a single rank (no CP).
        mask: bool [batch, local_sequence]: the tokens that count (e.g. a completion's); None: all.
        validate: check first that all CP ranks called with matching inputs (torch_impl.validation).

    Returns:
        [batch, ...], dtype of x: the same on every rank. Without CP, x.sum(1) over the mask.
    """
    group = _group.resolve_group(group)
    validation.check("sum_sequence", group, validate, x, mask=mask)
    if mask is not None:
        x = torch.where(_along(mask, x), x, 0)  # [B, L, ...]
    return _complete(x.sum(dim=1, dtype=x.dtype), group)  # [B, ...]


def select_position(
    x: torch.Tensor,
    position: torch.Tensor,
    group: _group.Group,
    *,
    layout: str = "contiguous",
    validate: bool | None = None,
) -> torch.Tensor:
    """Each row's token at one global position, on every rank (e.g. the last real token a reward
    model pools).

    forward: the owner's token (zeros on the other ranks), then all-reduce; backward: all-reduce of
    the ranks' gradients, to that token on its owner (the others' tokens get zeros).

    Args:
        x: [batch, local_sequence, ...], this rank's tokens under `layout`.
        position: int [batch], a global position in [0, n * local_sequence) per row, the same on
            every rank (e.g. from `last_position`).
        group: the CP process group (or a 1-D DeviceMesh), or None for a single rank (no CP).
        layout: "contiguous" or "head_tail" (torch_impl.layout): which positions this rank holds.
        validate: check first that all CP ranks called with matching inputs (torch_impl.validation).

    Returns:
        [batch, ...], dtype of x, exactly the token's value: the same on every rank.
    """
    group = _group.resolve_group(group)
    validation.check("select_position", group, validate, x, layout=layout, position=position)
    owned = _positions(x, group, layout)[None] == position[:, None]  # [B, L]: one True, on one rank
    return _complete(torch.where(_along(owned, x), x, 0).sum(dim=1, dtype=x.dtype), group)  # [B, ...]


def last_position(
    mask: torch.Tensor,
    group: _group.Group,
    *,
    layout: str = "contiguous",
    validate: bool | None = None,
) -> torch.Tensor:
    """Each row's last global position where `mask` is True, on every rank (-1 where none is).

    forward: the local maximum, then all-reduce (max); no backward (an integer).

    Args:
        mask: bool [batch, local_sequence], this rank's tokens under `layout`.
        group: the CP process group (or a 1-D DeviceMesh), or None for a single rank (no CP).
        layout: "contiguous" or "head_tail" (torch_impl.layout).
        validate: check first that all CP ranks called with matching inputs (torch_impl.validation).

    Returns:
        int64 [batch], the same on every rank.
    """
    group = _group.resolve_group(group)
    validation.check("last_position", group, validate, mask, layout=layout)
    found = torch.where(mask, _positions(mask, group, layout)[None], -1).amax(dim=1)  # [B]
    return found if _group.world_size(group) == 1 else _all_reduce(found, group, dist.ReduceOp.MAX)
