"""Run `jax_reference` functions under `jax.shard_map` on n simulated CPU devices.

Outputs come back stacked per device, ``[n, B, T, ...]``; gradients as the global ``[B, n*L, ...]``.
`run_many` evaluates one function for several static arguments in one jitted program (one compile
for the lot), each on its own copy of the input so that each gets its own gradient; jit reuses that
program for any input of the same shape and dtype.
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
def _program(name, n, with_grad, static_args):
    fns = [functools.partial(getattr(jax_reference, name), **dict(kw)) for kw in static_args]
    per_device = jax.shard_map(
        lambda *xs: tuple(fn(x, "cp")[None] for fn, x in zip(fns, xs, strict=True)),
        mesh=_mesh(n),
        in_specs=tuple(P(None, "cp") for _ in fns),
        out_specs=tuple(P("cp") for _ in fns),
    )
    if not with_grad:
        return jax.jit(lambda x: per_device(*[x] * len(fns)))

    def forward_and_vjp(x, cotangents):
        ys, vjp = jax.vjp(per_device, *[x] * len(fns))
        return ys, vjp(tuple(cotangents))

    return jax.jit(forward_and_vjp)


def run_many(name, x, n, static_args, cotangents=None):
    """x: global [B, n*L, ...]; static_args: one kwargs dict per evaluation; cotangents: one
    [n, B, T_i, ...] per evaluation, or None for forward only.

    Returns (outputs, grads): outputs[i] is [n, B, T_i, ...]; grads[i] is the input's gradient
    [B, n*L, ...] from evaluation i (None without cotangents).
    """
    mesh = _mesh(n)
    key = tuple(tuple(sorted(kw.items())) for kw in static_args)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P(None, "cp")))
        program = _program(name, n, cotangents is not None, key)
        if cotangents is None:
            return [np.asarray(y) for y in program(xs)], None
        cts = [jax.device_put(ct, NamedSharding(mesh, P("cp"))) for ct in cotangents]
        ys, grads = program(xs, cts)
        return [np.asarray(y) for y in ys], [np.asarray(g) for g in grads]


def run(name, x, n, cotangent=None, **kwargs):
    """One evaluation: (outputs [n, B, T, ...], grad [B, n*L, ...] or None)."""
    ys, grads = run_many(name, x, n, [kwargs], None if cotangent is None else [cotangent])
    return ys[0], None if grads is None else grads[0]


@functools.cache
def _state_program(n, layout):
    per_device = jax.shard_map(
        lambda A, B: jax_reference.gather_state(A, B, "cp", layout)[None],
        mesh=_mesh(n),
        in_specs=(P(None, "cp"), P(None, "cp")),
        out_specs=P("cp"),
    )

    def forward_and_vjp(A, B, cotangent):
        y, vjp = jax.vjp(per_device, A, B)
        return y, vjp(cotangent)

    return jax.jit(forward_and_vjp)


def run_state(A, B, n, layout, cotangent):
    """gather_state on n devices: A [batch, n*k, ..., m, m] and B [..., m, p] in device order (device
    r's k maps at rows r*k ..), cotangent [n, batch, k, ..., m, p] -> (states [n, batch, k, ..., m,
    p], (grad A, grad B) in device order)."""
    mesh = _mesh(n)
    with jax.set_mesh(mesh):
        spec = NamedSharding(mesh, P(None, "cp"))
        y, (gA, gB) = _state_program(n, layout)(
            jax.device_put(A, spec),
            jax.device_put(B, spec),
            jax.device_put(cotangent, NamedSharding(mesh, P("cp"))),
        )
        return np.asarray(y), (np.asarray(gA), np.asarray(gB))


@functools.cache
def _reductions_program(n, layout):
    def per_device(x, mask, position):
        return tuple(
            y[None]
            for y in (
                jax_reference.sum_sequence(x, "cp", mask),
                jax_reference.select_position(x, position, "cp", layout),
                jax_reference.last_position(mask, "cp", layout),
            )
        )

    sharded = jax.shard_map(
        per_device, mesh=_mesh(n), in_specs=(P(None, "cp"), P(None, "cp"), P()), out_specs=P("cp")
    )

    def forward_and_vjp(x, mask, position, ct_sum, ct_select):
        (total, picked, last), vjp = jax.vjp(lambda x: sharded(x, mask, position), x)
        (grad,) = vjp((ct_sum, ct_select, np.zeros(last.shape, jax.dtypes.float0)))
        return total, picked, last, grad

    return jax.jit(forward_and_vjp)


def run_reductions(x, mask, position, n, layout, cotangents):
    """sum_sequence, select_position and last_position on n devices: x [B, n*L, ...] and mask
    [B, n*L] in device order, position [B], cotangents ([n, B, ...] each, of the first two) ->
    (outputs [n, B, ...] each, x's gradient in device order)."""
    mesh = _mesh(n)
    with jax.set_mesh(mesh):
        spec = NamedSharding(mesh, P(None, "cp"))
        total, picked, last, grad = _reductions_program(n, layout)(
            jax.device_put(x, spec),
            jax.device_put(mask, spec),
            jax.device_put(position, NamedSharding(mesh, P())),
            *(jax.device_put(ct, NamedSharding(mesh, P("cp"))) for ct in cotangents),
        )
        return [np.asarray(t) for t in (total, picked, last)], np.asarray(grad)
