"""No hangs, DeviceMesh groups, torch.compile, long runs and dead peers."""

import multiprocessing as mp
import os
import queue
import re
import tempfile

import numpy as np
import pytest

from cp_support.launch import run_ranks
from parity_tests.harness import expected
from parity_tests.transport import reliability_cases
from torch_impl import validation

# --- cross-rank validation --------------------------------------------------------------------

CULPRIT = {
    "local_length": r"rank 2: gather_sequence of shape \(2, 5, 3\) float32 on cpu",
    "dtype": r"rank 2: gather_sequence of shape \(2, 4, 3\) float64 on cpu",
    "trailing_dims": r"rank 2: gather_halo of shape \(2, 4, 2\) float32 on cpu, halo_size=3",
    "halo_size": r"rank 2: gather_halo of shape \(2, 4, 3\) float32 on cpu, halo_size=5",
    "per_chunk_halo_sizes": r"rank 2: gather_halo of shape \(2, 4, 3\) float32 on cpu, halo_size=per chunk #",
    "function": r"rank 2: gather_metadata of shape \(2, 4, 3\)",
}


@pytest.mark.parametrize("via_env", [False, True], ids=["validate=True", "CP_TRANSPORT_VALIDATE=1"])
@pytest.mark.parametrize("scenario", list(CULPRIT))
def test_mismatched_ranks_all_raise_naming_the_culprit(pool, scenario, via_env):
    """Groups of 4 ranks whose rank 2 differs: every rank raises ValueError within seconds (the
    case's timeout is 20 s; without validation these calls hang or fail obscurely)."""
    results = pool.run(("block", 4), reliability_cases.mismatch, scenario, via_env, timeout=20)
    for group_results in results:
        for message, seconds in group_results:
            assert message is not None and "CP ranks disagree on their inputs" in message
            assert re.search(CULPRIT[scenario], message), message
            assert "ranks 0, 1, 3:" in message and seconds < 5


def test_a_rank_rejecting_its_own_argument_makes_every_rank_raise(pool):
    results = pool.run(("block", 4), reliability_cases.mismatch, "bad_local_argument", False, timeout=20)
    for group_results in results:
        for r, (message, seconds) in enumerate(group_results):
            if r == 1:
                assert message == "`halo_size` must be a non-negative int, got -1"
            else:
                assert (
                    message
                    == "gather_halo: CP ranks [1] rejected their own arguments (see the error on those ranks)"
                )
            assert seconds < 5


def test_left_padding_may_differ_between_ranks(pool):
    results = pool.run(("block", 4), reliability_cases.left_padding_may_differ)
    assert results[0] == [(2, 3 + 4, 3)] * 4  # 3 zeros or halo tokens, then the 4 own tokens


# --- groups -----------------------------------------------------------------------------------


def test_device_mesh_and_alternating_groups():
    """DP x CP mesh on 4 gloo ranks: the CP and DP sub-meshes used alternately give exact results."""
    for refused, rounds in run_ranks(reliability_cases.mesh_and_alternating_groups, 4, timeout_s=120):
        assert "`group` must be a 1-D DeviceMesh, got a 2-D one" in refused and "mesh['cp']" in refused
        assert len(rounds) == 6
        for name, r, ranks, y, h, grad in rounds:
            assert ranks in (([0, 1], [2, 3]) if name == "cp" else ([0, 2], [1, 3]))
            full = np.concatenate([reliability_cases._rank_input(k).numpy() for k in range(2)], axis=1)
            np.testing.assert_array_equal(y.numpy(), full)
            np.testing.assert_array_equal(h.numpy(), expected.halo_forward(full, 2, 5, 0)[r])
            ones = [np.ones_like(o) * 10 for o in expected.halo_forward(full, 2, 5, 0)]
            want = expected.halo_backward(ones, 2, 4, 5, 0, np.float32) + 2  # + the gather's 2 ranks
            np.testing.assert_array_equal(grad.numpy(), want[:, r * 4 : (r + 1) * 4])


# --- torch.compile ----------------------------------------------------------------------------


# inductor's C++ compile takes about 25 s: `make test-all`
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_torch_compile_fullgraph_matches_eager(pool, backend):
    """Every function traces whole (fullgraph=True): gather_halo through its all_to_all exchange,
    a bool mask gathered and used as a `where` condition (inductor's CPU code generator needs it
    sent as bytes)."""
    functions = ("gather_sequence", "gather_metadata", "gather_metadata_bool", "gather_halo")
    (results,) = pool.run(
        ("first", 2), reliability_cases.compiled_matches_eager, backend, functions, timeout=240
    )
    for per_rank in results:
        assert per_rank == {(name, batch): True for name in functions for batch in (1, 2)}


# --- long runs --------------------------------------------------------------------------------


def test_500_calls_do_not_grow_memory_and_repeat_exactly(pool):
    results = pool.run(("block", 4), reliability_cases.long_run, 500, 50, timeout=180)
    reports = [report for group_results in results for report in group_results]
    for name in reports[0]:
        growth = [report[name]["rss_growth_mib"] for report in reports]
        start = [report[name]["rss_start_mib"] for report in reports]
        print(
            f"{name}: 500 calls, resident set {min(start):.0f}-{max(start):.0f} MiB after warm-up, "
            f"growth {min(growth):+.2f} to {max(growth):+.2f} MiB over {len(reports)} ranks"
        )
        assert all(report[name]["identical"] for report in reports), name
        assert max(growth) < 8, (name, growth)


# --- a dead peer ------------------------------------------------------------------------------


@pytest.mark.parametrize("function", ["gather_sequence", "gather_halo"])
def test_a_dead_peer_is_an_error_not_a_hang(function):
    """Rank 0 dies after joining; rank 1's call raises (gloo sees the closed connection) promptly."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=reliability_cases.survive_dead_peer, args=(r, store, function, results), daemon=True
            )
            for r in range(2)
        ]
        for p in procs:
            p.start()
        try:
            outcome, seconds = results.get(timeout=90)
        except queue.Empty:
            outcome, seconds = "no answer in 90 s", None
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    assert outcome != "returned" and not outcome.startswith("no answer"), outcome
    assert seconds < 25, (outcome, seconds)


def test_validation_is_off_by_default(monkeypatch):
    monkeypatch.delenv(validation.ENV_VAR, raising=False)
    assert not validation.enabled(None) and validation.enabled(True)
    monkeypatch.setenv(validation.ENV_VAR, "1")
    assert validation.enabled(None) and not validation.enabled(False)
