"""Run a `jax_reference` function under `jax.shard_map` on n simulated CPU devices.

Outputs come back stacked per device, ``[n, B, T, ...]``; gradients as the global ``[B, n*L, ...]``.
One jitted program per (function, n, static arguments); jit reuses it for every shape.
"""

import functools

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import jax_reference


@functools.cache
def _mesh(n):
    return jax.make_mesh((n,), ("cp",), devices=jax.devices()[:n])


@functools.cache
def _program(name, n, with_grad, kwargs):
    fn = functools.partial(getattr(jax_reference, name), **dict(kwargs))
    per_device = jax.shard_map(
        lambda x: fn(x, "cp")[None], mesh=_mesh(n), in_specs=P(None, "cp"), out_specs=P("cp")
    )
    if not with_grad:
        return jax.jit(per_device)

    def forward_and_vjp(x, cotangent):
        y, vjp = jax.vjp(per_device, x)
        return y, vjp(cotangent)[0]

    return jax.jit(forward_and_vjp)


def run(name, x, n, cotangent=None, **kwargs):
    """x: global [B, n*L, ...]; cotangent: [n, B, T, ...] or None. Returns (outputs, grad or None)."""
    mesh = _mesh(n)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P(None, "cp")))
        program = _program(name, n, cotangent is not None, tuple(sorted(kwargs.items())))
        if cotangent is None:
            return np.asarray(program(xs)), None
        ct = jax.device_put(cotangent, NamedSharding(mesh, P("cp")))
        y, grad = program(xs, ct)
        return np.asarray(y), np.asarray(grad)
