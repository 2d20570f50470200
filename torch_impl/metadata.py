"""gather_metadata: the sequence gather for positions, masks and indexer projections, no autograd."""

from torch_impl import _group
from torch_impl.sequence import all_gather


def gather_metadata(x, group):
    """Gather non-differentiable positions, masks or indexer projections.

    forward: all-gather; no backward.

    Args:
        x: [batch, local_sequence, ...] of any dtype (bool, integer, float), not requiring grad.
        group: the CP process group, or None for a single rank (no CP).

    Returns:
        [batch, n * local_sequence, ...], dtype of x; x itself without CP. With batch > 1 a strided
        view of a sequence-major buffer, as for gather_sequence.
    """
    _group.check_shard(x)
    _group.check_group(group)
    if x.requires_grad:
        raise ValueError(
            "`x` must not require grad in gather_metadata (it has no backward); "
            "use gather_sequence for differentiable tensors, or pass x.detach()"
        )
    return all_gather(x, group)
