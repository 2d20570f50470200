"""Reference semantics of context-parallel (CP) sequence transport, in plain JAX.

Call these inside ``jax.shard_map`` over a 1-D mesh axis ``axis_name``. Each device holds one
contiguous shard ``x: [B, L, ...]`` of a sequence of ``n * L`` tokens: device ``r`` holds the global
tokens ``[r*L, (r+1)*L)``. These functions define what the torch package ``torch_impl`` must compute,
forward and backward; the parity suite checks it against them.

| function          | forward                               | backward (JAX's transpose)                   |
|-------------------|---------------------------------------|----------------------------------------------|
| `gather_sequence` | `all_gather(tiled=True)` on axis 1    | `psum_scatter`: owner gets the sum of grads  |
| `gather_halo`     | `ppermute` shifts 1, 2, ... of tails  | `ppermute` with the inverse permutation; a   |
|                   | (a lookahead: -1, -2, ... of heads)   | device that received nothing drops its grad  |
| `gather_metadata` | `all_gather` under `stop_gradient`    | none (zero cotangent)                        |
| `gather_state`    | `all_gather` of each chunk's affine   | `psum_scatter`: each map's gradient summed   |
|                   | map, folded in global chunk order     | on its owner                                 |
| `sum_sequence`    | local sum over tokens, then `psum`    | `psum` of the devices' cotangents, to every  |
|                   | (a value per batch row)               | token (the transpose of a psum whose result  |
|                   |                                       | each device uses in its own way)             |
| `select_position` | the owner's token, zeros elsewhere,   | the same `psum`, to the owner's token only   |
|                   | then `psum`                           |                                              |
| `last_position`   | `pmax` of global positions            | none (an integer)                            |

``halo_rows(n, L, r, halo_size, ...)`` is ``gather_halo``'s definition: the global token at each
position of device r's output (the tests check the ``ppermute`` version against it).

Worked example, n=3 devices, L=2, halo_size=3 (numbers are global token positions, ``.`` a zero):

    device 0 holds [0 1]   gather_halo -> [. . . | 0 1]   (its true halo is empty)
    device 1 holds [2 3]   gather_halo -> [. 0 1 | 2 3]   (true halo: tokens 0 1, from shift 1)
    device 2 holds [4 5]   gather_halo -> [1 2 3 | 4 5]   (shift 2 sends token 1, shift 1 tokens 2 3)
    every device           gather_sequence -> [0 1 2 3 4 5]

``gather_halo`` has one static shape on every device, ``[B, left_padding + H + L, ...]`` with
``H = min(halo_size, (n-1)*L)``. On device ``r`` its last ``left_padding + min(r*L, halo_size) + L``
positions are exactly what torch's ``gather_halo`` returns on rank ``r``; the positions before them
are zero. In backward, the gradient of token 1 on device 2 above travels back two devices to device 0
and is added to the gradient of device 0's own token 1.

Layouts (``layout=``). ``"contiguous"`` is the above: one chunk per device. ``"head_tail"`` balances
causal work: the sequence is cut into 2n chunks of C = L/2 tokens and device ``r`` holds chunks ``r``
and ``2n-1-r``, in that order (local rows ``[0, C)`` are global ``[rC, (r+1)C)``, rows ``[C, 2C)``
global ``[(2n-1-r)C, (2n-r)C)``). ``gather_sequence`` and ``gather_metadata`` still return the
sequence in global order. ``gather_halo`` gives *each local chunk* its own window: per chunk
``left_padding`` zeros, the ``min(halo_size, cC)`` tokens before chunk ``c``, then the chunk; a
head's window comes from lower devices, a tail's from higher ones (device n-1's tail from its own
head). n=2, L=2 (C=1), halo_size=2, each (...) one chunk's segment, its window then the chunk:

    device 0 holds [0 3]   gather_halo -> (. 0)(1 2 3)   (chunk 3's window: tokens 1, 2 of device 1)
    device 1 holds [1 2]   gather_halo -> (0 1)(0 1 2)   (chunk 2's: token 0 of device 0, 1 its own)
    every device           gather_sequence -> [0 1 2 3]

Static shapes again: each chunk's window is as long as the longest among devices, zeros in front.

Per-chunk halos (``halo_size`` a sequence, one int per global chunk). Packed documents need less
than the window: chunk c needs nothing before the start of the document holding its first token,
so ``halo_size[c]`` is that distance (capped by the window). The output keeps the static shape;
a device's positions before its own h_c are zero, and their gradient goes nowhere. n=3, L=2,
halo_size=(0, 1, 3): device 0 -> [. . . | 0 1], device 1 -> [. . 1 | 2 3] (token 0 is not in its
window), device 2 -> [1 2 3 | 4 5].

Lookahead (``lookahead``: an int or one per global chunk), the mirror of the window: the tokens
*after* each chunk, from later devices (Gemma 3's image tokens see every token of their image,
later ones included). Each chunk's segment is then its window, the chunk, the a_c = min(lookahead,
S - (c+1)*C) tokens after it (S = n*L), and zeros up to the longest at that place; the shifts go
-1, -2, ..., each sending the start of chunk c + s. n=3, L=2, halo_size=1, lookahead=3:

    device 0 holds [0 1]   gather_halo -> [. 0 1 | 2 3 4]
    device 1 holds [2 3]   gather_halo -> [1 2 3 | 4 5 .]
    device 2 holds [4 5]   gather_halo -> [3 4 5 | . . .]

Recurrent state (``gather_state``). A linear recurrence (Gated DeltaNet, KDA, Mamba) carries a
state of fixed size along the sequence, and over one chunk it is an affine map of the state it
starts from: ``S_out = A_c @ S_in + B_c`` (per head: ``A_c [dk, dk]``, the ordered product of the
chunk's transitions; ``B_c [dk, dv]``, the chunk's final state from a zero one). So a device needs
no earlier tokens, only the earlier chunks' maps: chunk c starts from ``S_c``, with ``S_0 = 0`` and
``S_{c+1} = A_c @ S_c + B_c`` in global chunk order. Scalars, n=3, contiguous, maps
``(A, B) = (2, 1), (3, 1), (5, 1)``: device 0 gets ``S_0 = 0``, device 1 ``S_1 = 2*0 + 1 = 1``,
device 2 ``S_2 = 3*1 + 1 = 4``. Under head_tail a device gets the states of its two chunks.

Reductions over a sharded row (``sum_sequence``, ``select_position``, ``last_position``). A loss that
is not a token mean needs a value per batch row from the whole sequence: DPO sums a row's log-probs
over its completion, a reward model reads the row's last real token. Each device reduces its own
tokens to ``[B, ...]`` and one ``psum`` (or ``pmax``) over the devices completes it: bytes per row,
whatever L. Every device then holds the same value and uses it in its own way (its own cotangent
``g_k``), so the transpose gives each token ``sum_k g_k``: a device whose loss is its *share* of a
row's loss (``1/n`` of it, the shares adding up to one process's loss) returns exactly one
process's gradient, and one whose loss is the whole row's returns n times it. n=2, L=2, one row
of log-probs ``[1 2 | 3 4]`` with mask ``[0 1 | 1 0]`` (tokens 1 and 2 count):

    sum_sequence(x, mask)      -> 5 on both devices; cotangents g_0, g_1 -> grad [0 g | g 0], g = g_0 + g_1
    last_position(mask)        -> 2 on both devices (the last position whose mask is True)
    select_position(x, 2)      -> 3 on both devices; grad [0 0 | g 0], the owner's token only
"""

import math

from jax import lax
import jax.numpy as jnp

__all__ = [
    "LAYOUTS",
    "chunks",
    "gather_halo",
    "gather_metadata",
    "gather_sequence",
    "gather_state",
    "halo_rows",
    "last_position",
    "select_position",
    "sum_sequence",
]

LAYOUTS = ("contiguous", "head_tail")


def chunks(layout, n, r):
    """The global chunks device r holds, in local order (chunks of L tokens, or of L/2 in head_tail)."""
    return (r,) if layout == "contiguous" else (r, 2 * n - 1 - r)


def _check_shard(x, layout="contiguous"):
    if x.ndim < 2:
        raise ValueError(f"`x` must be [batch, local_sequence, ...] (ndim >= 2), got shape {x.shape}")
    if layout not in LAYOUTS:
        raise ValueError(f"`layout` must be one of {LAYOUTS}, got {layout!r}")
    if layout == "head_tail" and x.shape[1] % 2:
        raise ValueError(f"`layout='head_tail'` needs an even local_sequence (two chunks), got {x.shape[1]}")


def _global_order(gathered, n, layout):
    """[B, n*L, ...] in device order -> global order: the heads in device order, then the tails
    in reverse device order."""
    if layout == "contiguous":
        return gathered
    B, C, rest = gathered.shape[0], gathered.shape[1] // (2 * n), gathered.shape[2:]
    per_device = gathered.reshape(B, n, 2, C, *rest)
    heads, tails = per_device[:, :, 0], per_device[:, ::-1, 1]  # [B, n, C, ...] each
    return jnp.concatenate([heads, tails], axis=1).reshape(B, 2 * n * C, *rest)


def _check_count(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`{name}` must be a non-negative int, got {value!r}")


def _check_halo_size(halo_size, name="halo_size"):
    """A non-negative int, or a tuple or list of them (one per global chunk)."""
    for h in halo_size if isinstance(halo_size, (tuple, list)) else (halo_size,):
        _check_count(name, h)


def gather_sequence(x, axis_name, layout="contiguous"):
    """x: [B, L, ...] -> [B, n*L, ...] in global order. Backward: psum_scatter (and the reordering's
    transpose)."""
    _check_shard(x, layout)
    gathered = lax.all_gather(x, axis_name, axis=1, tiled=True)  # device order
    return _global_order(gathered, lax.axis_size(axis_name), layout)


def halo_rows(n, L, r, halo_size, left_padding=0, layout="contiguous", lookahead=0):
    """The definition of gather_halo: the global token at each position of device r's output (-1:
    a zero). Per local chunk (global chunk c of C tokens): left_padding zeros, zeros up to the
    longest window among the devices' chunks at that local place, the h_c = min(halo_size, c*C)
    tokens before chunk c (halo_size[c] per chunk), chunk c, the a_c = min(lookahead, S - (c+1)*C)
    tokens after it (lookahead[c] per chunk; S = n*L), then zeros up to the longest at that place."""
    held, count = chunks(layout, n, r), len(chunks(layout, n, 0))
    C, reach, ahead = (
        L // count,
        _per_chunk(halo_size, n * count),
        _per_chunk(lookahead, n * count, "lookahead"),
    )
    rows = []
    for k, c in enumerate(held):
        places = [chunks(layout, n, q)[k] for q in range(n)]
        H = max(min(reach[d], d * C) for d in places)
        A = max(min(ahead[d], n * L - (d + 1) * C) for d in places)
        h, a = min(reach[c], c * C), min(ahead[c], n * L - (c + 1) * C)
        rows += [-1] * (left_padding + H - h) + list(range(c * C - h, (c + 1) * C + a)) + [-1] * (A - a)
    return rows


def _per_chunk(halo_size, count, name="halo_size"):
    """halo_size (or lookahead) as one int per global chunk."""
    reach = tuple(halo_size) if isinstance(halo_size, (tuple, list)) else (halo_size,) * count
    if len(reach) != count:
        raise ValueError(f"`{name}` must be an int or one per global chunk ({count}), got {halo_size}")
    return reach


def gather_halo(x, axis_name, halo_size, left_padding=0, layout="contiguous", lookahead=0):
    """x: [B, L, ...] -> [B, len(halo_rows(...)), ...]: at each position the global token that
    halo_rows names (zeros at -1), moved by ppermute. Chunk c's window is the tails of chunks
    c - 1, c - 2, ... (shift s: the last min(C, H - (s-1)*C) tokens of chunk c - s, H the longest
    window at that local place), farthest first; a device keeps the last h_c positions of it. Its
    lookahead, the mirror: the heads of chunks c + 1, c + 2, ..., nearest first, of which a device
    keeps the first a_c positions. Backward: ppermute's transpose returns each token's gradients
    to its owner, who adds them up.
    """
    _check_shard(x, layout)
    _check_halo_size(halo_size)
    _check_halo_size(lookahead, "lookahead")
    _check_count("left_padding", left_padding)
    n, L = lax.axis_size(axis_name), x.shape[1]
    held = [chunks(layout, n, r) for r in range(n)]
    C, count = L // len(held[0]), len(held[0])
    reach, ahead = _per_chunk(halo_size, n * count), _per_chunk(lookahead, n * count, "lookahead")
    zeros = jnp.zeros((x.shape[0], left_padding, *x.shape[2:]), x.dtype)  # [B, left_padding, ...]
    segments = []
    for k in range(count):
        h = [min(reach[held[r][k]], held[r][k] * C) for r in range(n)]  # each device's h_c
        a = [min(ahead[held[r][k]], n * L - (held[r][k] + 1) * C) for r in range(n)]  # and a_c
        H, A = max(h), max(a)
        shifts = range(math.ceil(H / C) if H else 0, 0, -1)  # farthest first (H > 0 implies C > 0)
        window = [_neighbour(x, axis_name, held, k, s, min(C, H - (s - 1) * C)) for s in shifts]
        after = range(1, -(-A // C) + 1 if A else 1)  # nearest first (A > 0 implies C > 0)
        following = [_neighbour(x, axis_name, held, k, -s, min(C, A - (s - 1) * C)) for s in after]
        segments += [zeros, *_keep(window, h, axis_name, last=True), x[:, k * C : (k + 1) * C]]
        segments += _keep(following, a, axis_name, last=False)
    return jnp.concatenate(segments, axis=1)


def _keep(pieces, lengths, axis_name, last):
    """The pieces received for one local place, joined: [B, max(lengths), ...], of which each device
    keeps its own length's last (a window) or first (a lookahead) positions, zeros elsewhere."""
    if not pieces or min(lengths) == max(lengths):
        return pieces
    joined, M = jnp.concatenate(pieces, 1), max(lengths)
    mine = jnp.asarray(lengths)[lax.axis_index(axis_name)]
    kept = jnp.arange(M) >= M - mine if last else jnp.arange(M) < mine  # [M]
    return [jnp.where(kept.reshape(1, M, *(1,) * (joined.ndim - 2)), joined, 0)]


def _neighbour(x, axis_name, held, k, s, length):
    """[B, length, ...]: on each device the `length` tokens of chunk c - s nearest to chunk c, c its
    k-th chunk: the end of an earlier chunk (s > 0) or the start of a later one (s < 0); zeros
    where there is none. One ppermute per local chunk p of the senders."""
    C, N = x.shape[1] // len(held[0]), len(held) * len(held[0])
    owner = {c: (r, p) for r, cs in enumerate(held) for p, c in enumerate(cs)}  # chunk -> (device, place)
    wanted = {dst: owner[cs[k] - s] for dst, cs in enumerate(held) if 0 <= cs[k] - s < N}  # dst -> (src, p)
    piece = 0
    for p in range(len(held[0])):
        pairs = [(src, dst) for dst, (src, q) in wanted.items() if q == p]
        start = (p + 1) * C - length if s > 0 else p * C
        if pairs:
            piece = piece + lax.ppermute(x[:, start : start + length], axis_name, pairs)
    return piece


def gather_metadata(x, axis_name, layout="contiguous"):
    """x: [B, L, ...] (bool, int or float) -> [B, n*L, ...] in global order, with no gradient."""
    _check_shard(x, layout)
    gathered = lax.all_gather(lax.stop_gradient(x), axis_name, axis=1, tiled=True)
    return _global_order(gathered, lax.axis_size(axis_name), layout)


def gather_state(A, B, axis_name, layout="contiguous"):
    """A: [batch, k, ..., m, m] and B: [batch, k, ..., m, p], the affine maps S -> A @ S + B of the
    device's k local chunks (k = 1, or 2 under head_tail) -> [batch, k, ..., m, p]: the state each
    of them starts from, every earlier chunk's map applied in global order to a zero state.
    Backward: the all_gather's transpose, psum_scatter, sums each map's gradient on its owner."""
    _check_state(A, B, layout)
    maps_A = gather_sequence(A, axis_name, layout)  # [batch, N, ..., m, m], global chunk order
    maps_B = gather_sequence(B, axis_name, layout)
    states = [jnp.zeros_like(B[:, 0])]
    for c in range(maps_A.shape[1] - 1):
        states.append(maps_A[:, c] @ states[-1] + maps_B[:, c])
    n, r = lax.axis_size(axis_name), lax.axis_index(axis_name)
    mine = jnp.array([r] if layout == "contiguous" else [r, 2 * n - 1 - r])  # chunks(layout, n, r)
    return jnp.take(jnp.stack(states, axis=1), mine, axis=1)


def _check_state(A, B, layout):
    _check_shard(A, layout)
    k = 1 if layout == "contiguous" else 2
    if A.ndim < 4 or A.shape[1] != k or A.shape[-1] != A.shape[-2]:
        raise ValueError(f"`A` must be [batch, {k}, ..., m, m] for layout={layout!r}, got shape {A.shape}")
    if B.shape[:-1] != A.shape[:-1] or B.dtype != A.dtype:
        raise ValueError(f"`B` must be [*A.shape[:-1], p] in A's dtype {A.dtype}, got {B.shape} {B.dtype}")


def _positions(x, axis_name, layout):
    """int32 [L]: the global position of each of this device's tokens (its chunks, in local order)."""
    n, r, L = lax.axis_size(axis_name), lax.axis_index(axis_name), x.shape[1]
    if layout == "contiguous":
        return r * L + jnp.arange(L)
    C = L // 2
    return jnp.concatenate([r * C + jnp.arange(C), (2 * n - 1 - r) * C + jnp.arange(C)])


def _along(mask, x):
    """bool [B, L] -> [B, L, 1, ...], broadcasting against x: [B, L, ...]."""
    return mask.reshape(*mask.shape, *(1,) * (x.ndim - 2))


def sum_sequence(x, axis_name, mask=None):
    """x: [B, L, ...] -> [B, ...]: each row's sum over the whole sequence (over the tokens where
    `mask`, bool [B, L], is True), the same on every device. Backward: psum of the cotangents."""
    _check_shard(x)
    if mask is not None:
        x = jnp.where(_along(mask, x), x, 0)
    return lax.psum(jnp.sum(x, axis=1), axis_name)


def select_position(x, position, axis_name, layout="contiguous"):
    """x: [B, L, ...], position: int [B] (a global position per row, the same on every device) ->
    [B, ...]: each row's token at its position, on every device. Backward: psum of the
    cotangents, to that token on its owner."""
    _check_shard(x, layout)
    owned = _positions(x, axis_name, layout)[None] == position[:, None]  # [B, L]: one True, one device
    return lax.psum(jnp.sum(jnp.where(_along(owned, x), x, 0), axis=1), axis_name)


def last_position(mask, axis_name, layout="contiguous"):
    """mask: bool [B, L] -> int32 [B]: each row's last global position where mask is True (-1 where
    none is), on every device."""
    _check_shard(mask, layout)
    return lax.pmax(jnp.max(jnp.where(mask, _positions(mask, axis_name, layout), -1), axis=1), axis_name)
