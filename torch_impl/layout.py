"""Sequence layouts: which global tokens each CP rank holds, as chunks of the sequence.

| layout       | rank r of n holds, in local order | chunk length C | chunks |
|--------------|-----------------------------------|----------------|--------|
| `contiguous` | chunk r                           | L              | n      |
| `head_tail`  | chunks r and 2n-1-r               | L / 2          | 2n     |

Chunk j is the global tokens [jC, (j+1)C). `head_tail` balances causal attention work: a rank's
head queries see few keys, its tail queries many (the assignment of torch's head-tail load balancer
and Megatron's). `jax_reference` defines the semantics of both.
"""

import torch

LAYOUTS = ("contiguous", "head_tail")


def check(layout, local_len=None):
    """ValueError unless `layout` is known and (head_tail) the local length splits into two chunks."""
    if layout not in LAYOUTS:
        raise ValueError(f"`layout` must be one of {LAYOUTS}, got {layout!r}")
    if layout == "head_tail" and local_len is not None and local_len % 2:
        raise ValueError(
            f"`layout='head_tail'` needs an even local_sequence (a head and a tail chunk), got {local_len}"
        )


def chunks(layout, n, r):
    """The global chunk indices rank r holds, in local order."""
    return (r,) if layout == "contiguous" else (r, 2 * n - 1 - r)


def chunk_len(layout, local_len):
    return local_len if layout == "contiguous" else local_len // 2


def global_rows(layout, n, r, local_len, device=None):
    """int64 [L]: the global position of each of rank r's local rows."""
    C = chunk_len(layout, local_len)
    return torch.cat([torch.arange(c * C, (c + 1) * C, device=device) for c in chunks(layout, n, r)])
