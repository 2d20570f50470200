"""What parallelize's cross-rank input check costs: a forward with it against one without.

    python -m benchmarks.inputs_check [--seq-len 4096] [--cp 4] [--reps 20]

examples.train's Gemma 3 (its 5:1 layout, window 512) made CP over `--cp` gloo ranks of this
machine, float32, eval mode: per repetition, one forward with `validate=True` (parallelize's
default: one all-gather of 9 int64s at the base model's pre-hook) and one with `validate=False`,
alternating, and the check's collective alone (`validation.compare_ranks`, timed over 100 calls).
Prints the medians, the larger over ranks, and the check's share of a forward.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from cp_support import results
from cp_support.launch import run_ranks
from cp_support.models import build_model
from torch_impl import hf, validation


def _rank(rank, world_size, seq_len, reps):
    torch.set_num_threads(1)
    group = dist.group.WORLD
    models = {}
    for validate in (True, False):
        models[validate] = build_model("gemma3", seq_len, 512, torch.float32).eval()
        hf.parallelize(models[validate], group, validate=validate, verbose=False)
    ids = torch.randint(0, 256, (1, seq_len), generator=torch.Generator().manual_seed(0))
    local = hf.shard_batch({"input_ids": ids}, group)
    times = {True: [], False: []}
    with torch.no_grad():
        for _ in range(reps + 1):  # the first repetition warms up
            for validate in (True, False):
                dist.barrier()
                start = time.perf_counter()
                models[validate](**local)
                times[validate].append(time.perf_counter() - start)
        fields = {str(i): i for i in range(8)}
        dist.barrier()
        start = time.perf_counter()
        for _ in range(100):
            validation.compare_ranks(True, fields, local["input_ids"], group)
        check = (time.perf_counter() - start) / 100
    return statistics.median(times[True][1:]), statistics.median(times[False][1:]), check


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default="out/inputs_check.json")
    args = parser.parse_args(argv)
    per_rank = run_ranks(_rank, args.cp, args.seq_len, args.reps, timeout_s=900)
    on, off, check = (max(r[i] for r in per_rank) for i in range(3))
    print(f"Gemma 3 layout, {args.seq_len} tokens over {args.cp} CP ranks, float32 forward (eval), medians:")
    print(f"  forward with the inputs check    {on * 1e3:8.2f} ms")
    print(f"  forward without (validate=False) {off * 1e3:8.2f} ms  (with / without: {on / off:.3f})")
    print(f"  the check's all-gather alone     {check * 1e3:8.3f} ms  ({check / off:.2%} of a forward)")
    results.write(
        args.json, args, [{"with_check_ms": on * 1e3, "without_ms": off * 1e3, "check_ms": check * 1e3}]
    )


if __name__ == "__main__":
    main()
