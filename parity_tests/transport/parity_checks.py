"""The comparisons the parity suites share: torch_impl on a gloo CP group of the worker pool
against jax_reference on n host devices, forward and backward.

One global input is made on the host and split into n shards; the torch side runs on gloo ranks of
a CP group (every group of a grouping of the 8-rank pool: consecutive ranks, or strided ones), the
JAX side under `jax.shard_map` on n host devices. Rank r's torch `gather_halo` output must equal
the last positions of device r's static-shape JAX output (per chunk), whose positions before them
must be zero.

Tolerances. Forward outputs are pure data movement: equal to the bit in every dtype, for every data.
Gradients of integer-valued data are exact sums: equal to the bit. Gradients of random normal data
are sums of k <= n cotangent values (the local one plus one per later rank whose halo or gather held
the token), added in an order that differs between torch (plan order; gloo's reduce-scatter) and
JAX (its transpose). Each order's result is within (k-1) * u * sum|a_i| of the exact sum, with u the
unit roundoff of the dtype (2^-24 float32, 2^-53 float64, 2^-8 bfloat16, 2^-11 float16), so two
orders differ by at most 2 * (n-1) * u * sum|a_i|: that elementwise bound is what is asserted.
"""

import jax.numpy as jnp
import numpy as np
import torch

from parity_tests.harness import expected, jax_harness
from parity_tests.harness.workers import group_ranks
from parity_tests.transport import torch_cases

DTYPES = ["float32", "float64", "bfloat16", "float16"]
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float64": 2.0**-53, "bfloat16": 2.0**-8, "float16": 2.0**-11}
WORLDS = [1, 2, 3, 4, 8]
LOCAL_LENS = [1, 2, 5, 8]
TRAILING = [(), (3,), (2, 3)]
DATA = ["integer", "normal"]
# gather_halo's two exchanges: eager p2p, and the all_to_all that runs under torch.compile
HALO_PATHS = ["torch_impl.gather_halo", "torch_impl.halo.halo_all_to_all"]


def round_to(a, dtype):
    """float64 array holding exactly the values of `dtype` nearest to a (what both sides receive)."""
    return torch.from_numpy(a).to(torch_cases.DTYPES[dtype]).double().numpy()


def jax_array(a, dtype):
    return np.asarray(a, dtype=jnp.dtype(dtype))


def as_numpy(t):
    return t.detach().to(torch.float64).numpy() if t.is_floating_point() else t.numpy()


def make_data(kind, shape, dtype, rng, offset=1):
    if kind == "integer":
        return expected.stamped(shape, np.float64, offset)
    return round_to(rng.standard_normal(shape), dtype)


def make_cotangent(kind, shape, dtype, rng):
    if kind == "integer":
        return expected.small_ints(rng, shape, np.float64)
    return round_to(rng.standard_normal(shape), dtype)


def grouping_for(n, variant):
    """A CP grouping of the 8-rank pool: consecutive ranks, or (variant odd) strided ones."""
    if variant % 2 and n in (2, 4):
        return ("strided", n)
    return ("block", n)


def check_gradient(torch_grad, jax_grad, abs_sum, n, dtype, kind, where):
    assert str(torch_grad.dtype).removeprefix("torch.") == dtype and jax_grad.dtype == jnp.dtype(dtype)
    got, want = as_numpy(torch_grad), jax_grad.astype(np.float64)
    assert got.shape == want.shape, (where, got.shape, want.shape)
    if kind == "integer":
        np.testing.assert_array_equal(got, want, err_msg=where)
        return
    bound = 2 * (n - 1) * UNIT_ROUNDOFF[dtype] * abs_sum
    excess = np.abs(got - want) - bound
    assert (excess <= 0).all(), f"{where}: |torch - jax| exceeds 2(n-1)u*sum|a| by {excess.max()}"


def check_halo(
    pool, grouping, L, batch, trailing, dtype, kind, combos, seed, transport="torch_impl.gather_halo"
):
    """Compare torch and JAX gather_halo for each (halo_size, left_padding) in combos; returns the count."""
    n = len(group_ranks(grouping)[0])
    rng = np.random.default_rng(seed)
    x = make_data(kind, (batch, n * L, *trailing), dtype, rng)
    static_lens = [lp + min(h, (n - 1) * L) + L for h, lp in combos]
    cotangents = [make_cotangent(kind, (n, batch, T, *trailing), dtype, rng) for T in static_lens]

    ys, grads = jax_harness.run_many(
        "gather_halo",
        jax_array(x, dtype),
        n,
        [{"halo_size": h, "left_padding": lp} for h, lp in combos],
        [jax_array(ct, dtype) for ct in cotangents],
    )
    configs = []
    for (h, lp), T, ct in zip(combos, static_lens, cotangents, strict=True):
        lens = [lp + min(r * L, h) + L for r in range(n)]
        configs.append(
            {
                "x": x,
                "cotangents": [ct[r][:, T - lens[r] :] for r in range(n)],
                "dtype": dtype,
                "halo_size": h,
                "left_padding": lp,
                "noncontiguous": (h + lp) % 2 == 1,
            }
        )
    results = pool.run(grouping, torch_cases.halo, configs, transport)

    for i, ((h, lp), c) in enumerate(zip(combos, configs, strict=True)):
        abs_sum = expected.halo_backward([abs(ct) for ct in c["cotangents"]], n, L, h, lp, np.float64)
        for g, group_results in enumerate(results):
            for r, res in enumerate(group_results):
                where = f"halo_size={h} left_padding={lp} group {g} rank {r}"
                y, jax_y = res[i]["y"], ys[i][r]
                assert y.dtype == torch_cases.DTYPES[dtype] and jax_y.dtype == jnp.dtype(dtype), where
                assert y.shape == (batch, lp + min(r * L, h) + L, *trailing), where
                front = jax_y.shape[1] - y.shape[1]
                assert not jax_y[:, :front].astype(np.float64).any(), where
                np.testing.assert_array_equal(as_numpy(y), jax_y[:, front:].astype(np.float64), err_msg=where)
                jax_grad = grads[i][:, r * L : (r + 1) * L]
                check_gradient(
                    res[i]["grad"], jax_grad, abs_sum[:, r * L : (r + 1) * L], n, dtype, kind, where
                )
                assert not res[i]["mutated"] and not res[i]["cotangent_mutated"], where
    return len(combos) * len(results)


def check_sequence(
    pool, grouping, L, batch, trailing, dtype, kind, seed, transport="torch_impl.gather_sequence"
):
    n = len(group_ranks(grouping)[0])
    rng = np.random.default_rng(seed)
    x = make_data(kind, (batch, n * L, *trailing), dtype, rng)
    ct = make_cotangent(kind, (n, batch, n * L, *trailing), dtype, rng)
    y, grad = jax_harness.run("gather_sequence", jax_array(x, dtype), n, jax_array(ct, dtype))
    config = {"x": x, "cotangents": list(ct), "dtype": dtype, "noncontiguous": seed % 2 == 1}
    results = pool.run(grouping, torch_cases.sequence, [config], transport)
    abs_sum = expected.sequence_backward([abs(c) for c in ct])
    for g, group_results in enumerate(results):
        for r, (res,) in enumerate(group_results):
            where = f"group {g} rank {r}"
            assert res["y"].dtype == torch_cases.DTYPES[dtype] and y.dtype == jnp.dtype(dtype), where
            np.testing.assert_array_equal(as_numpy(res["y"]), y[r].astype(np.float64), err_msg=where)
            sl = slice(r * L, (r + 1) * L)
            check_gradient(res["grad"], grad[:, sl], abs_sum[:, sl], n, dtype, kind, where)
            assert not res["mutated"] and not res["cotangent_mutated"], where


def check_chunk_halos(pool, n, C, batch, trailing, dtype, kind, transport, layout, combos):
    """gather_halo for each (halo_size, left_padding) in combos (halo_size an int or one per
    global chunk) against JAX, chunk by chunk (C tokens each): JAX's static segment is zeros in
    front, then equal to torch's."""
    L = C if layout == "contiguous" else 2 * C
    rng = np.random.default_rng(n * 10 + C)
    x = make_data(kind, (batch, n * L, *trailing), dtype, rng)  # device order: rank r's rows r*L ..
    statics = [expected.static_halo_lens(n, L, h, lp, layout) for h, lp in combos]
    cotangents = [make_cotangent(kind, (n, batch, sum(static), *trailing), dtype, rng) for static in statics]
    ys, grads = jax_harness.run_many(
        "gather_halo",
        jax_array(x, dtype),
        n,
        [{"halo_size": h, "left_padding": lp, "layout": layout} for h, lp in combos],
        [jax_array(ct, dtype) for ct in cotangents],
    )

    def parts(h, lp, r, static):
        """Per chunk: (JAX's rows of its static segment, torch's length)."""
        lens = [lp + w + C for w, _ in expected.halo_segments(n, L, r, h, layout)]
        starts = np.cumsum([0, *static[:-1]])
        return [(slice(a, a + size), n_) for a, size, n_ in zip(starts, static, lens, strict=True)]

    configs = []
    for (h, lp), static, ct in zip(combos, statics, cotangents, strict=True):
        torch_cts = []
        for r in range(n):
            torch_cts.append(
                np.concatenate([ct[r][:, rows][:, -n_:] for rows, n_ in parts(h, lp, r, static)], axis=1)
            )
        configs.append(
            {
                "x": x,
                "cotangents": torch_cts,
                "dtype": dtype,
                "halo_size": h,
                "left_padding": lp,
                "layout": layout,
                "noncontiguous": sum(np.atleast_1d(h)) % 2 == 1,
            }
        )
    results = pool.run(grouping_for(n, C), torch_cases.halo, configs, transport)
    for i, ((h, lp), static, c) in enumerate(zip(combos, statics, configs, strict=True)):
        visible = [np.abs(a) for a in c["cotangents"]]
        abs_sum = expected.layout_halo_backward(visible, n, L, h, lp, layout, np.float64)
        abs_sum = expected.device_order(abs_sum, n, layout)
        for g, r, res in ((g, r, res) for g, rs in enumerate(results) for r, res in enumerate(rs)):
            where = f"{layout} n={n} C={C} halo_size={h} left_padding={lp} group {g} rank {r}"
            y, jax_y, row = as_numpy(res[i]["y"]), ys[i][r].astype(np.float64), 0
            assert y.shape[1] == sum(n_ for _, n_ in parts(h, lp, r, static)), where
            for rows, n_ in parts(h, lp, r, static):
                segment = jax_y[:, rows]
                assert not segment[:, : segment.shape[1] - n_].any(), where
                np.testing.assert_array_equal(y[:, row : row + n_], segment[:, -n_:], err_msg=where)
                row += n_
            sl = slice(r * L, (r + 1) * L)
            check_gradient(res[i]["grad"], grads[i][:, sl], abs_sum[:, sl], n, dtype, kind, where)
            assert not res[i]["mutated"] and not res[i]["cotangent_mutated"], where
