"""Memory-bounded sequence transport for context parallelism, on torch.distributed.

A sequence of n * L tokens is split into n equal contiguous shards, one per CP rank: rank r holds
x: [batch, L, ...] with the global tokens [r*L, (r+1)*L).

| function          | forward                         | backward                                 |
|-------------------|---------------------------------|------------------------------------------|
| `gather_sequence` | all_gather_single, one buffer   | reduce_scatter_single                    |
| `gather_halo`     | p2p: only the preceding window  | p2p back to the owners, added            |
| `gather_metadata` | all_gather_single               | none (inputs must not require grad)      |

`jax_reference` defines these semantics; the parity suite checks this package against it.
"""

from torch_impl.halo import Transfer, _GatherHalo, gather_halo, halo_plan
from torch_impl.metadata import gather_metadata
from torch_impl.sequence import _GatherSequence, gather_sequence

__all__ = [
    "Transfer",
    "_GatherHalo",
    "_GatherSequence",
    "gather_halo",
    "gather_metadata",
    "gather_sequence",
    "halo_plan",
]
