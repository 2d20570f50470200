"""Reference semantics of context-parallel (CP) sequence transport, in plain JAX.

Call these inside ``jax.shard_map`` over a 1-D mesh axis ``axis_name``. Each device holds one
contiguous shard ``x: [B, L, ...]`` of a sequence of ``n * L`` tokens: device ``r`` holds the global
tokens ``[r*L, (r+1)*L)``. These functions define what the torch package ``torch_impl`` must compute,
forward and backward; the parity suite checks it against them.

| function          | forward                               | backward (JAX's transpose)                   |
|-------------------|---------------------------------------|----------------------------------------------|
| `gather_sequence` | `all_gather(tiled=True)` on axis 1    | `psum_scatter`: owner gets the sum of grads  |
| `gather_halo`     | `ppermute` shifts 1, 2, ... of tails  | `ppermute` with the inverse permutation; a   |
|                   |                                       | device that received nothing drops its grad  |
| `gather_metadata` | `all_gather` under `stop_gradient`    | none (zero cotangent)                        |

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
"""

import math

from jax import lax
import jax.numpy as jnp

__all__ = ["LAYOUTS", "chunks", "gather_halo", "gather_metadata", "gather_sequence"]

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


def gather_sequence(x, axis_name, layout="contiguous"):
    """x: [B, L, ...] -> [B, n*L, ...] in global order. Backward: psum_scatter (and the reordering's
    transpose)."""
    _check_shard(x, layout)
    gathered = lax.all_gather(x, axis_name, axis=1, tiled=True)  # device order
    return _global_order(gathered, lax.axis_size(axis_name), layout)


def gather_halo(x, axis_name, halo_size, left_padding=0, layout="contiguous"):
    """x: [B, L, ...] -> per local chunk k (C tokens, global chunk c): [left_padding zeros, H_k
    tokens, the chunk], concatenated; H_k = min(halo_size, largest c*C over devices).

    Shift s = 1, 2, ... brings chunk c the last ``min(C, H_k - (s-1)*C)`` tokens of chunk c - s from
    the device that holds it (at its local chunk p: one ``ppermute`` per p); the received tails,
    farthest first, form chunk c's window. Devices whose chunk c - s does not exist receive zeros.
    """
    _check_shard(x, layout)
    _check_count("halo_size", halo_size)
    _check_count("left_padding", left_padding)
    n, L = lax.axis_size(axis_name), x.shape[1]
    held = [chunks(layout, n, r) for r in range(n)]
    C, count = L // len(held[0]), len(held[0])
    owner = {c: (r, p) for r in range(n) for p, c in enumerate(held[r])}  # chunk -> (device, local chunk)
    zeros = jnp.zeros((x.shape[0], left_padding, *x.shape[2:]), x.dtype)  # [B, left_padding, ...]
    segments = []
    for k in range(count):
        H = min(halo_size, max(held[r][k] for r in range(n)) * C)
        pieces = []
        for s in range(1, math.ceil(H / C) + 1 if H else 1):  # H > 0 implies C > 0
            length = min(C, H - (s - 1) * C)
            sources = {dst: owner[held[dst][k] - s] for dst in range(n) if held[dst][k] >= s}
            piece = 0
            for p in range(count):
                pairs = [(src, dst) for dst, (src, q) in sources.items() if q == p]
                if pairs:
                    tail = x[:, (p + 1) * C - length : (p + 1) * C]  # [B, length, ...] of chunk p
                    piece = piece + lax.ppermute(tail, axis_name, pairs)
            pieces.insert(0, piece)
        segments += [zeros, *pieces, x[:, k * C : (k + 1) * C]]
    return jnp.concatenate(segments, axis=1)


def gather_metadata(x, axis_name, layout="contiguous"):
    """x: [B, L, ...] (bool, int or float) -> [B, n*L, ...] in global order, with no gradient."""
    _check_shard(x, layout)
    gathered = lax.all_gather(lax.stop_gradient(x), axis_name, axis=1, tiled=True)
    return _global_order(gathered, lax.axis_size(axis_name), layout)
