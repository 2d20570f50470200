"""Brute-force statements of the semantics, in numpy, one token at a time.

Shared by the JAX reference tests, the torch tests and the parity suite. Arrays are global
``[B, n*L, ...]``; rank ``r`` owns tokens ``[r*L, (r+1)*L)``.
"""

import numpy as np


def halo_len(rank, local_len, halo_size):
    """How many real halo tokens rank `rank` receives: min(rank*L, halo_size)."""
    return min(rank * local_len, halo_size)


def halo_forward(x, n, halo_size, left_padding):
    """Per rank r: left_padding zeros, then global tokens [r*L - h, r*L), then the local shard."""
    L = x.shape[1] // n
    outs = []
    for r in range(n):
        h = halo_len(r, L, halo_size)
        out = np.zeros((x.shape[0], left_padding + h + L, *x.shape[2:]), x.dtype)
        for i, token in enumerate(range(r * L - h, (r + 1) * L)):
            out[:, left_padding + i] = x[:, token]
        outs.append(out)
    return outs


def halo_backward(cotangents, n, local_len, halo_size, left_padding, dtype):
    """grad of global token g: the sum of every rank's cotangent at the position holding g."""
    B, rest = cotangents[0].shape[0], cotangents[0].shape[2:]
    grad = np.zeros((B, n * local_len, *rest), dtype)
    for r, ct in enumerate(cotangents):
        h = halo_len(r, local_len, halo_size)
        for i, token in enumerate(range(r * local_len - h, (r + 1) * local_len)):
            grad[:, token] += ct[:, left_padding + i]
    return grad


def sequence_backward(cotangents):
    """grad of every global token: the sum over ranks of their cotangent at that token."""
    return np.sum(np.stack(cotangents), axis=0)


def stamped(shape, dtype, offset=1):
    """Integer-valued data whose value at [b, token, ...] is offset + token + 64*((b + f) % 3).

    Exact in bf16 (integers <= 256) for up to 64 tokens; a token moved to another position
    cannot keep its value.
    """
    B, S = shape[0], shape[1]
    trailing = int(np.prod(shape[2:], dtype=np.int64))
    b = np.arange(B)[:, None, None]
    token = np.arange(S)[None, :, None]
    f = np.arange(trailing)[None, None, :]
    value = offset + token + 64 * ((b + f) % 3)
    return value.reshape(shape).astype(dtype)


def small_ints(rng, shape, dtype, bound=3):
    """Random integers in [-bound, bound]: sums of a few stay exact in every float dtype."""
    return rng.integers(-bound, bound + 1, size=shape).astype(dtype)


# --- layouts: which global tokens a rank's local rows hold (torch_impl.layout) -------------------


def local_tokens(n, L, r, layout="contiguous"):
    """The global token of each of rank r's L local rows: chunk r (contiguous), or chunks r and
    2n-1-r of L/2 tokens (head_tail)."""
    if layout == "contiguous":
        return list(range(r * L, (r + 1) * L))
    C = L // 2
    return [c * C + i for c in (r, 2 * n - 1 - r) for i in range(C)]


def device_order(x, n, layout):
    """Global [B, n*L, ...] -> the ranks' shards one after the other (what shard_map splits)."""
    L = x.shape[1] // n
    return np.concatenate([x[:, local_tokens(n, L, r, layout)] for r in range(n)], axis=1)


def halo_segments(n, L, r, halo_size, layout):
    """Per local chunk of rank r: (window length h, global tokens of the window and the chunk);
    halo_size an int, or one per global chunk."""
    C = L if layout == "contiguous" else L // 2
    chunks = (r,) if layout == "contiguous" else (r, 2 * n - 1 - r)
    out = []
    for c in chunks:
        h = min(c * C, halo_size if isinstance(halo_size, int) else halo_size[c])
        out.append((h, range(c * C - h, (c + 1) * C)))
    return out


def static_halo_lens(n, L, halo_size, left_padding, layout):
    """The JAX reference's static length of each local chunk's segment: the longest among ranks."""
    C = L if layout == "contiguous" else L // 2
    segments = [halo_segments(n, L, r, halo_size, layout) for r in range(n)]
    return [left_padding + max(s[k][0] for s in segments) + C for k in range(len(segments[0]))]


def layout_halo_forward(x, n, halo_size, left_padding, layout):
    """x global. Per rank, per local chunk: left_padding zeros, its window, the chunk."""
    L = x.shape[1] // n
    outs = []
    for r in range(n):
        parts = []
        for _, tokens in halo_segments(n, L, r, halo_size, layout):
            parts += [np.zeros((x.shape[0], left_padding, *x.shape[2:]), x.dtype), x[:, list(tokens)]]
        outs.append(np.concatenate(parts, axis=1))
    return outs


def layout_halo_backward(cotangents, n, L, halo_size, left_padding, layout, dtype):
    """Global grad: every rank's cotangent added at the global token each position holds."""
    B, rest = cotangents[0].shape[0], cotangents[0].shape[2:]
    grad = np.zeros((B, n * L, *rest), dtype)
    for r, ct in enumerate(cotangents):
        row = 0
        for _, tokens in halo_segments(n, L, r, halo_size, layout):
            row += left_padding
            for token in tokens:
                grad[:, token] += ct[:, row]
                row += 1
    return grad
