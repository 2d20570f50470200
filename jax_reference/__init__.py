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
"""

import math

from jax import lax
import jax.numpy as jnp

__all__ = ["gather_halo", "gather_metadata", "gather_sequence"]


def _check_shard(x):
    if x.ndim < 2:
        raise ValueError(f"`x` must be [batch, local_sequence, ...] (ndim >= 2), got shape {x.shape}")


def _check_count(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`{name}` must be a non-negative int, got {value!r}")


def gather_sequence(x, axis_name):
    """x: [B, L, ...] -> [B, n*L, ...], the shards in device order. Backward: psum_scatter."""
    _check_shard(x)
    return lax.all_gather(x, axis_name, axis=1, tiled=True)


def gather_halo(x, axis_name, halo_size, left_padding=0):
    """x: [B, L, ...] -> [B, left_padding + min(halo_size, (n-1)*L) + L, ...].

    Shift s = 1, 2, ... sends each device's last ``min(L, H - (s-1)*L)`` tokens to the device s
    places later; the received tails, farthest first, form the halo in front of ``x``.
    """
    _check_shard(x)
    _check_count("halo_size", halo_size)
    _check_count("left_padding", left_padding)
    n, L = lax.axis_size(axis_name), x.shape[1]
    H = min(halo_size, (n - 1) * L)
    num_shifts = math.ceil(H / L) if H else 0  # H > 0 implies L > 0
    pieces = []
    for s in range(1, num_shifts + 1):
        tail = x[:, L - min(L, H - (s - 1) * L) :]  # [B, len_s, ...]
        pieces.insert(0, lax.ppermute(tail, axis_name, [(i, i + s) for i in range(n - s)]))
    zeros = jnp.zeros((x.shape[0], left_padding, *x.shape[2:]), x.dtype)  # [B, left_padding, ...]
    return jnp.concatenate([zeros, *pieces, x], axis=1)


def gather_metadata(x, axis_name):
    """x: [B, L, ...] (bool, int or float) -> [B, n*L, ...], with no gradient."""
    _check_shard(x)
    return lax.all_gather(lax.stop_gradient(x), axis_name, axis=1, tiled=True)
