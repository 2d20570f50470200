"""gather_halo: only the preceding causal window, by point-to-point transport, with exact gradients."""

from collections.abc import Sequence
import functools
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from torch_impl import _group, validation
from torch_impl.layout import ShardPlan


class Transfer(NamedTuple):
    """One piece of a halo: `length` tokens of rank `src`'s shard, for the window of one of rank
    `dst`'s chunks."""

    src: int  # group rank that owns the tokens
    dst: int  # rank whose chunk's segment holds them, at [dst_start, + length) from its window's start
    dst_start: int  # (past the window and the chunk for a lookahead's piece)
    length: int
    src_start: int  # src's local rows [src_start, + length): a chunk's end (a lookahead's: its start)
    dst_chunk: int = 0  # which of dst's local chunks (head_tail: 0 head, 1 tail)


def halo_plan(
    world_size: int,
    local_len: int,
    halo_size: int | Sequence[int],
    layout: str = "contiguous",
    lookahead: int | Sequence[int] = 0,
) -> tuple[Transfer, ...]:
    """Every transfer of a halo exchange, for both directions: forward src -> dst, backward dst -> src.

    The window of chunk c (C tokens) is the global tokens [first_key, cC), first_key = cC - min(cC,
    h_c) with h_c = halo_size, or halo_size[c] when it is one per global chunk (ShardPlan.windows).
    Each earlier chunk it overlaps, nearest first, gives the rows of it past first_key: the end of
    that chunk, on the rank that holds it. Contiguous: chunk r is rank
    r's shard (C = L), so rank r - s sends its tail. A transfer with src == dst (head_tail: rank
    n-1's tail reaching its own head) is a local copy. The lookahead, the mirror (the a_c tokens
    after chunk c): each later chunk it overlaps, nearest first, gives its start.
    """
    shards = [ShardPlan.of(layout, world_size, r, local_len) for r in range(world_size)]
    C = shards[0].chunk_len
    owner = {c: (shard.r, k) for shard in shards for k, c in enumerate(shard.chunks)}
    plan = []
    for shard in shards:
        for k, w in enumerate(shard.windows(halo_size, lookahead=lookahead)):
            for c in range(w.chunk - 1, -1, -1):  # the chunks before, nearest first
                lo = max(c * C, w.first_key)  # global rows [lo, (c+1)C) of chunk c are in the window
                if lo >= (c + 1) * C:
                    break
                src, p = owner[c]
                length = (c + 1) * C - lo
                plan.append(Transfer(src, shard.r, lo - w.first_key, length, (p + 1) * C - length, k))
            after = -(-w.after // C) if w.after else 0  # how many later chunks (C may be 0)
            for c in range(w.chunk + 1, w.chunk + 1 + after):  # the chunks after, nearest first
                src, p = owner[c]
                length = min(C, w.end + w.after - c * C)  # global rows [cC, cC + length)
                plan.append(Transfer(src, shard.r, c * C - w.first_key, length, p * C, k))
    return tuple(plan)


def start_exchange(sends, recvs, group):
    """Post every (peer group rank, tensor) send and receive as one batch; returns the work handles."""
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, peer), group) for peer, t in sends]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, peer), group) for peer, t in recvs]
    return dist.batch_isend_irecv(ops) if ops else []


def _halo_forward(x, group, plan, windows):
    """x: [B, L, ...] -> [B, sum_k (left_padding + h_k + C + a_k), ...]; pieces land in views of one buffer.
    windows: this rank's ShardPlan.windows(halo_size, left_padding)."""
    r = _group.rank(group)
    T = windows[-1].segment.stop
    sent = [t for t in plan if t.src == r and t.dst != r]
    longest = {}  # end row -> the longest piece ending there it sends: one sequence-major copy each
    for t in sent:
        end = t.src_start + t.length
        longest[end] = max(longest.get(end, 0), t.length)
    tails = {end: _group.seq_major(x[:, end - n : end]) for end, n in longest.items()}  # [n, B, ...]
    out = x.new_empty((T, x.shape[0], *x.shape[2:]))  # [T, B, ...]

    def window(t):
        start = windows[t.dst_chunk].window_rows.start + t.dst_start
        return out[start : start + t.length]

    works = start_exchange(
        [(t.dst, tails[t.src_start + t.length][-t.length :]) for t in sent],  # [length, B, ...]
        [(t.src, window(t)) for t in plan if t.dst == r and t.src != r],
        group,
    )
    xs = x.transpose(0, 1)  # [L, B, ...]
    for w in windows:
        out[w.segment.start : w.window_rows.start].zero_()  # [left_padding, B, ...]
        out[w.own].copy_(xs[w.queries])  # [C, B, ...]
    for t in plan:
        if t.src == t.dst == r:
            window(t).copy_(xs[t.src_start : t.src_start + t.length])
    for work in works:
        work.wait()
    return out.transpose(0, 1)  # [B, T, ...]


def _halo_backward(grad, group, plan, windows):
    """grad: [B, sum_k (left_padding + h_k + C + a_k), ...] -> [B, L, ...]: the local chunks' gradient
    plus the gradients of every window piece this rank's tokens filled."""
    r = _group.rank(group)
    gs = grad.transpose(0, 1)  # [T, B, ...]

    def window(t):
        start = windows[t.dst_chunk].window_rows.start + t.dst_start
        return gs[start : start + t.length]

    own = [gs[w.own] for w in windows]  # [C, B, ...] each
    returned = [t for t in plan if t.src == r and t.dst != r]  # pieces this rank sent: grads come back
    bufs = [gs.new_empty((t.length, *gs.shape[1:])) for t in returned]  # [length, B, ...]
    works = start_exchange(
        [(t.src, window(t).contiguous()) for t in plan if t.dst == r and t.src != r],
        [(t.dst, buf) for t, buf in zip(returned, bufs, strict=True)],
        group,
    )
    selves = [t for t in plan if t.src == t.dst == r]
    if len(own) > 1 or returned or selves:  # grad_output is not ours to add into: a new [L, B, ...]
        local = gs.new_empty((windows[-1].queries.stop, *gs.shape[1:]))  # [L, B, ...]
        for w, g in zip(windows, own, strict=True):
            local[w.queries].copy_(g)  # [C, B, ...]
    else:
        local = own[0]
    for t in selves:
        local[t.src_start : t.src_start + t.length] += window(t)
    for work in works:
        work.wait()
    for t, buf in zip(returned, bufs, strict=True):
        local[t.src_start : t.src_start + t.length] += buf  # the chunk end that was sent
    return local.transpose(0, 1)  # [B, L, ...]


def halo_all_to_all(x, group, halo_size, left_padding=0, layout="contiguous", lookahead=0):
    """gather_halo's exchange as one functional all_to_all_single: the path torch.compile traces.

    Each rank sends every peer the pieces that peer's windows need (in plan order) and receives its
    own, with per-peer split sizes from halo_plan (zero for every pair that exchanges nothing, so
    the payload is the same minimum); pieces from itself are sliced locally. Backward: the
    all_to_all with the splits swapped returns each piece's gradient to its owner, where autograd
    adds it onto the rows it came from. Same arguments and result as gather_halo.
    """
    n, r, L = _group.world_size(group), _group.rank(group), x.shape[1]
    plan = halo_plan(n, L, halo_size, layout, lookahead)
    windows = ShardPlan.of(layout, n, r, L).windows(halo_size, lookahead=lookahead)
    xs = x.transpose(0, 1)  # [L, B, ...]
    outgoing = [[t for t in plan if t.src == r and t.dst == peer != r] for peer in range(n)]
    incoming = [[i for i, t in enumerate(plan) if t.dst == r and t.src == peer != r] for peer in range(n)]
    sends = [sum(t.length for t in ts) for ts in outgoing]
    recvs = [sum(plan[i].length for i in ids) for ids in incoming]
    payload = torch.cat([xs[:0]] + [xs[t.src_start : t.src_start + t.length] for ts in outgoing for t in ts])
    received = funcol.all_to_all_single_autograd(payload, recvs, sends, group)  # [sum(recvs), B, ...]
    row, pieces = 0, {}  # plan index -> its rows, in the order the peers packed them
    for i in (i for ids in incoming for i in ids):
        pieces[i] = received[row : row + plan[i].length]
        row += plan[i].length
    zeros = xs.new_zeros((left_padding, *xs.shape[1:]))  # [left_padding, B, ...]
    # a rank that receives nothing still joins the backward all_to_all: its empty result stays in
    # the graph (else autograd, or the compiler, drops the collective on that rank only)
    segments = [] if row else [received]
    for k, w in enumerate(windows):
        mine = [i for i, t in enumerate(plan) if t.dst == r and t.dst_chunk == k]  # nearest first
        for i in mine:
            t = plan[i]
            if t.src == r:  # a piece of its own chunks
                pieces[i] = xs[t.src_start : t.src_start + t.length]
        window = [pieces[i] for i in mine if plan[i].dst_start < w.halo][::-1]  # farthest first
        after = [pieces[i] for i in mine if plan[i].dst_start >= w.halo]
        segments += [zeros, *window, xs[w.queries], *after]
    return torch.cat(segments).transpose(0, 1)  # [B, sum_k (left_padding + h_k + C + a_k), ...]


@functools.lru_cache(maxsize=1024)
def _exchange(n, r, local_len, halo_size, left_padding, layout, lookahead):
    """halo_plan and rank r's windows, computed once per shape and reach (every layer of a kind, and
    every step of a run, asks the same; halo_size and lookahead an int or a tuple)."""
    shard = ShardPlan.of(layout, n, r, local_len)
    return halo_plan(n, local_len, halo_size, layout, lookahead), shard.windows(
        halo_size, left_padding, lookahead
    )


class _GatherHalo(torch.autograd.Function):
    """Exchange only the preceding windows (and lookaheads) and return their gradients to their owners.

    Forward: (1) plan the transfers; (2) post sends of this rank's needed chunk ends and receives
    straight into the windows' views of one output buffer; (3) zero the padding, copy the chunks
    behind their windows (and pieces of its own chunks, head_tail's rank n-1). Backward: (1) the same
    plan; (2) send each window piece's gradient back to its owner; (3) add the received gradients
    onto the rows they came from, in a copy of the local chunks' gradient.
    """

    @staticmethod
    def forward(ctx, x, group, halo_size, left_padding, layout, lookahead):
        n, r, L = _group.world_size(group), _group.rank(group), x.shape[1]
        ctx.group = group
        ctx.plan, ctx.windows = _exchange(n, r, L, halo_size, left_padding, layout, lookahead)
        return _halo_forward(x, group, ctx.plan, ctx.windows)

    @staticmethod
    def backward(ctx, grad_output):
        grad_x = _halo_backward(grad_output, ctx.group, ctx.plan, ctx.windows)
        return grad_x, None, None, None, None, None


def gather_halo(
    x: torch.Tensor,
    group: _group.Group,
    halo_size: int | Sequence[int],
    left_padding: int = 0,
    *,
    layout: str = "contiguous",
    lookahead: int | Sequence[int] = 0,
    validate: bool | None = None,
) -> torch.Tensor:
    """Prepend only the preceding causal window using point-to-point transport (and append the
    following tokens a lookahead asks).

    forward: p2p receives from the ranks that hold the window (ceil(halo_size/C) chunks at most,
    each sending only the end needed); backward: the same pieces' gradients sent back to their
    owners and added.

    Args:
        x: [batch, local_sequence, ...], rank r's chunks of the global sequence (`layout`).
        group: the CP process group (or a 1-D DeviceMesh), or None for a single rank (no CP).
        halo_size: most preceding tokens to fetch, normally window - 1 (attention) or kernel - 1 (conv);
            or one int per global chunk (n; 2n under head_tail), e.g. packed documents'
            torch_impl.layout.document_reach capped by the window: chunk c fetches up to halo_size[c].
            The same on every rank.
        left_padding: zero positions made locally before each window (never sent), e.g. to align a
            key tile with global key coordinates. It may differ between ranks.
        layout: "contiguous" (rank r holds global tokens [r*L, (r+1)*L)) or "head_tail" (chunks r
            and 2n-1-r of C = L/2 tokens; torch_impl.layout).
        lookahead: most following tokens to fetch after each chunk (an int, or one per global
            chunk), from the ranks that hold them (the heads of the next chunks): e.g. the rest of
            an image whose tokens attend to each other (Gemma 3). The same on every rank.
        validate: check first that all CP ranks called with matching inputs (see
            torch_impl.validation); None follows the CP_TRANSPORT_VALIDATE environment variable.

    Returns:
        Per local chunk (global chunk c, C tokens), one after the other: left_padding zeros, the
        h = min(c*C, halo_size) (or halo_size[c]) global tokens before the chunk, the chunk, then
        the a = min(S - (c+1)*C, lookahead) (or lookahead[c]) tokens after it (S = n*L); dtype
        of x. Contiguous: [batch, left_padding + h + L + a, ...] with h = min(r*L, halo_size). Without
        CP it is x itself when left_padding == 0. With batch > 1 it is a strided view of a
        sequence-major buffer.

    Backward: the gradient of the local chunks plus, from every window that held some of this rank's
    tokens, the gradient of those tokens. The zeros' gradient is dropped.
    """
    group = _group.resolve_group(group)
    validation.check("gather_halo", group, validate, x, halo_size, left_padding, layout, lookahead=lookahead)
    halo_size = halo_size if isinstance(halo_size, int) else tuple(halo_size)
    lookahead = lookahead if isinstance(lookahead, int) else tuple(lookahead)
    if _group.world_size(group) == 1 and left_padding == 0 and layout == "contiguous":
        return x  # (a lookahead has nothing after the only chunk)
    if torch.compiler.is_compiling() and _group.world_size(group) > 1:
        return halo_all_to_all(x, group, halo_size, left_padding, layout, lookahead)
    return _GatherHalo.apply(x, group, halo_size, left_padding, layout, lookahead)
