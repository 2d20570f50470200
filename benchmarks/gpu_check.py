"""`make gpu-check`: what holds on a GPU node, with the node's own torch, in one command.

    python -m benchmarks.gpu_check [--budget 540] [--skip-tests | --skip-capacity] [--json out/gpu_check.json]

1. The CUDA tests, `pytest -m cuda parity_tests/cuda/test_cuda.py` (torch_impl.attention's flash and
   flex rows and the absorbed DSA attention against the CPU math, the transport on CUDA tensors,
   torch_impl.hf's families on CUDA models, examples.train on NCCL): counts, what failed and the
   slowest cases, each outcome streamed to `<json>_tests.log` as it ends. The tests get the budget
   less what the capacity part took on the first H200 run (CAPACITY_S), each test at most
   TEST_TIMEOUT_S; when their share runs out pytest is stopped as Ctrl-C stops it (its report is
   still written) and the test it was in is named.
2. One CP rank of `make bench-capacity` on CUDA (`benchmarks.rank_capacity`, rank 7 of 8 through
   the fake process group) at Gemma-3-1B's shapes: 26 layers in the 5:1 sliding(512):global
   layout, hidden 1152, 4 heads, 1 KV head of 256, intermediate 6912, the vocabulary cut to 32768
   (as the probe that measured the targets did, so that logits do not dominate), bfloat16,
   activation checkpointing. The rank alone and torch_impl.hf at 65536 tokens per rank, then
   torch_impl.hf at 131072 (S = 1M), and twice and four times that while it fits and the time
   budget allows.

Prints one table with the targets (torch_impl.hf at 65536 within 1.3x the rank alone's memory and
20 s a step; 131072 tokens per rank fitting) and writes JSON. Exit status 1 when a test failed, a
target was missed or the tests ran past their share. Needs CUDA, transformers 5.23 and pytest; on
a node without a package registry, carry transformers as a wheel (docs/benchmarks.md, "On GPUs
with NCCL"). `--quick`: tiny shapes, also on the CPU, where it checks that nothing fails (the
suite runs it, so that this command cannot rot where no GPU is), not the targets.
"""

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import torch

from cp_support import results

GEMMA3_1B = ["--layers=26", "--hidden=1152", "--heads=4", "--head-dim=256", "--intermediate=6912"]
GEMMA3_1B += ["--vocab=32768", "--window=512", "--n=8"]
QUICK = ["--layers=6", "--hidden=64", "--heads=2", "--head-dim=32", "--vocab=256", "--window=64", "--n=8"]
# (the rank alone's peak MiB and step ms, torch_impl.hf's before torch_impl.attention) at L = 65536,
# one H200 (../shared/gpu-probes' capacity_h200.json, quoted by the issue that asked for this command)
BEFORE = {"alone": (37.4e3 / 1.048576, 9.9e3), "torch_impl (before)": (108.7e3 / 1.048576, 26.7e3)}
# a test's own limit (pytest-timeout): flex_attention compiles every new mask, each in seconds
TEST_TIMEOUT_S = 180
# what the capacity part took on the first H200 run (alone and torch_impl at 65536, then 131072)
CAPACITY_S = 210


def run_tests(stem, timeout):
    """The CUDA tests in a fresh process, each outcome streamed to `stem`_tests.log as it ends (the
    first run on a GPU ran past its share and left no report): {"passed", "skipped", "failed":
    [names], "seconds", "slowest": [(name, s)]}, plus "interrupted": the test running when the
    share ran out. pytest is stopped as Ctrl-C stops it, so it still writes its JUnit report."""
    env = os.environ | {"JAX_PLATFORMS": "cpu", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    junit, log = f"{stem}_tests.xml", f"{stem}_tests.log"
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-v", "-rfEs", "parity_tests/cuda/test_cuda.py"]
    command += [f"--junitxml={junit}", f"--timeout={TEST_TIMEOUT_S}", "-p", "no:cacheprovider"]
    began = time.perf_counter()
    result = {"passed": 0, "skipped": 0, "failed": []}
    with open(log, "w") as out:
        pytest = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            pytest.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.send_signal(signal.SIGINT)
            try:
                pytest.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pytest.kill()
                pytest.wait()
            result["interrupted"] = f"ran past {timeout:.0f} s, in " + _running(log)
    result["seconds"] = round(time.perf_counter() - began, 1)
    with open(log) as f:
        print(f.read()[-6000:], flush=True)
    if not os.path.exists(junit):
        return result | {"failed": [f"(pytest exited {pytest.returncode}, no report: {log})"]}
    times = []
    for case in ET.parse(junit).iter("testcase"):
        outcome = {child.tag for child in case}
        if outcome & {"failure", "error"}:
            result["failed"].append(case.get("name"))
        elif "skipped" in outcome:
            result["skipped"] += 1
        else:
            result["passed"] += 1
        times.append((case.get("name"), round(float(case.get("time", 0)), 1)))
    return result | {"slowest": sorted(times, key=lambda nt: -nt[1])[:10]}


def _running(log):
    """The test pytest -v had begun when it was stopped: its log's last line without an outcome."""
    with open(log) as f:
        lines = [line for line in f.read().splitlines() if "::" in line]
    last = lines[-1] if lines else ""
    return last.split()[0] if last and not last.rstrip().endswith("]") else "(no test running)"


def run_capacity(args, deadline):
    """rank_capacity rows: alone and torch_impl at args.len, torch_impl at 2x, then at 4x and 8x
    while it fits and the next (about 4x the last step's time, twice) ends before `deadline`."""
    from benchmarks import rank_capacity

    shapes = QUICK if args.quick else GEMMA3_1B
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    options = rank_capacity.parse([*shapes, f"--dtype={args.dtype}"])
    rows = []

    def one(variant, L, reps):
        options.reps = reps
        began = time.monotonic()
        row = {"variant": variant, "L": L, "S": options.n * L}
        try:
            row |= rank_capacity.measure(variant, options, L, device)
        except torch.OutOfMemoryError:
            row["error"] = "out of memory"
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        row["seconds"] = round(time.monotonic() - began, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
        return row

    one("alone", args.len, args.reps)
    row = one("torch_impl", args.len, args.reps)
    L = 2 * args.len  # the target: always tried
    while "error" not in row and L <= 8 * args.len:
        row = one("torch_impl", L, 1)
        L *= 2
        if "error" not in row and time.monotonic() + 8 * row["ms"] / 1000 > deadline:
            break
    return rows, device.type, vars(options)


def verdicts(rows, L):
    """The targets, each (text, met)."""
    at = {r["variant"]: r for r in rows if r["L"] == L and "peak_mib" in r}
    fits = [r["L"] for r in rows if r["variant"] == "torch_impl" and "peak_mib" in r]
    out = []
    if {"alone", "torch_impl"} <= set(at):
        memory = at["torch_impl"]["peak_mib"] / at["alone"]["peak_mib"]
        out.append((f"memory at L={L}: {memory:.2f}x the rank alone (target <= 1.3x)", memory <= 1.3))
        seconds = at["torch_impl"]["ms"] / 1000
        out.append((f"time at L={L}: {seconds:.1f} s a step (target <= 20 s)", seconds <= 20))
    largest = max(fits, default=None)
    out.append((f"largest L that fits: {largest} (target: {2 * L}, S = {16 * L})", (largest or 0) >= 2 * L))
    return out


def table(rows, L):
    lines = [
        "| variant | tokens per rank L (S) | peak MiB | x alone | step ms | x alone |",
        "|---|---|---|---|---|---|",
    ]
    alone = next((r for r in rows if r["variant"] == "alone" and r["L"] == L and "peak_mib" in r), None)
    for r in rows:
        if "peak_mib" not in r:
            lines.append(f"| {r['variant']} | {r['L']} ({r['S']}) | {r['error']} | | | |")
            continue
        ratio = (r["peak_mib"] / alone["peak_mib"], r["ms"] / alone["ms"]) if alone and r["L"] == L else None
        m, t = (f"{ratio[0]:.2f}", f"{ratio[1]:.2f}") if ratio else ("", "")
        lines.append(
            f"| {r['variant']} | {r['L']} ({r['S']}) | {r['peak_mib']:.0f} | {m} | {r['ms']:.0f} | {t} |"
        )
    return "\n".join(lines)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=540, help="seconds for the whole check (about)")
    p.add_argument("--quick", action="store_true", help="tiny shapes (any device), one repetition")
    p.add_argument("--skip-tests", action="store_true", help="only the capacity part")
    p.add_argument("--skip-capacity", action="store_true", help="only the CUDA tests")
    p.add_argument("--json", default="out/gpu_check.json")
    args = p.parse_args(argv)
    args.len, args.reps = (128, 1) if args.quick else (65536, 2)
    args.dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    return args


def main(argv=None):
    args = parse(argv)
    started = time.monotonic()
    if not torch.cuda.is_available() and not args.quick:
        print("gpu_check: no CUDA device here; this command checks a GPU node (`--quick` runs it anywhere)")
        return 2
    import transformers

    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"# gpu_check: {device_name}, torch {torch.__version__}, transformers {transformers.__version__}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    share = args.budget if args.skip_capacity else max(args.budget - CAPACITY_S, 0.5 * args.budget)
    stem = os.path.splitext(args.json)[0]
    tests = {"skipped by --skip-tests": True} if args.skip_tests else run_tests(stem, share)
    print(f"# CUDA tests: {json.dumps(tests)}", flush=True)
    rows, checks, options = [], [], None
    if not args.skip_capacity:
        rows, device, options = run_capacity(args, started + args.budget)
        checks = [] if args.quick else verdicts(rows, args.len)  # tiny shapes have no targets
        print(f"\n# one CP rank (7 of 8) on {device}: {'tiny shapes' if args.quick else 'Gemma-3-1B shapes'}")
        print(table(rows, args.len))
    if checks:
        print(
            "before torch_impl.attention, one H200 (gpu-probes): "
            + "; ".join(f"{k} {m:.0f} MiB, {t:.0f} ms" for k, (m, t) in BEFORE.items())
        )
    for text, met in checks:
        print(f"{'MET   ' if met else 'MISSED'} {text}")
    failed = tests.get("failed", [])
    stopped = f", stopped: {tests['interrupted']}" if "interrupted" in tests else ""
    print(f"tests: {tests.get('passed', 0)} passed, {len(failed)} failed {failed or ''}{stopped}")
    meta = {"device": device_name, "torch": torch.__version__, "transformers": transformers.__version__}
    result = {
        "stamp": results.stamp(),
        "meta": meta,
        "options": options,
        "tests": tests,
        "rows": rows,
        "targets": checks,
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"# {args.json}, {time.monotonic() - started:.0f} s")
    missed = not all(met for _, met in checks)
    return 1 if failed or missed or "interrupted" in tests else 0


if __name__ == "__main__":
    sys.exit(main())
