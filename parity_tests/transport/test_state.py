"""gather_state, the recurrent-state transport: jax_reference against a token-by-token recurrence,
torch_impl against jax_reference (forward and backward, n = 1..8, both layouts), its bytes, and its
refusals.

Exact data: each A is a signed partial permutation (every row at most one +-1), so no product grows
and every state and gradient is a small integer, exact in float32 and float64: a misrouted map, a
map from the wrong rank or a transposed A changes them. Random normal data: both sides compute the
same sums in other orders; each result is within gamma_d * (the same computation on |A|, |B| and
|cotangent|) of the exact one, d the longest chain of roundings (per chunk a matmul of m products
and one addition, forward, and as much again backward, plus the n-term reduce-scatter), so the two
differ by at most twice that: the bound asserted.
"""

import re

import numpy as np
import pytest

from parity_tests.harness import jax_harness
from parity_tests.transport import torch_cases
from parity_tests.transport.parity_checks import UNIT_ROUNDOFF, as_numpy

WORLDS = range(1, 9)
LAYOUTS = ["contiguous", "head_tail"]


def chunks(layout, n, r):
    return (r,) if layout == "contiguous" else (r, 2 * n - 1 - r)


def device_order(maps, n, layout):
    """[batch, N, ...] in global chunk order -> device r's k maps at rows r*k .."""
    return np.concatenate([maps[:, list(chunks(layout, n, r))] for r in range(n)], axis=1)


def make_maps(rng, batch, N, heads, m, p, kind, dtype):
    """A [batch, N, heads, m, m], B [batch, N, heads, m, p] in global chunk order."""
    if kind == "integer":
        A = np.zeros((batch, N, heads, m, m))
        rows = rng.integers(0, m + 1, size=(batch, N, heads, m))  # column m: an empty row
        signs = rng.choice([-1.0, 1.0], size=rows.shape)
        for index in np.ndindex(rows.shape):
            if rows[index] < m:
                A[(*index, rows[index])] = signs[index]
        B = rng.integers(-2, 3, size=(batch, N, heads, m, p)).astype(np.float64)
        return A, B
    round_to = {"float32": np.float32, "float64": np.float64}[dtype]
    A = rng.standard_normal((batch, N, heads, m, m)).astype(round_to).astype(np.float64) / np.sqrt(m)
    return A, rng.standard_normal((batch, N, heads, m, p)).astype(round_to).astype(np.float64)


def sequential_states(A, B):
    """The state entering every chunk: S_0 = 0, S_{c+1} = A_c @ S_c + B_c, token by token in
    global order (float64)."""
    states = [np.zeros_like(B[:, 0])]
    for c in range(A.shape[1] - 1):
        states.append(A[:, c] @ states[-1] + B[:, c])
    return np.stack(states, axis=1)


def test_jax_reference_worked_example():
    """The docstring's: scalar maps (2, 1), (3, 1), (5, 1) on 3 devices give 0, 1, 4."""
    A = np.array([2.0, 3.0, 5.0]).reshape(1, 3, 1, 1)
    states, _ = jax_harness.run_state(A, np.ones_like(A), 3, "contiguous", np.zeros((3, 1, 1, 1, 1)))
    assert states.ravel().tolist() == [0.0, 1.0, 4.0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_jax_reference_is_the_recurrence_token_by_token(layout):
    """A recurrence of 2 tokens a chunk (S <- a_t S + b_t): each chunk's (A, B) composed from its
    tokens; every device's states equal the recurrence run over the whole sequence."""
    n, T, rng = 4, 2, np.random.default_rng(0)
    k = 1 if layout == "contiguous" else 2
    N = n * k
    a = rng.integers(-1, 2, size=(1, N * T, 2, 3, 3)).astype(np.float64)
    b = rng.integers(-2, 3, size=(1, N * T, 2, 3, 4)).astype(np.float64)
    A = np.broadcast_to(np.eye(3), (1, N, 2, 3, 3)).copy()
    B = np.zeros((1, N, 2, 3, 4))
    for t in range(N * T):
        c = t // T
        A[:, c], B[:, c] = a[:, t] @ A[:, c], a[:, t] @ B[:, c] + b[:, t]
    S, entering = np.zeros((1, 2, 3, 4)), []
    for t in range(N * T):
        if t % T == 0:
            entering.append(S)
        S = a[:, t] @ S + b[:, t]
    entering = np.stack(entering, axis=1)
    ct = np.zeros((n, 1, k, 2, 3, 4))
    states, _ = jax_harness.run_state(device_order(A, n, layout), device_order(B, n, layout), n, layout, ct)
    for r in range(n):
        np.testing.assert_array_equal(states[r], entering[:, list(chunks(layout, n, r))])


def vjp_reference(A, B, ct_by_chunk):
    """Gradients of sum(ct * states) for states = sequential_states(A, B), by the reverse
    recurrence (float64): G_c flows into S_{c+1}."""
    N = A.shape[1]
    S = sequential_states(A, B)
    gA, gB, G = np.zeros_like(A), np.zeros_like(B), np.zeros_like(B[:, 0])
    for c in range(N - 1, -1, -1):
        if c < N - 1:
            gA[:, c] = G @ np.swapaxes(S[:, c], -1, -2)
            gB[:, c] = G
            G = np.swapaxes(A[:, c], -1, -2) @ G
        G = G + ct_by_chunk[:, c]
    return gA, gB


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", WORLDS)
def test_gather_state_parity(pool, n, layout):
    """torch_impl against jax_reference on every group of n consecutive ranks of the pool: integer
    maps (float64 and float32, equal to the bit, and equal to the float64 recurrence and its reverse
    recurrence) and normal ones (float32, float64) within the bound above. Each rank receives n-1
    ranks' maps forward and returns as much backward: k * batch * heads * m * (m + p) values each."""
    k = 1 if layout == "contiguous" else 2
    N, batch, heads, m, p = n * k, 2, 3, 4, 5
    rng, configs, cases = np.random.default_rng(n), [], []
    for kind, dtype in (
        ("integer", "float64"),
        ("integer", "float32"),
        ("normal", "float32"),
        ("normal", "float64"),
    ):
        A, B = make_maps(rng, batch, N, heads, m, p, kind, dtype)
        ct = rng.integers(-2, 3, size=(batch, N, heads, m, p)).astype(np.float64)
        if kind == "normal":
            ct = rng.standard_normal(ct.shape)
        ct_device = device_order(ct, n, layout).reshape(batch, n, k, heads, m, p).swapaxes(0, 1)
        cases.append((kind, dtype, A, B, ct, ct_device))
        configs.append(
            {
                "A": device_order(A, n, layout),
                "B": device_order(B, n, layout),
                "dtype": dtype,
                "layout": layout,
                "cotangents": list(ct_device),
            }
        )
    results = pool.run(("block", n) if 8 % n == 0 or n == 3 else ("first", n), torch_cases.state, configs)
    for i, (kind, dtype, A, B, ct, ct_device) in enumerate(cases):
        cast = {"float32": np.float32, "float64": np.float64}[dtype]
        ys, (jA, jB) = jax_harness.run_state(
            configs[i]["A"].astype(cast), configs[i]["B"].astype(cast), n, layout, ct_device.astype(cast)
        )
        if kind == "integer":  # the recurrence itself, and both sides equal to it
            want = sequential_states(A, B)
            gA, gB = (device_order(g, n, layout) for g in vjp_reference(A, B, ct))
            for r in range(n):
                np.testing.assert_array_equal(ys[r], want[:, list(chunks(layout, n, r))])
            np.testing.assert_array_equal(jA, gA), np.testing.assert_array_equal(jB, gB)
            bounds = (np.zeros(ys.shape), np.zeros(jA.shape), np.zeros(jB.shape))  # equal to the bit
        else:
            absolute, (aA, aB) = jax_harness.run_state(
                np.abs(configs[i]["A"]), np.abs(configs[i]["B"]), n, layout, np.abs(ct_device)
            )
            depth = N * (2 * m + p + 2) + n
            bounds = tuple(2 * depth * UNIT_ROUNDOFF[dtype] * a for a in (absolute, aA, aB))
        itemsize = 8 if dtype == "float64" else 4
        for group_results in results:
            for r, rank in enumerate(group_results):
                res, where = rank[i], f"{kind} {dtype} {layout} n={n} rank {r}"
                rows = slice(r * k, (r + 1) * k)
                assert res["y"].shape == (batch, k, heads, m, p) and str(res["y"].dtype) == f"torch.{dtype}"
                assert np.all(np.abs(as_numpy(res["y"]) - ys[r]) <= bounds[0][r]), where
                for got, want, bound in zip(res["grads"], (jA, jB), bounds[1:], strict=True):
                    assert np.all(np.abs(as_numpy(got) - want[:, rows]) <= bound[:, rows]), where
                assert not res["mutated"], where
                wanted = (n - 1) * k * batch * heads * m * (m + p) * itemsize
                assert res["received"] == ({"forward": wanted, "backward": wanted} if n > 1 else {}), where


BAD = [  # (A shape, B shape, B dtype, layout, validate, per-rank B widths), what the message says
    (((2, 1, 3, 4, 4), (2, 1, 3, 4, 5), "float64", "contiguous", None, None), "`B` must be"),
    (((2, 1, 3, 4, 3), (2, 1, 3, 4, 5), "float32", "contiguous", None, None), r"`A` must be \[batch, 1"),
    (((2, 1, 3, 4, 4), (2, 1, 3, 4, 5), "float32", "head_tail", None, None), r"`A` must be \[batch, 2"),
    (((2, 1, 4, 4), (2, 1, 3, 5), "float32", "contiguous", None, None), "`B` must be"),
    (((2, 1, 4, 4), (2, 1, 4, 5), "int64", "contiguous", None, None), "`B` must be a floating-point"),
    (((2, 1, 4, 4), (2, 1, 4, 5), "float32", "balanced", None, None), "`layout` must be one of"),
    (((2, 1, 4, 4), (2, 1, 4, 5), "float32", "contiguous", True, (5, 6, 5, 5)), "disagree on their inputs"),
]


def test_gather_state_refuses_bad_arguments_on_every_rank(pool):
    """Every bad call raises ValueError on every rank before any map moves (ranks that disagree on
    B's width: with validate=True), and a gather after them shows no rank was left waiting."""
    (results,) = pool.run(("first", 4), torch_cases.bad_state, [call for call, _ in BAD])
    for messages, gathered in results:
        for message, (_, match) in zip(messages, BAD, strict=True):
            assert message is not None and re.search(match, message), (message, match)
        assert gathered == [float(r + 1) for r in range(4) for _ in range(2)]
