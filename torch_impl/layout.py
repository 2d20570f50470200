"""Sequence layouts: which global tokens each CP rank holds, as chunks of the sequence.

| layout       | rank r of n holds, in local order | chunk length C | chunks |
|--------------|-----------------------------------|----------------|--------|
| `contiguous` | chunk r                           | L              | n      |
| `head_tail`  | chunks r and 2n-1-r               | L / 2          | 2n     |

Chunk j is the global tokens [jC, (j+1)C). `head_tail` balances causal attention work: a rank's
head queries see few keys, its tail queries many (the assignment of torch's head-tail load balancer
and Megatron's). `jax_reference` defines the semantics of both.

`ShardPlan` is the one answer to "which global rows does rank r hold, and which keys does a layer
reaching h tokens back give each of its chunks": the transport, torch_impl.hf, the baselines and
the benchmarks ask it instead of computing offsets themselves. A reach is one int for every chunk,
or one per global chunk (packed documents: `document_reach`, how far back each chunk's first
document began), so that a chunk whose document starts late fetches only that document's keys.
"""

from collections.abc import Sequence
from typing import NamedTuple

import torch

LAYOUTS = ("contiguous", "head_tail")


def check(layout: str, local_len: int | None = None) -> None:
    """ValueError unless `layout` is known and (head_tail) the local length splits into two chunks."""
    if layout not in LAYOUTS:
        raise ValueError(f"`layout` must be one of {LAYOUTS}, got {layout!r}")
    if layout == "head_tail" and local_len is not None and local_len % 2:
        raise ValueError(
            f"`layout='head_tail'` needs an even local_sequence (a head and a tail chunk), got {local_len}"
        )


class Window(NamedTuple):
    """One local chunk's queries and the keys a layer of reach h gives them (global rows
    [first_key, end + after): the h' = min(start, h) tokens before the chunk, the chunk, and the
    `after` tokens following it that a lookahead asks)."""

    chunk: int  # global chunk index c
    queries: slice  # the chunk's rows among the rank's local tokens
    start: int  # global row of its first token, c*C
    first_key: int  # global row of its first key, start - h'
    end: int  # one past its last token
    segment: slice  # its rows in gather_halo(x, h, left_padding)'s output: zeros, window, chunk, after
    after: int = 0  # how many tokens after the chunk (gather_halo's lookahead)

    @property
    def halo(self):
        """h': how many tokens before the chunk its window holds."""
        return self.start - self.first_key

    @property
    def keys(self):
        """Its keys' global rows [first_key, end + after), e.g. in a gathered sequence."""
        return slice(self.first_key, self.end + self.after)

    @property
    def window_rows(self):
        """The window's rows within its segment (after the zeros, before the chunk)."""
        return slice(self.own.start - self.halo, self.own.start)

    @property
    def own(self):
        """The chunk's rows within its segment (after the zeros and the window, before the lookahead)."""
        stop = self.segment.stop - self.after
        return slice(stop - (self.end - self.start), stop)


class ShardPlan(NamedTuple):
    """Rank r of n's shard of the sequence under a layout: local_len tokens in chunks of chunk_len."""

    layout: str
    n: int
    r: int
    local_len: int

    @classmethod
    def of(cls, layout: str, n: int, r: int, local_len: int) -> "ShardPlan":
        check(layout, local_len)
        return cls(layout, n, r, local_len)

    @property
    def chunk_len(self):
        return self.local_len if self.layout == "contiguous" else self.local_len // 2

    @property
    def chunks(self):
        """The global chunk indices the rank holds, in local order."""
        return (self.r,) if self.layout == "contiguous" else (self.r, 2 * self.n - 1 - self.r)

    def rows(self, device: torch.device | str | None = None) -> torch.Tensor:
        """int64 [L]: the global row of each local token."""
        C = self.chunk_len
        return torch.cat([torch.arange(c * C, (c + 1) * C, device=device) for c in self.chunks])

    @property
    def end(self):
        """One past the rank's last global row: its queries' causal prefix is rows [0, end)."""
        return (max(self.chunks) + 1) * self.chunk_len

    @property
    def num_chunks(self):
        """How many chunks the whole sequence has (n contiguous, 2n head_tail)."""
        return self.n if self.layout == "contiguous" else 2 * self.n

    def windows(
        self,
        reach: int | Sequence[int] | None = None,
        left_padding: int = 0,
        lookahead: int | Sequence[int] = 0,
    ) -> tuple[Window, ...]:
        """Per local chunk, its Window for a layer that reaches `reach` tokens back (a window W:
        W - 1; a conv of kernel K: K - 1; None: the whole causal prefix, keys from row 0; a
        sequence: reach[c] for global chunk c) and `lookahead` tokens forward (an int, or
        lookahead[c]), with the segments of gather_halo(x, reach, left_padding, lookahead=...)'s
        output."""
        C, S, row, out = self.chunk_len, self.n * self.local_len, 0, []
        for k, c in enumerate(self.chunks):
            start = c * C
            h = reach if reach is None or isinstance(reach, int) else reach[c]
            a = min(lookahead if isinstance(lookahead, int) else lookahead[c], S - start - C)
            first_key = 0 if h is None else start - min(start, h)
            length = left_padding + start - first_key + C + a
            rows = slice(row, row + length)
            out.append(Window(c, slice(k * C, (k + 1) * C), start, first_key, start + C, rows, a))
            row += length
        return tuple(out)


def document_starts(documents: torch.Tensor) -> torch.Tensor:
    """int64 [B, T]: for each position, the first position of its document, where documents (int
    [B, T]) numbers each row's documents as runs of equal ids (transformers'
    find_packed_sequence_indices). A document cut off at position 0 starts there."""
    T = documents.shape[1]
    begins = torch.ones_like(documents, dtype=torch.bool)  # [B, T]
    begins[:, 1:] = documents[:, 1:] != documents[:, :-1]
    rows = torch.arange(T, device=documents.device).expand_as(documents)
    return torch.where(begins, rows, 0).cummax(dim=1).values  # [B, T]


def document_reach(documents: torch.Tensor, chunk_len: int) -> tuple[int, ...]:
    """Per global chunk c of chunk_len tokens, how many tokens before its first one (row c*C) that
    token's document began, the largest over the batch's rows: a tuple of Python ints, the same on
    every rank that holds the same documents (int [B, S] in global order, runs of equal ids).

    A full attention layer's chunk c sees nothing before row c*C - reach[c] (every later query's
    document starts no earlier); a window W's chunk nothing before c*C - min(reach[c], W - 1).
    """
    if documents.shape[1] > 1 and bool((documents[:, 1:] < documents[:, :-1]).any()):
        raise ValueError("`documents` must be non-decreasing along each row (each document one run of ids)")
    return tuple(reach_of(documents, chunk_len).tolist())


def reach_of(documents: torch.Tensor, chunk_len: int) -> torch.Tensor:
    """document_reach's values as an int64 tensor [chunks] on the documents' device (no host read;
    the documents are runs of ids, unchecked)."""
    firsts = document_starts(documents)[:, ::chunk_len]  # [B, chunks]: at each chunk's first row
    starts = torch.arange(0, documents.shape[1], chunk_len, device=documents.device)  # [chunks]
    return (starts - firsts).amax(dim=0)


def packed_ids(positions: torch.Tensor) -> torch.Tensor:
    """int64 [B, S]: the document of every token of packed rows, from their positions [B, S] in
    global order, numbered as transformers' find_packed_sequence_indices numbers them: a new
    document wherever a position is not its predecessor's plus one (no host read)."""
    first = positions[:, :1] - 1  # [B, 1]: as if a token before the first
    return (torch.diff(positions, prepend=first, dim=-1) != 1).cumsum(dim=-1)


class Documents(NamedTuple):
    """A batch's packed documents, the same on every CP rank (built from the gathered positions)."""

    ids: torch.Tensor  # int [B, S] by global row: runs of equal ids, one per document
    reach: tuple | None  # per global chunk, document_reach(ids, C); None: unknown (inside torch.compile)
    starts: torch.Tensor | None = None  # int64 [B, S]: document_starts(ids), where made once per forward

    def first_rows(self) -> torch.Tensor:
        """int64 [B, S] by global row: the first row of each token's document (`starts` where given)."""
        return document_starts(self.ids) if self.starts is None else self.starts

    def layer_reach(self, window: int | None = None) -> int | tuple[int, ...] | None:
        """How far back a layer's chunks fetch (ShardPlan.windows' reach): for a window W, W - 1
        capped per chunk by its document's start; None (full attention): the document's start."""
        full = None if window is None else window - 1
        if self.reach is None:
            return full
        return self.reach if full is None else tuple(min(d, full) for d in self.reach)
