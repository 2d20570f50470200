"""torch_impl against jax_reference, forward and backward, on simulated CPU clusters: contiguous
shards (parity_checks states how and within what; test_parity_layouts: head_tail and per-chunk
halos)."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import numpy as np
import pytest

from parity_tests.harness import expected, jax_harness
from parity_tests.transport import torch_cases
from parity_tests.transport.parity_checks import (
    DATA,
    DTYPES,
    HALO_PATHS,
    LOCAL_LENS,
    TRAILING,
    WORLDS,
    as_numpy,
    check_halo,
    check_sequence,
    grouping_for,
    jax_array,
    round_to,
)

# --- gather_halo ------------------------------------------------------------------------------


def halo_sizes(n, L):
    return sorted({0, 1, L - 1, L, L + 1, 2 * L + 1, (n - 1) * L, n * L + 7})


def halo_matrix():
    """Every (n, L); all halo sizes and paddings of one (n, L) in one case. Batch, trailing dims, dtype
    and grouping rotate so that each n sees every dtype and each dtype every trailing shape."""
    for i, n in enumerate(WORLDS):
        for j, L in enumerate(LOCAL_LENS):
            yield n, L, 1 + (i + j) % 2, TRAILING[(i + 2 * j) % 3], DTYPES[j], grouping_for(n, j)


@pytest.mark.parametrize("transport", HALO_PATHS)
@pytest.mark.parametrize("kind", DATA)
@pytest.mark.parametrize("n,L,batch,trailing,dtype,grouping", list(halo_matrix()), ids=str)
def test_gather_halo_parity(pool, n, L, batch, trailing, dtype, grouping, kind, transport):
    combos = [(h, lp) for h in halo_sizes(n, L) for lp in (0, 1, 3)]
    check_halo(pool, grouping, L, batch, trailing, dtype, kind, combos, seed=n * 100 + L, transport=transport)


# --- gather_sequence and gather_metadata ------------------------------------------------------


@pytest.mark.parametrize("kind", DATA)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", WORLDS)
def test_gather_sequence_parity(pool, n, dtype, kind):
    for j, L in enumerate(LOCAL_LENS):
        trailing, batch = TRAILING[j % 3], 1 + j % 2
        check_sequence(pool, grouping_for(n, j), L, batch, trailing, dtype, kind, seed=n * 10 + j)


@pytest.mark.parametrize("n", WORLDS)
def test_gather_metadata_parity(pool, n):
    """Positions (int64), a bool mask and a float projection: equal on both sides, no gradient."""
    L = 5
    positions = np.broadcast_to(np.arange(n * L), (2, n * L)).astype(np.int64)
    mask = expected.stamped((2, n * L), np.int64) % 4 != 0
    projection = round_to(np.random.default_rng(n).standard_normal((2, n * L, 2, 3)), "float32")
    inputs = [(positions, "int64"), (mask, "bool"), (projection, "float32")]
    results = pool.run(
        grouping_for(n, n),
        torch_cases.metadata,
        [{"x": a, "dtype": d, "noncontiguous": d == "bool"} for a, d in inputs],
    )
    for i, (a, dtype) in enumerate(inputs):
        ct = np.ones((n, *a.shape), np.float32) if dtype == "float32" else None
        y, grad = jax_harness.run("gather_metadata", jax_array(a, dtype), n, ct)
        assert grad is None or not grad.any()
        for group_results in results:
            for r, res in enumerate(group_results):
                got = res[i]["y"]
                assert not res[i]["requires_grad"] and str(got.dtype).removeprefix("torch.") == dtype
                np.testing.assert_array_equal(as_numpy(got), y[r].astype(as_numpy(got).dtype))


# --- random configurations --------------------------------------------------------------------


@settings(
    max_examples=20,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    n=st.sampled_from(WORLDS),
    batch=st.integers(1, 2),
    L=st.integers(1, 6),
    trailing=st.sampled_from([(), (1,), (3,), (2, 3)]),
    dtype=st.sampled_from(DTYPES),
    kind=st.sampled_from(DATA),
    halo_fraction=st.floats(0, 1.2),
    left_padding=st.integers(0, 4),
    variant=st.integers(0, 1),
)
def test_random_configurations(
    pool, n, batch, L, trailing, dtype, kind, halo_fraction, left_padding, variant
):
    halo_size = int(halo_fraction * n * L)
    grouping = grouping_for(n, variant)
    check_halo(pool, grouping, L, batch, trailing, dtype, kind, [(halo_size, left_padding)], seed=halo_size)
    check_sequence(pool, grouping, L, batch, trailing, dtype, kind, seed=left_padding)


# --- the suite can fail -----------------------------------------------------------------------

MUTANTS = [
    ("halo", "parity_tests.harness.mutants.halo_off_by_one", "integer"),
    ("halo", "parity_tests.harness.mutants.halo_off_by_one", "normal"),
    ("halo", "parity_tests.harness.mutants.halo_grad_to_wrong_owner", "integer"),
    ("halo", "parity_tests.harness.mutants.halo_grad_to_wrong_owner", "normal"),
    ("sequence", "parity_tests.harness.mutants.sequence_wrong_rank_order", "integer"),
    ("sequence", "parity_tests.harness.mutants.sequence_wrong_rank_order", "normal"),
]


@pytest.mark.parametrize("function,transport,kind", MUTANTS)
def test_self_check_catches_wrong_transports(pool, function, transport, kind):
    """Each deliberately wrong transport fails the comparison that the parity tests use."""
    grouping, L = ("block", 4), 3
    with pytest.raises(AssertionError):
        if function == "halo":
            check_halo(pool, grouping, L, 1, (2,), "float32", kind, [(4, 1)], seed=0, transport=transport)
        else:
            check_sequence(pool, grouping, L, 1, (2,), "float32", kind, seed=0, transport=transport)
