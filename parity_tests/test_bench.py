"""`make bench` keeps working: its quick mode end to end (no timing assertions), and its arithmetic."""

import json

import pytest

from benchmarks import cp_bench
import torch_impl


def test_quick_mode_runs_and_counts_the_minimum_bytes(tmp_path, capsys):
    json_path, plot_path = tmp_path / "bench.json", tmp_path / "bench.png"
    rows = cp_bench.main(["--quick", "--json", str(json_path), "--plot", str(plot_path)])
    assert "# targets" in capsys.readouterr().out
    assert json.loads(json_path.read_text()) == json.loads(json.dumps(rows))
    assert plot_path.stat().st_size > 10_000
    variants = {(r["halo_size"], r["variant"]) for r in rows}
    assert {
        (None, v) for v in ("torch_impl", "list_cat", "funcol", "dtensor", "raw", "raw_alloc")
    } <= variants
    assert {(256, v) for v in ("torch_impl", "full_then_slice", "neighbour_ring", "raw")} <= variants
    for r in rows:
        assert r["fb_ms"] > 0 and r["peak_mib"] >= 0 and r["calls"] > 0
        if r["variant"] in ("torch_impl", "raw", "list_cat"):
            assert r["recv_is_min"], r  # counted at the c10d calls, equal to the analytic minimum
        if r["variant"] == "full_then_slice":
            assert min(r["recv"]) > max(r["min"])


@pytest.mark.parametrize("n,L", [(2, 3), (4, 4), (5, 2)])
def test_analytic_minimum_matches_the_plan(n, L):
    for halo_size in range(n * L + 2):
        plan = torch_impl.halo_plan(n, L, halo_size)
        for r in range(n):
            received = sum(t.length for t in plan if t.dst == r)  # forward
            returned = sum(t.length for t in plan if t.src == r)  # backward: grads of what r lent
            assert cp_bench.analytic_min_received(r, n, L, halo_size) == received + returned
    assert cp_bench.analytic_min_received(1, 4, 8, None) == 2 * 3 * 8
