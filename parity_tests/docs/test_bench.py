"""`make bench`, `make bench-capacity` and `make gpu-check` keep working: their quick modes end to end (no
timing assertions), and their arithmetic."""

import json
import subprocess
import sys

import pytest

from cp_support.minima import halo_tokens_moved
import torch_impl


def bench(module, *args, timeout=280):
    """`python -m benchmarks.<module> *args`, as make runs it: its output, which must end well."""
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_quick_mode_runs_and_counts_the_minimum_bytes(tmp_path):
    json_path, plot_path = tmp_path / "bench.json", tmp_path / "bench.png"
    out = bench("cp_bench", "--quick", "--json", json_path, "--plot", plot_path)
    every = json.loads(json_path.read_text())["rows"]
    assert "# targets" in out and "# torch.compile: gather_halo" in out and "a Gemma 3 decoder layer" in out
    assert plot_path.stat().st_size > 10_000
    rows, layers = [r for r in every if "variant" in r], [r for r in every if "layer" in r]
    assert {r["layer"] for r in layers} == {"sliding_attention", "full_attention"}
    assert all(r["eager_ms"] > 0 and r["compiled_ms"] > 0 for r in layers)
    variants = {(r["halo_size"], r["variant"]) for r in rows}
    assert {
        (None, v) for v in ("torch_impl", "list_cat", "funcol", "dtensor", "raw", "raw_alloc")
    } <= variants
    halo_variants = ("torch_impl", "all_to_all", "compiled", "full_then_slice", "neighbour_ring", "raw")
    assert {(256, v) for v in halo_variants} <= variants
    for r in rows:
        assert r["fb_ms"] > 0 and r["peak_mib"] >= 0
        if r["variant"] == "compiled":  # seen by the TCP counter only
            assert r["calls"] is None and r["recv_is_min"] is None and min(r["wire"]) > 0
            continue
        assert r["calls"] > 0
        if r["variant"] in ("torch_impl", "all_to_all", "raw", "list_cat"):
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
            assert halo_tokens_moved(r, n, L, halo_size) == received + returned
    assert halo_tokens_moved(1, 4, 8, None) == 2 * 3 * 8


@pytest.mark.slow
def test_train_bench_quick_mode_runs(tmp_path):
    """`make bench-train` end to end on one small configuration: both transports train, the
    library receives fewer bytes per step than the all-gather baseline (no timing assertions)."""
    json_path, plot_path = tmp_path / "bench_train.json", tmp_path / "bench_train.png"
    out = bench("train_bench", "--quick", "--steps", 2, "--json", json_path, "--plot", plot_path)
    assert "ratios: torch_impl / all-gather baseline" in out
    (row,) = json.loads(json_path.read_text())["rows"]
    assert plot_path.stat().st_size > 10_000
    assert row["torch_impl_bytes_per_step"] < row["allgather_bytes_per_step"]
    assert all(row[f"{t}_{k}"] > 0 for t in ("torch_impl", "allgather") for k in ("step_ms", "peak_mib"))


def test_rank_capacity_quick_mode_runs(tmp_path):
    """make bench-capacity's quick mode: one CP rank of 8 through the fake process group, each
    variant in its own process, at 256 tokens per rank (no timing or memory assertions). The
    dense and allgather paths run in the hf and train tests."""
    json_path, plot_path = tmp_path / "capacity.json", tmp_path / "capacity.png"
    variants = ["--variants", "torch_impl"]  # alone: in make gpu-check's quick mode below
    out = bench("rank_capacity", "--quick", *variants, "--json", json_path, "--plot", plot_path)
    rows = json.loads(json_path.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["torch_impl"]
    assert all(r["L"] == 256 and r["S"] == 8 * 256 and r["ms"] > 0 and r["peak_mib"] > 0 for r in rows)
    assert plot_path.stat().st_size > 10_000
    assert "| 256 (2048) | torch_impl |" in out


def test_packed_rows_quick_mode_counts_the_documents_minimum(tmp_path):
    """make bench-packed's quick mode, one rank (3 of 4) of packed rows under head_tail: the bytes
    its layers receive per kind equal the documents' minimum (no timing or memory assertions)."""
    json_path = tmp_path / "packed.json"
    options = ["--quick", "--mixes", "short", "--layouts", "head_tail", "--variants", "torch_impl"]
    out = bench("packed_rows", *options, "--json", json_path)
    (row,) = json.loads(json_path.read_text())["rows"]
    assert (row["layout"], row["rank"]) == ("head_tail", 3) and row["ms"] > 0
    assert row["bytes"] == row["minimum"] and all(row["minimum"].values()), row
    assert "| short | head_tail | 3 |" in out


@pytest.mark.slow  # (about 50 s: eight processes; make test-all)
def test_layout_balance_runs_both_models_and_layouts(tmp_path):
    """`make bench-other`'s per-rank work under both layouts, at tiny sizes: every (model, layout,
    rank) runs in its own process and the report renders its JSON (no timing assertions)."""
    json_path, plot_path = tmp_path / "layout_balance.json", tmp_path / "balance.png"
    options = ["--n", 2, "--len", 64, "--reps", 2, "--json", json_path, "--plot", plot_path]
    bench("layout_balance", *options)
    data = json.loads(json_path.read_text())
    rows = {(r["model"], r["layout"], r["rank"]) for r in data["rows"]}
    layouts = ("contiguous", "head_tail")
    assert rows == {(m, lay, r) for m in ("llama", "gemma3") for lay in layouts for r in (0, 1)}
    assert all(r["ms"] > 0 for r in data["rows"]) and data["stamp"]["machine"]["cores"]
    assert "| head_tail |" in bench("report", "--show", "layout_balance", "--results", tmp_path)


def test_gpu_check_quick_mode_runs(tmp_path):
    """make gpu-check's command at tiny shapes, here on the CPU: the CUDA tests skip (none fails),
    one rank of bench-capacity runs at 128 tokens per rank and doubles to 1024, the JSON holds it
    all (no timing or memory assertions). Without --quick and without CUDA it refuses."""
    json_path = tmp_path / "gpu_check.json"
    command = [sys.executable, "-m", "benchmarks.gpu_check", "--quick", "--json", str(json_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(json_path.read_text())
    assert result["tests"]["failed"] == [] and result["tests"]["skipped"] > 0
    assert [(r["variant"], r["L"]) for r in result["rows"]] == [
        ("alone", 128),
        ("torch_impl", 128),
        ("torch_impl", 256),
        ("torch_impl", 512),
        ("torch_impl", 1024),
    ]
    assert all(r["peak_mib"] > 0 and r["ms"] > 0 for r in result["rows"])
    assert "| torch_impl | 128 (1024) |" in done.stdout
    refused = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check"], capture_output=True, text=True)
    assert refused.returncode == 2 and "no CUDA device here" in refused.stdout


def test_gpu_check_reports_tests_that_ran_past_their_share(tmp_path):
    """The tests' share runs out (here at once, while pytest still collects): pytest is stopped,
    the check names where, exits 1, and its log holds what pytest printed."""
    json_path = tmp_path / "gpu_check.json"
    command = [sys.executable, "-m", "benchmarks.gpu_check", "--quick", "--skip-capacity", "--budget", "0.5"]
    done = subprocess.run([*command, "--json", str(json_path)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    tests = json.loads(json_path.read_text())["tests"]
    assert tests["interrupted"].startswith("ran past 0 s, in ") and tests["passed"] == 0, tests
    assert "stopped: ran past" in done.stdout
    assert (tmp_path / "gpu_check_tests.log").exists()


def test_media_cost_quick_mode_counts_each_ranks_share(tmp_path):
    """The vision tower benchmark's quick mode (4 images): the last rank's share for n = 2, 4, 8
    and the feature rows it receives are the share's complement (no timing assertions)."""
    json_path = tmp_path / "media.json"
    bench("media_cost", "--quick", "--json", json_path)
    rows = json.loads(json_path.read_text())["rows"]
    assert [(r["n"], r["images"]) for r in rows] == [(2, 2), (4, 1), (8, 1)]
    for r in rows:  # 56 x 56 pixels: 4 x 4 patches, 2 x 2 merged, 4 rows an image
        assert r["feature_rows"] == 16 and r["received_rows"] == 16 - 4 * r["images"]
        assert r["time_ratio"] > 0


def test_media_memory_quick_mode_measures_each_rank(tmp_path):
    """The peak-memory benchmark with images across ranks, quick (512 tokens a rank, one step), on
    Gemma 3: the rank alone and both CP ranks measured (no memory or timing assertions)."""
    json_path = tmp_path / "media_memory.json"
    bench("media_memory", "--quick", "--model", "gemma3", "--json", json_path)
    rows = json.loads(json_path.read_text())["rows"]
    assert [(r["model"], r["variant"], r["rank"]) for r in rows] == [
        ("gemma3", "alone", 0),
        ("gemma3", "torch_impl", 0),
        ("gemma3", "torch_impl", 1),
    ]
    assert all(r["peak_mib"] > 0 and r["ms"] > 0 for r in rows), rows


@pytest.mark.slow  # (about a minute: two models, nine processes; make test-all)
def test_media_memory_quick_mode_measures_gemma4_and_a_video(tmp_path):
    """The same, quick, on Gemma 4's images (bidirectional on its sliding layers) and Qwen3-VL's
    video, Qwen3-VL also on its rows without the video (`--text`'s default): each model's rank
    alone and both CP ranks, and the report renders a table per model."""
    json_path = tmp_path / "media_memory.json"
    bench("media_memory", "--quick", "--model", "gemma4", "qwen3_vl", "--json", json_path)
    rows = json.loads(json_path.read_text())["rows"]
    three = (("alone", 0), ("torch_impl", 0), ("torch_impl", 1))
    assert [(r["model"], r["variant"], r["rank"]) for r in rows] == [
        *(("gemma4", variant, rank) for variant, rank in three),
        *(("qwen3_vl", variant, rank) for variant, rank in three),
        *(("qwen3_vl", f"{variant}, text", rank) for variant, rank in three),
    ]
    assert all(r["peak_mib"] > 0 and r["ms"] > 0 for r in rows), rows
    report = bench("report", "--show", "media_memory", "--results", tmp_path)
    assert "Gemma 4 with images of 64 tokens" in report and "Qwen3-VL with a video" in report
