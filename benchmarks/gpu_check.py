"""`make gpu-check`: what holds on a GPU node, with the node's own torch, in one command.

    python -m benchmarks.gpu_check [--budget 450] [--json out/gpu_check.json]

1. The CUDA tests, `pytest -m cuda parity_tests/test_cuda.py` (torch_impl.attention's flash and
   flex rows and the absorbed DSA attention against the CPU math, the transport on CUDA tensors,
   torch_impl.hf's families on CUDA models, examples.train on NCCL): counts and what failed.
2. One CP rank of `make bench-capacity` on CUDA (`benchmarks.rank_capacity`, rank 7 of 8 through
   the fake process group) at Gemma-3-1B's shapes: 26 layers in the 5:1 sliding(512):global
   layout, hidden 1152, 4 heads, 1 KV head of 256, intermediate 6912, the vocabulary cut to 32768
   (as the probe that measured the targets did, so that logits do not dominate), bfloat16,
   activation checkpointing. The rank alone and torch_impl.hf at 65536 tokens per rank, then
   torch_impl.hf at 131072 (S = 1M), and twice and four times that while it fits and the time
   budget allows.

Prints one table with the targets (torch_impl.hf at 65536 within 1.3x the rank alone's memory and
20 s a step; 131072 tokens per rank fitting) and writes JSON. Exit status 1 when a test failed or
a target was missed. Needs CUDA, transformers 5.23 and pytest; on a node without a package
registry, carry transformers as a wheel (docs/benchmarks.md, "On GPUs with NCCL"). `--quick`: tiny
shapes, also on the CPU, where it checks that nothing fails (the suite runs it, so that this
command cannot rot where no GPU is), not the targets.
"""

import argparse
import gc
import json
import os
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


def run_tests(junit, timeout):
    """The CUDA tests in a fresh process: {"passed", "skipped", "failed": [names], "seconds"}."""
    env = os.environ | {"JAX_PLATFORMS": "cpu", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rfEs", "parity_tests/test_cuda.py"]
    began = time.perf_counter()
    try:
        done = subprocess.run(
            command + [f"--junitxml={junit}"], capture_output=True, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired:
        return {"error": f"the CUDA tests ran past {timeout} s", "failed": ["(timed out)"]}
    print(done.stdout[-6000:], done.stderr[-2000:], sep="\n", flush=True)
    result = {"passed": 0, "skipped": 0, "failed": [], "seconds": round(time.perf_counter() - began, 1)}
    if not os.path.exists(junit):
        return result | {"failed": [f"(pytest exited {done.returncode}, no report)"]}
    for case in ET.parse(junit).iter("testcase"):
        outcome = {child.tag for child in case}
        if outcome & {"failure", "error"}:
            result["failed"].append(case.get("name"))
        elif "skipped" in outcome:
            result["skipped"] += 1
        else:
            result["passed"] += 1
    return result


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
    p.add_argument("--budget", type=float, default=450, help="seconds for the whole check (about)")
    p.add_argument("--quick", action="store_true", help="tiny shapes (any device), one repetition")
    p.add_argument("--skip-tests", action="store_true", help="only the capacity part")
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
    junit = os.path.splitext(args.json)[0] + "_tests.xml"
    tests = {"skipped by --skip-tests": True} if args.skip_tests else run_tests(junit, 0.6 * args.budget)
    print(f"# CUDA tests: {json.dumps(tests)}", flush=True)
    rows, device, options = run_capacity(args, started + args.budget)
    checks = verdicts(rows, args.len)
    print(f"\n# one CP rank (7 of 8) on {device}: {'tiny shapes' if args.quick else 'Gemma-3-1B shapes'}")
    print(table(rows, args.len))
    if not args.quick:
        print(
            "before torch_impl.attention, one H200 (gpu-probes): "
            + "; ".join(f"{k} {m:.0f} MiB, {t:.0f} ms" for k, (m, t) in BEFORE.items())
        )
    for text, met in checks if not args.quick else ():  # tiny shapes have no targets
        print(f"{'MET   ' if met else 'MISSED'} {text}")
    failed = tests.get("failed", [])
    print(f"tests: {tests.get('passed', 0)} passed, {len(failed)} failed {failed or ''}")
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
    missed = not args.quick and not all(met for _, met in checks)  # tiny shapes have no targets
    return 1 if failed or missed else 0


if __name__ == "__main__":
    sys.exit(main())
