"""The reductions over a sharded row (sum_sequence, select_position, last_position): jax_reference
against numpy's whole-row arithmetic, torch_impl against both, forward and backward, both layouts.

Rank r of n holds tokens [r*L, (r+1)*L) (head_tail: chunks r and 2n-1-r of L/2). A row's value is
the same on every rank; its gradient at a token is the sum of every rank's cotangent (each rank uses
the value in its own way), and it reaches only the tokens that were summed or selected.
"""

import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import jax_reference
from parity_tests.harness import expected, jax_harness
from parity_tests.transport import torch_cases
from parity_tests.transport.parity_checks import UNIT_ROUNDOFF, WORLDS, as_numpy, round_to

LAYOUTS = ("contiguous", "head_tail")


def test_jax_reference_worked_example():
    """The module docstring's example: n=2, L=2, log-probs [1 2 | 3 4], mask [0 1 | 1 0]."""
    mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    sharded = NamedSharding(mesh, P(None, "cp"))

    def per_device(x, mask):
        total = jax_reference.sum_sequence(x, "cp", mask)
        last = jax_reference.last_position(mask, "cp")
        return total[None], last[None], jax_reference.select_position(x, last, "cp")[None]

    run = jax.shard_map(per_device, mesh=mesh, in_specs=(P(None, "cp"),) * 2, out_specs=P("cp"))
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.array([[1.0, 2, 3, 4]]), sharded)
        mask = jax.device_put(jnp.array([[False, True, True, False]]), sharded)
        total, last, picked = run(x, mask)
        cotangent = jax.device_put(jnp.array([[2.0], [5.0]]), NamedSharding(mesh, P("cp")))  # per device
        (grad,) = jax.vjp(lambda x: run(x, mask)[0], x)[1](cotangent)
    assert (
        total.tolist() == [[5.0], [5.0]] and last.tolist() == [[2], [2]] and picked.tolist() == [[3.0], [3.0]]
    )
    assert grad.tolist() == [[0.0, 7.0, 7.0, 0.0]]  # g = 2 + 5 at the tokens that counted


def whole_row(x, mask, position, ct_sum, ct_select):
    """numpy over the global row (float64): the three values and x's gradient."""
    B = x.shape[0]
    total = np.where(mask.reshape(*mask.shape, *(1,) * (x.ndim - 2)), x, 0).sum(axis=1)
    picked = x[np.arange(B), position]
    S = mask.shape[1]
    last = np.where(mask, np.arange(S)[None], -1).max(axis=1)
    grad = np.zeros_like(x)
    grad += mask.reshape(*mask.shape, *(1,) * (x.ndim - 2)) * ct_sum.sum(axis=0)[:, None]
    grad[np.arange(B), position] += ct_select.sum(axis=0)
    return total, picked, last, grad


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", WORLDS)
def test_reductions_parity(pool, n, layout):
    """Integer data (float64, float32): numpy, jax_reference and torch_impl equal to the bit. Normal
    data (float32, float64): torch_impl within the rounding of its two sums (L local tokens, then n
    ranks: (L + n) unit roundoffs of the absolute sum, doubled) of the exact row, and so is JAX;
    select_position is exact (a value plus zeros). Every rank receives bytes per row, whatever L."""
    B, L, trailing = 3, 4, (2,)
    S, rng, configs, cases = n * L, np.random.default_rng(10 * n + len(layout)), [], []
    for kind, dtype in (
        ("integer", "float64"),
        ("integer", "float32"),
        ("normal", "float32"),
        ("normal", "float64"),
    ):
        x = expected.stamped((B, S, *trailing), np.int64).astype(np.float64) * rng.choice([-1, 1], (B, S, 1))
        if kind == "normal":
            x = round_to(rng.standard_normal((B, S, *trailing)), dtype)
        mask = rng.random((B, S)) < 0.6
        mask[1] = False  # a row with no token counted: its sum is zero, its last position -1
        position = np.array([0, S - 1, rng.integers(S)])
        cts = [rng.integers(-3, 4, (n, B, *trailing)).astype(np.float64) for _ in range(2)]
        configs.append(
            {
                "x": expected.device_order(x, n, layout),
                "mask": expected.device_order(mask, n, layout),
                "position": position,
                "dtype": dtype,
                "layout": layout,
                "cotangents": cts,
            }
        )
        cases.append((kind, dtype, x, mask, position, cts))
    grouping = ("block", n)  # every group of n consecutive ranks of the pool
    results = pool.run(grouping, torch_cases.reductions, configs)
    for i, (kind, dtype, x, mask, position, cts) in enumerate(cases):
        want = whole_row(x, mask, position, *cts)
        cast = np.float32 if dtype == "float32" else np.float64
        c = configs[i]
        (jsum, jselect, jlast), jgrad = jax_harness.run_reductions(
            c["x"].astype(cast), c["mask"], position, n, layout, [ct.astype(cast) for ct in cts]
        )
        u = UNIT_ROUNDOFF[dtype]
        sum_bound = 0.0 if kind == "integer" else 2 * (L + n) * u * np.abs(x).sum(axis=1)
        grad_bound = 0.0 if kind == "integer" else 2 * n * u * (np.abs(cts[0]).sum(0) + np.abs(cts[1]).sum(0))
        for r in range(n):
            assert np.all(np.abs(jsum[r] - want[0]) <= sum_bound), (kind, dtype, r)
            np.testing.assert_array_equal(jselect[r], want[1])
            np.testing.assert_array_equal(jlast[r], want[2])
        assert np.all(np.abs(jgrad - expected.device_order(want[3], n, layout)) <= np.max(grad_bound))
        itemsize = 4 if dtype == "float32" else 8
        moved = 2 * (n - 1) * B * int(np.prod(trailing)) * itemsize // n
        for group_results in results:
            for r, rank in enumerate(group_results):
                res, where = rank[i], f"{kind} {dtype} {layout} n={n} rank {r}"
                assert str(res["sum"].dtype) == f"torch.{dtype}" and res["last"].dtype.is_signed, where
                assert np.all(np.abs(as_numpy(res["sum"]) - want[0]) <= sum_bound), where
                np.testing.assert_array_equal(as_numpy(res["select"]), want[1], err_msg=where)
                np.testing.assert_array_equal(res["last"].numpy(), want[2], err_msg=where)
                mine = expected.device_order(want[3], n, layout)[:, r * L : (r + 1) * L]
                assert np.all(np.abs(as_numpy(res["grad"]) - mine) <= np.max(grad_bound)), where
                assert not res["mutated"], where
                wanted = (
                    {} if n == 1 else {"forward": 2 * moved + 2 * (n - 1) * B * 8 // n, "backward": 2 * moved}
                )
                assert res["received"] == wanted, (where, res["received"], wanted)


BAD = [  # (function, x shape, x dtype, mask / position / layout, validate), what the message says
    (("sum_sequence", (2, 4), "bool", None, None), "must hold numbers"),
    (("sum_sequence", (2, 4, 3), "float32", np.ones((2, 3), bool), None), "`mask` must be a bool tensor"),
    (
        ("select_position", (2, 4), "float32", np.zeros(3, np.int64), None),
        r"`position` must be an integer tensor \[batch\]",
    ),
    (("select_position", (2, 4), "float32", np.zeros(2), None), "`position` must be an integer"),
    (("last_position", (2, 4), "float32", "contiguous", None), "`mask` must be a bool tensor"),
    (("last_position", (2, 3), "bool", "head_tail", None), "needs an even local_sequence"),
    (("sum_sequence", (4,), "float32", None, None), r"\[batch, local_sequence, ...\]"),
]


def test_reductions_refuse_bad_arguments_on_every_rank(pool):
    """Every bad call raises ValueError on every rank before anything moves, and a sum after them
    shows no rank was left waiting."""
    import torch

    calls = [
        (f, shape, dtype, torch.from_numpy(extra) if isinstance(extra, np.ndarray) else extra, validate)
        for (f, shape, dtype, extra, validate), _ in BAD
    ]
    (results,) = pool.run(("first", 4), torch_cases.bad_reductions, calls)
    for messages, total in results:
        for message, (_, match) in zip(messages, BAD, strict=True):
            assert message is not None and re.search(match, message), (message, match)
        assert total == 4.0
