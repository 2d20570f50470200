"""gather_metadata: the sequence gather for positions, masks and indexer projections, no autograd."""

import torch

from torch_impl import _group, validation
from torch_impl.sequence import all_gather


def gather_metadata(
    x: torch.Tensor, group: _group.Group, *, layout: str = "contiguous", validate: bool | None = None
) -> torch.Tensor:
    """Gather non-differentiable positions, masks or indexer projections.

    forward: all-gather; no backward.

    Args:
        x: [batch, local_sequence, ...] of any dtype (bool, integer, float), not requiring grad.
        group: the CP process group (or a 1-D DeviceMesh), or None for a single rank (no CP).
        layout: "contiguous" or "head_tail", as for gather_sequence.
        validate: check first that all CP ranks called with matching inputs (see
            torch_impl.validation); None follows the CP_TRANSPORT_VALIDATE environment variable.

    Returns:
        [batch, n * local_sequence, ...] in global order, dtype of x; x itself without CP. With
        batch > 1 a strided view of a sequence-major buffer, as for gather_sequence.
    """
    group = _group.resolve_group(group)
    validation.check("gather_metadata", group, validate, x, layout=layout)
    if x.dtype == torch.bool and _group.world_size(group) > 1 and torch.compiler.is_compiling():
        # compiled, bool travels as bytes, compared back to bool: inductor's CPU code generator
        # (torch 2.13) fails on kernels that load a collective's bool output as a mask
        return all_gather(x.view(torch.uint8), group, layout) != 0
    return all_gather(x, group, layout)
