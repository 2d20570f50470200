"""`make bench`: torch_impl side by side with the gathers CP code uses today, in one run.

    python -m benchmarks.cp_bench [--quick] [--worlds 2 4 8] [--json out/bench.json] [--plot out/bench.png]

Variants (implemented below, named as in the table):
  torch_impl        this library; `validated` the same with validate=True (its cost)
  list_cat          torch.distributed.nn.functional.all_gather + torch.cat(dim=1) (NeMo Automodel's
                    DeepSeek V4 CP path); on gloo its backward is n scatters and a sum
  funcol            _functional_collectives.all_gather_tensor_autograd(gather_dim=1)
  dtensor           DTensor Shard(1) -> Replicate() redistribute; to_local(grad_placements=[Partial()])
                    so that its backward sums the ranks' gradients (reduce-scatter), as CP needs
  all_to_all        gather_halo's traceable exchange (one functional all_to_all_single), run eagerly
  compiled          gather_halo under torch.compile(fullgraph=True, inductor): that exchange, traced;
                    a dispatch mode cannot watch compiled code, so only its TCP bytes are counted
  full_then_slice   list_cat, then the halo window sliced out
  neighbour_ring    every rank receives its previous rank's whole shard (p2p) and concatenates;
                    valid only for halo_size <= L
  raw               the bare collective without autograd (all_gather_single, + reduce_scatter_single
                    for forward+backward; the halo's p2p exchange, + its reverse) into preallocated
                    buffers: the floor
  raw_alloc         raw, into buffers allocated by each call, as any gather returning a new tensor
                    must: on CPU the first touch of fresh pages is a large part of a gather's cost

Per configuration and variant, interleaving variants within each repetition:
  fb_ms / fwd_ms    forward+backward / forward wall time: per repetition the slowest rank (all
                    ranks start together after a barrier), median over repetitions after warm-up
  peak_mib          the largest, over ranks, rise of the process's resident set during one
                    forward+backward: VmHWM is reset to VmRSS (/proc/self/clear_refs) just before
                    the call; glibc is told to serve and return large blocks by mmap
                    (MALLOC_MMAP_THRESHOLD_), so freed tensors leave the resident set at once.
                    Limits: it counts everything the process touches, gloo's internal buffers
                    included (which is the point), at page granularity; it is CPU memory only
  recv / min        bytes received per rank in one forward+backward, counted at the c10d calls
                    (cp_support.traffic.PayloadCounter), and the analytic minimum
  wire              bytes the rank's TCP sockets received (gloo's algorithm and headers included)
  calls             c10d calls per forward+backward

Then one Gemma 3 decoder layer made CP by torch_impl.hf (examples.train's model; a sliding-window
and a global layer), forward+backward, eager vs compiled (inductor, fullgraph=True), per repetition
the slowest rank, median.

Environment of the ranks: one thread each; PyTorch's CPU allocator asked for transparent huge pages
(THP_MEM_ALLOC_ENABLE=1, PyTorch's own setting for CPU workloads) for every variant alike;
`--default-allocator` turns it off. Without it, first-touching the pages of a fresh output costs
about half as much as the gather itself on this VM (compare `raw` and `raw_alloc`).
"""

import argparse
from contextlib import nullcontext
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist

from benchmarks.cp_layer import layer_bench
from benchmarks.cp_report import HEADER, format_row, plot, print_compile, print_targets
from benchmarks.transports import (
    RawHalo,
    RawSequence,
    dtensor_gather,
    full_then_slice,
    funcol_gather,
    list_cat,
    neighbour_ring,
)
from cp_support import results
from cp_support.launch import RANK_ENV, run_ranks
from cp_support.memory import peak_mib, reset_peak
from cp_support.minima import halo_tokens_moved
from cp_support.traffic import PayloadCounter, wire_bytes
from torch_impl import gather_halo, gather_sequence
from torch_impl.halo import halo_all_to_all

# --- measuring on one rank --------------------------------------------------------------------


def peak_rise_mib(fn):
    """How far the resident set rises above its level at the start of fn()."""
    base = reset_peak()
    fn()
    return peak_mib() - base


def variants_for(kind, x, group, halo_size, validated, backend="inductor"):
    """name -> (forward fn returning an autograd output, or a Raw* floor object)."""
    if kind == "sequence":
        out = {
            "torch_impl": lambda: gather_sequence(x, group),
            "validated": lambda: gather_sequence(x, group, validate=True),
            "list_cat": lambda: list_cat(x, group),
            "funcol": lambda: funcol_gather(x, group),
            "dtensor": lambda: dtensor_gather(x, group),
            "raw": RawSequence(x.detach(), group),
            "raw_alloc": RawSequence(x.detach(), group, fresh=True),
        }
    else:
        out = {
            "torch_impl": lambda: gather_halo(x, group, halo_size),
            "validated": lambda: gather_halo(x, group, halo_size, validate=True),
            "all_to_all": lambda: halo_all_to_all(x, group, halo_size),
            "compiled": torch.compile(
                lambda: gather_halo(x, group, halo_size), backend=backend, fullgraph=True
            ),
            "full_then_slice": lambda: full_then_slice(x, group, halo_size),
            "raw": RawHalo(x.detach(), group, halo_size),
        }
        if halo_size <= x.shape[1]:
            out["neighbour_ring"] = lambda: neighbour_ring(x, group, halo_size)
    if not validated:
        del out["validated"]
    return out


def warm_up_and_check(variants, cotangents, x):
    """One forward+backward of every variant (the warm-up); every autograd variant must compute
    what torch_impl does, output and input gradient, to the bit."""
    outputs = {}
    for name, v in variants.items():
        if name in cotangents:
            y = v()
            y.backward(cotangents[name])
            outputs[name] = (y.detach(), x.grad)
            x.grad = None
        else:
            v.forward_backward()
    want_y, want_grad = outputs.pop("torch_impl")
    for name, (y, grad) in outputs.items():
        if not (torch.equal(y, want_y) and torch.equal(grad, want_grad)):
            raise AssertionError(f"{name} disagrees with torch_impl")


COMPILED = {"compiled"}  # variants whose bytes only the TCP counter sees


def measure(rank, world, group, cfg, reps):
    """One configuration on this rank: per variant its timings, peak memory and traffic."""
    B, L, D, halo_size = cfg["batch"], cfg["L"], cfg["D"], cfg.get("halo_size")
    kind = "sequence" if halo_size is None else "halo"
    torch._dynamo.reset()  # each configuration compiles afresh (no recompilation limit reached)
    x = torch.randn(B, L, D, dtype=torch.float32, requires_grad=True)
    variants = variants_for(kind, x, group, halo_size, cfg.get("validated", False), cfg["backend"])
    cotangents = {name: torch.ones_like(v().detach()) for name, v in variants.items() if callable(v)}
    warm_up_and_check(variants, cotangents, x)

    def run(name, mode):
        v = variants[name]
        if not callable(v):
            v.forward_backward() if mode == "fb" else v.forward()
        elif mode == "fb":
            v().backward(cotangents[name])
        else:
            v()
        x.grad = None

    per = {name: {"fb": [], "fwd": []} for name in variants}
    for _ in range(reps):
        for name in variants:  # interleaved, so that drift hits every variant alike
            for mode in ("fb", "fwd"):
                dist.barrier(group)
                start = time.perf_counter()
                run(name, mode)
                per[name][mode].append(time.perf_counter() - start)
    for name in variants:
        dist.barrier(group)
        wire_before = wire_bytes()
        counted = PayloadCounter()  # torch.compile refuses to run under a dispatch mode
        with counted if name not in COMPILED else nullcontext():
            per[name]["peak_mib"] = peak_rise_mib(lambda name=name: run(name, "fb"))
        if name in COMPILED:
            counted = None
        per[name].update(
            recv=counted and counted.received,
            sent=counted and counted.sent,
            calls=counted and counted.calls,
            wire=wire_bytes()[0] - wire_before[0],
            min=halo_tokens_moved(rank, world, L, halo_size) * B * D * x.element_size(),
        )
    return per


def bench_rank(rank, world, configs, reps):
    """Every configuration on this rank, one after the other."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "(?s).*is deprecated", FutureWarning)  # the baselines, as named
    return [measure(rank, world, dist.group.WORLD, cfg, reps) for cfg in configs]


# --- the sweep --------------------------------------------------------------------------------


def sweep(quick):
    """{world: [configurations]}; each configuration is a gather (halo_size None) or a halo. The
    compiled variant uses inductor; quick mode (the test suite's smoke run) aot_eager, which
    compiles in a fraction of the time."""
    if quick:
        return {
            2: [
                {"batch": 1, "L": 1024, "D": 64, "halo_size": h, "validated": True, "backend": "aot_eager"}
                for h in (None, 256)
            ]
        }

    def configs(batch, L, validated=False):
        halos = [None] + [int(f * L) for f in (1 / 8, 1 / 4, 1, 2.5)]
        return [
            {"batch": batch, "L": L, "D": 512, "halo_size": h, "validated": validated, "backend": "inductor"}
            for h in halos
        ]

    # L = 16384, B = 2 and validation's cost at the target world size only: the sweep stays within
    # minutes on 2 cores
    plan = {world: configs(1, 4096) for world in (2, 4, 8)}
    plan[4] = configs(1, 4096, True) + configs(1, 16384, True) + configs(2, 4096)[:3]
    return plan


def summarize(world, cfg, per_rank):
    """Reduce the ranks' measurements to one row per variant."""
    rows = []
    for name in per_rank[0]:
        fb = [max(r[name]["fb"][i] for r in per_rank) for i in range(len(per_rank[0][name]["fb"]))]
        fwd = [max(r[name]["fwd"][i] for r in per_rank) for i in range(len(per_rank[0][name]["fwd"]))]
        rows.append(
            {
                "world": world,
                **cfg,
                "variant": name,
                "fb_ms": 1000 * statistics.median(fb),
                "fwd_ms": 1000 * statistics.median(fwd),
                "peak_mib": max(r[name]["peak_mib"] for r in per_rank),
                "recv": [r[name]["recv"] for r in per_rank],
                "min": [r[name]["min"] for r in per_rank],
                "wire": [r[name]["wire"] for r in per_rank],
                "calls": per_rank[0][name]["calls"] and max(r[name]["calls"] for r in per_rank),
            }
        )
    base = "list_cat" if cfg.get("halo_size") is None else "full_then_slice"
    ref = next(r for r in rows if r["variant"] == base)
    for r in rows:
        r["time_ratio"] = r["fb_ms"] / ref["fb_ms"]
        r["mem_ratio"] = r["peak_mib"] / ref["peak_mib"] if ref["peak_mib"] > 0 else float("nan")
        r["recv_is_min"] = None if r["variant"] in COMPILED else r["recv"] == r["min"]
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small configuration on 2 ranks")
    parser.add_argument("--worlds", type=int, nargs="*", help="only these world sizes")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 5, quick 2)")
    parser.add_argument(
        "--default-allocator",
        action="store_true",
        help="no transparent huge pages for tensors (slower page faults)",
    )
    parser.add_argument("--json", default="out/bench.json")
    parser.add_argument("--plot", default="out/bench.png")
    args = parser.parse_args(argv)
    reps = args.reps or (2 if args.quick else 5)
    plan = {w: c for w, c in sweep(args.quick).items() if not args.worlds or w in args.worlds}
    env = dict(RANK_ENV)
    if args.default_allocator:
        del env["THP_MEM_ALLOC_ENABLE"]
    print(f"# rank environment: {env}")
    rows, started = [], time.perf_counter()
    print(HEADER)
    for world, configs in plan.items():
        print(
            f"# world {world}: {len(configs)} configurations, {reps} repetitions after a warm-up", flush=True
        )
        per_rank = run_ranks(bench_rank, world, configs, reps, timeout_s=900, env=env)
        for i, cfg in enumerate(configs):
            for row in summarize(world, cfg, [r[i] for r in per_rank]):
                rows.append(row)
                print(format_row(row), flush=True)
    print(f"# {time.perf_counter() - started:.0f}s in all", flush=True)
    print_targets(rows)
    print_compile(rows)
    quick_layer = {"L": 512, "window": 128, "backend": "aot_eager"}
    layer_cfg = quick_layer if args.quick else {"L": 4096, "window": 512, "backend": "inductor"}
    layers = layer_bench(2 if args.quick else 4, layer_cfg, reps)
    for path in (args.json, args.plot):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    results.write(args.json, args, rows + layers)
    plot(rows, args.plot)
    print(f"json: {args.json}\nplot: {args.plot}")
    return rows + layers


if __name__ == "__main__":
    main()
