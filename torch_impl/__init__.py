"""Memory-bounded sequence transport for context parallelism, on torch.distributed.

A sequence of n * L tokens is split into n equal shards, one per CP rank: by default contiguous,
rank r holding x: [batch, L, ...] with the global tokens [r*L, (r+1)*L); with `layout="head_tail"`
(every function's keyword; `torch_impl.layout`) rank r holds chunks r and 2n-1-r of L/2 tokens.

| function          | forward                         | backward                                 |
|-------------------|---------------------------------|------------------------------------------|
| `gather_sequence` | all_gather_single, one buffer   | reduce_scatter_single                    |
| `gather_halo`     | p2p: only the preceding window  | p2p back to the owners, added            |
|                   | (compiled: one all_to_all)      | (compiled: the reverse all_to_all)       |
| `gather_metadata` | all_gather_single               | none (inputs must not require grad)      |
| `gather_state`    | all_gather_single of each       | reduce_scatter_single: each map's        |
|                   | chunk's recurrence map (A, B),  | gradient summed on its owner             |
|                   | folded in global chunk order    |                                          |
| `sum_sequence`    | local sum, then all_reduce: a   | all_reduce of the ranks' gradients, to   |
|                   | value per batch row, every rank | every token that counted                 |
| `select_position` | the owner's token, all_reduce   | all_reduce, to the owner's token only    |
| `last_position`   | all_reduce (max) of positions   | none (an integer)                        |

`jax_reference` defines these semantics; the parity suite checks this package against it. The
autograd Functions `_GatherHalo` and `_GatherSequence` (as the project's API specification names
them) are importable from here but not public. `torch_impl.attention` is a rank's own causal
attention over the keys these functions bring (no [L, T] mask); `torch_impl.hf` makes Hugging
Face transformers models context-parallel (needs the `[hf]` extra); `torch_impl.layout` says which
rows a rank holds and what each of its chunks reaches (`ShardPlan`).
"""

from torch_impl.halo import Transfer, gather_halo, halo_plan
from torch_impl.halo import _GatherHalo as _GatherHalo  # importable, not public
from torch_impl.metadata import gather_metadata
from torch_impl.reductions import last_position, select_position, sum_sequence
from torch_impl.sequence import _GatherSequence as _GatherSequence  # importable, not public
from torch_impl.sequence import gather_sequence
from torch_impl.state import gather_state

__version__ = "0.1.0"
__all__ = [
    "Transfer",
    "gather_halo",
    "gather_metadata",
    "gather_sequence",
    "gather_state",
    "halo_plan",
    "last_position",
    "select_position",
    "sum_sequence",
]
