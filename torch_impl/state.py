"""gather_state: a linear recurrence's state at each local chunk's start, from the earlier chunks'
affine maps (one all-gather of the maps, a fold in global chunk order), with exact gradients."""

import torch

from torch_impl import _group, validation
from torch_impl.layout import ShardPlan
from torch_impl.sequence import _GatherSequence


def gather_state(
    A: torch.Tensor,
    B: torch.Tensor,
    group: _group.Group,
    *,
    layout: str = "contiguous",
    validate: bool | None = None,
) -> torch.Tensor:
    """The state each local chunk of a linear recurrence starts from, given every chunk's map.

    Over a chunk c a linear recurrence (Gated DeltaNet, KDA, Mamba) maps the state it starts from
    to the one it ends with, S_out = A_c @ S_in + B_c (per head: A_c [dk, dk], the ordered product
    of the chunk's transitions; B_c [dk, dv], its final state from a zero one). Chunk c of the
    global sequence starts from S_c: S_0 = 0, S_{c+1} = A_c @ S_c + B_c in global chunk order.

    forward: the maps, A and B side by side, in one all-gather (n * k maps of m * (m + p) values
    per batch row and leading index, whatever the sequence length), folded in global order on every
    rank; backward: one reduce-scatter returns each map's gradient, summed over the ranks that
    folded through it, to its owner.

    Args:
        A: [batch, k, ..., m, m], the rank's k local chunks' transitions (k = 1; 2 under
            head_tail: chunks r and 2n-1-r, in that order), any leading dims (heads) between.
        B: [batch, k, ..., m, p], their final states from zero, A's dtype and device.
        group: the CP process group (or a 1-D DeviceMesh), or None for a single rank (no CP).
        layout: "contiguous" or "head_tail" (torch_impl.layout).
        validate: check first that all CP ranks called with matching inputs (torch_impl.validation);
            None follows the CP_TRANSPORT_VALIDATE environment variable.

    Returns:
        [batch, k, ..., m, p], the state each local chunk starts from; A's dtype. Rank 0's first
        chunk starts from zeros (without CP under contiguous, nothing else: zeros that do not
        depend on A and B).
    """
    group = _group.resolve_group(group)
    validation.check("gather_state", group, validate, (A, B), layout=layout)
    n, r, m = _group.world_size(group), _group.rank(group), A.shape[-1]
    maps = torch.cat([A, B], dim=-1)  # [batch, k, ..., m, m + p]
    if n > 1:
        maps = _GatherSequence.apply(maps, group, layout)  # [batch, N, ..., m, m + p], global order
    states = [B.new_zeros(B[:, 0].shape)]  # [batch, ..., m, p] each
    for c in range(maps.shape[1] - 1):
        states.append(torch.matmul(maps[:, c, ..., :m], states[-1]) + maps[:, c, ..., m:])
    # taken from all of them, so that every rank's backward reaches the gather's reduce-scatter
    mine = list(ShardPlan.of(layout, n, r, A.shape[1]).chunks)
    return torch.stack(states, dim=1)[:, mine]
