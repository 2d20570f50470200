"""torch_impl against jax_reference under the head_tail layout, and gather_halo with one halo
size per global chunk (packed documents' reach) under both layouts (parity_checks states how and
within what)."""

import numpy as np
import pytest

import jax_reference
from parity_tests.harness import expected, jax_harness
from parity_tests.transport import torch_cases
from parity_tests.transport.parity_checks import (
    DATA,
    HALO_PATHS,
    as_numpy,
    check_chunk_halos,
    check_gradient,
    grouping_for,
    jax_array,
    make_cotangent,
    make_data,
)

HEAD_TAIL = [  # (n, C, batch, trailing, dtype): L = 2C
    (1, 2, 1, (), "float32"),
    (2, 1, 2, (3,), "bfloat16"),
    (2, 3, 1, (2, 3), "float64"),
    (3, 2, 2, (), "float16"),
    (4, 2, 1, (3,), "float32"),
    (8, 1, 1, (), "bfloat16"),
]
# gather_sequence reverses the tails' chunks in strips of ceil(C/8) rows: chunks that end in a
# partial strip (C = 11: strips of 2; C = 100: of 13)
PARTIAL_STRIPS = [(2, 11, 1, (2,), "float32"), (3, 100, 2, (), "float64")]


def check_head_tail_halo(pool, n, C, batch, trailing, dtype, kind, transport):
    """Every chunk's window against JAX's static-shape one (per chunk: zeros in front, then equal),
    halo sizes from none through windows spanning one to three chunks to more than the prefix."""
    combos = [
        (h, lp)
        for h in sorted({0, 1, C, C + 1, 2 * C + 1, 3 * C, (2 * n - 1) * C, 2 * n * C + 3})
        for lp in (0, 2)
    ]
    check_chunk_halos(pool, n, C, batch, trailing, dtype, kind, transport, "head_tail", combos)


@pytest.mark.parametrize("transport", HALO_PATHS)
@pytest.mark.parametrize("kind", DATA)
@pytest.mark.parametrize("n,C,batch,trailing,dtype", HEAD_TAIL, ids=str)
def test_head_tail_halo_parity(pool, n, C, batch, trailing, dtype, kind, transport):
    check_head_tail_halo(pool, n, C, batch, trailing, dtype, kind, transport)


@pytest.mark.parametrize("transport", HALO_PATHS)
@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
@pytest.mark.parametrize("n,C", [(2, 3), (3, 2), (4, 1)])
def test_lookahead_parity(pool, n, C, layout, transport):
    """gather_halo's lookahead (the tokens after each chunk, from the later ranks that hold them:
    the rest of an image) against JAX's: a window and one token ahead, ahead into the chunk after
    the next, past the sequence's end, one per chunk; each rank's output is JAX's without its
    static zeros, and the gradients (integer-valued) are equal."""
    L, chunks = (C, n) if layout == "contiguous" else (2 * C, 2 * n)
    combos = [
        (0, 1),
        (1, C + 1),
        (2, 3 * C),
        (0, 2 * n * L),
        (C, tuple((2 * c + 1) % (2 * C + 1) for c in range(chunks))),
    ]
    rng = np.random.default_rng(n)
    x = make_data("integer", (2, n * L, 3), "float32", rng)  # device order
    rows = [
        [np.array(jax_reference.halo_rows(n, L, r, h, 0, layout, a)) for r in range(n)] for h, a in combos
    ]
    cts = [make_cotangent("integer", (n, 2, len(held[0]), 3), "float32", rng) for held in rows]
    for ct, held in zip(cts, rows, strict=True):
        for r in range(n):
            ct[r][:, held[r] < 0] = 0  # JAX's static zeros: no torch position
    ys, grads = jax_harness.run_many(
        "gather_halo",
        jax_array(x, "float32"),
        n,
        [{"halo_size": h, "lookahead": a, "layout": layout} for h, a in combos],
        [jax_array(ct, "float32") for ct in cts],
    )
    configs = [
        {
            "x": x,
            "dtype": "float32",
            "halo_size": h,
            "left_padding": 0,
            "layout": layout,
            "lookahead": a,
            "cotangents": [ct[r][:, held[r] >= 0] for r in range(n)],
        }
        for (h, a), ct, held in zip(combos, cts, rows, strict=True)
    ]
    results = pool.run(grouping_for(n, C), torch_cases.halo, configs, transport)
    for i, (h, a) in enumerate(combos):
        for g, r, res in ((g, r, res[i]) for g, rs in enumerate(results) for r, res in enumerate(rs)):
            where = f"{layout} n={n} C={C} halo_size={h} lookahead={a} group {g} rank {r}"
            real = ys[i][r][:, rows[i][r] >= 0]
            np.testing.assert_array_equal(as_numpy(res["y"]), real, err_msg=where)
            np.testing.assert_array_equal(
                as_numpy(res["grad"]), grads[i][:, r * L : (r + 1) * L], err_msg=where
            )
            assert not res["mutated"] and not res["cotangent_mutated"], where


def per_chunk_halos(n, C, layout):
    """Per-chunk halo sizes as packed documents give them (the distance back to each chunk's first
    document's start, capped by a window): none, inside one chunk, across several ranks, past the
    prefix, and one chunk reaching where its neighbours reach nothing."""
    chunks = n if layout == "contiguous" else 2 * n
    yield (0,) * chunks
    yield tuple(c % 2 * (C - 1) for c in range(chunks))  # inside the previous chunk, every other one
    yield tuple(min(c * C, (c % 3) * C + 1) for c in range(chunks))  # 0, C + 1, 2C + 1 chunks back
    yield tuple(c * C + 5 if c == chunks - 1 else 0 for c in range(chunks))  # the last: past its prefix
    yield tuple((chunks - c) * C // 2 for c in range(chunks))  # longer for earlier chunks


@pytest.mark.parametrize("transport", HALO_PATHS)
@pytest.mark.parametrize("kind", DATA)
@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
@pytest.mark.parametrize("n,C,batch,trailing,dtype", [(3, 2, 2, (3,), "float32"), (4, 3, 1, (), "float64")])
def test_per_chunk_halo_parity(pool, n, C, batch, trailing, dtype, kind, transport, layout):
    """halo_size one per global chunk (packed documents' reach): each chunk's window only its own
    h_c tokens, gradients back to their owners, JAX's zeros in front of them."""
    combos = [(h, lp) for h in per_chunk_halos(n, C, layout) for lp in (0, 1)]
    check_chunk_halos(pool, n, C, batch, trailing, dtype, kind, transport, layout, combos)


@pytest.mark.parametrize("kind", DATA)
@pytest.mark.parametrize("n,C,batch,trailing,dtype", HEAD_TAIL + PARTIAL_STRIPS, ids=str)
def test_head_tail_sequence_and_metadata_parity(pool, n, C, batch, trailing, dtype, kind):
    """gather_sequence: the global order on every rank, gradients summed back to the owners of
    both chunks; gather_metadata: the same order, no gradient."""
    L, layout = 2 * C, "head_tail"
    rng = np.random.default_rng(n + C)
    x = make_data(kind, (batch, n * L, *trailing), dtype, rng)  # device order
    ct = make_cotangent(kind, (n, batch, n * L, *trailing), dtype, rng)
    y, grad = jax_harness.run("gather_sequence", jax_array(x, dtype), n, jax_array(ct, dtype), layout=layout)
    config = {"x": x, "cotangents": list(ct), "dtype": dtype, "layout": layout, "noncontiguous": C % 2 == 1}
    positions = expected.device_order(np.broadcast_to(np.arange(n * L), (batch, n * L)), n, layout)
    meta = {"x": positions, "dtype": "int64", "layout": layout}
    seqs = pool.run(grouping_for(n, C), torch_cases.sequence, [config])
    metas = pool.run(grouping_for(n, C), torch_cases.metadata, [meta])
    abs_sum = expected.device_order(np.abs(ct).sum(0), n, layout)
    for g, (seq, met) in enumerate(zip(seqs, metas, strict=True)):
        for r in range(n):
            where = f"head_tail n={n} C={C} group {g} rank {r}"
            res = seq[r][0]
            np.testing.assert_array_equal(as_numpy(res["y"]), y[r].astype(np.float64), err_msg=where)
            sl = slice(r * L, (r + 1) * L)
            check_gradient(res["grad"], grad[:, sl], abs_sum[:, sl], n, dtype, kind, where)
            assert not res["mutated"] and not res["cotangent_mutated"], where
            global_order = np.broadcast_to(np.arange(n * L), (batch, n * L))
            np.testing.assert_array_equal(met[r][0]["y"].numpy(), global_order, err_msg=where)
