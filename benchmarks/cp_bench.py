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
import json
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.nn.functional as dist_nn

from cp_support.launch import RANK_ENV, run_ranks
from cp_support.memory import peak_mib, reset_peak
from cp_support.traffic import PayloadCounter, wire_bytes
from torch_impl import gather_halo, gather_sequence, halo_plan
from torch_impl.halo import halo_all_to_all, start_exchange
from torch_impl.layout import ShardPlan

# --- the baselines ----------------------------------------------------------------------------


def list_cat(x, group):
    return torch.cat(dist_nn.all_gather(x, group=group), dim=1)  # n parts, then one more copy


def funcol_gather(x, group):
    return funcol.wait_tensor(funcol.all_gather_tensor_autograd(x, gather_dim=1, group=group))


def dtensor_gather(x, group):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = DeviceMesh.from_group(group, x.device.type)
    full = DTensor.from_local(x, mesh, [Shard(1)]).redistribute(mesh, [Replicate()])
    return full.to_local(grad_placements=[Partial()])


def full_then_slice(x, group, halo_size):
    n, r, L = dist.get_world_size(group), dist.get_rank(group), x.shape[1]
    (window,) = ShardPlan.of("contiguous", n, r, L).windows(halo_size)
    return list_cat(x, group)[:, window.keys]  # [B, h + L, D]


class _NeighbourRing(torch.autograd.Function):
    """Rank r receives rank r-1's whole shard and concatenates it in front of its own."""

    @staticmethod
    def forward(ctx, x, group):
        r, n = dist.get_rank(group), dist.get_world_size(group)
        ctx.group = group
        prev = torch.empty_like(x) if r > 0 else None
        sends = [(r + 1, x.contiguous())] if r < n - 1 else []
        for work in start_exchange(sends, [(r - 1, prev)] if r > 0 else [], group):
            work.wait()
        return torch.cat([prev, x], dim=1) if r > 0 else x.clone()

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        r, n = dist.get_rank(group), dist.get_world_size(group)
        L = grad.shape[1] // (2 if r > 0 else 1)
        from_next = torch.empty_like(grad[:, -L:]) if r < n - 1 else None
        sends = [(r - 1, grad[:, :L].contiguous())] if r > 0 else []
        for work in start_exchange(sends, [(r + 1, from_next)] if r < n - 1 else [], group):
            work.wait()
        grad_x = grad[:, -L:]
        return (grad_x + from_next if from_next is not None else grad_x), None


def neighbour_ring(x, group, halo_size):
    h = min(dist.get_rank(group) * x.shape[1], halo_size)
    y = _NeighbourRing.apply(x, group)
    return y[:, y.shape[1] - x.shape[1] - h :]


# --- the floors: bare transport, no autograd --------------------------------------------------


class RawSequence:
    """all_gather_single (+ reduce_scatter_single) on a staged input; into preallocated buffers, or,
    with fresh=True, into new ones each call (what any gather that returns a new tensor pays)."""

    def __init__(self, x, group, fresh=False):
        self.n, self.group, self.fresh = dist.get_world_size(group), group, fresh
        self.x = x.transpose(0, 1).contiguous()  # [L, B, D], staged once
        self.out = self.x.new_empty((self.n * self.x.shape[0], *self.x.shape[1:]))  # [n*L, B, D]
        self.grad = torch.empty_like(self.x)  # [L, B, D]

    def forward(self):
        out = torch.empty_like(self.out) if self.fresh else self.out
        dist.all_gather_single(out, self.x, group=self.group)
        return out

    def forward_backward(self):
        out = self.forward()
        grad = torch.empty_like(self.grad) if self.fresh else self.grad
        dist.reduce_scatter_single(grad, out, group=self.group)


class RawHalo:
    def __init__(self, x, group, halo_size):
        r, L = dist.get_rank(group), x.shape[1]
        self.group, self.r = group, r
        self.plan = halo_plan(dist.get_world_size(group), L, halo_size)
        self.x = x.transpose(0, 1).contiguous()  # [L, B, D]
        self.halo = self.x.new_empty((min(r * L, halo_size), *self.x.shape[1:]))  # [h, B, D]
        self.back = {t: self.x.new_empty((t.length, *self.x.shape[1:])) for t in self.plan if t.src == r}

    def _run(self, pairs):
        for work in start_exchange(*pairs, self.group):
            work.wait()

    def forward(self):
        r, L = self.r, self.x.shape[0]
        sends = [(t.dst, self.x[L - t.length :]) for t in self.plan if t.src == r]
        recvs = [(t.src, self.halo[t.dst_start : t.dst_start + t.length]) for t in self.plan if t.dst == r]
        self._run((sends, recvs))

    def forward_backward(self):
        self.forward()
        sends = [
            (t.src, self.halo[t.dst_start : t.dst_start + t.length]) for t in self.plan if t.dst == self.r
        ]
        self._run((sends, [(t.dst, buf) for t, buf in self.back.items()]))


# --- measuring on one rank --------------------------------------------------------------------


def peak_rise_mib(fn):
    """How far the resident set rises above its level at the start of fn()."""
    base = reset_peak()
    fn()
    return peak_mib() - base


def analytic_min_received(r, n, L, halo_size):
    """Tokens rank r must receive in forward+backward: its halo, then the gradients of the tokens
    later ranks' halos took from it (None for a full gather: 2 * (n-1) * L)."""
    if halo_size is None:
        return 2 * (n - 1) * L
    got = min(r * L, halo_size)
    lent = sum(
        max(0, min((r + 1) * L, d * L) - max(r * L, d * L - min(d * L, halo_size))) for d in range(r + 1, n)
    )
    return got + lent


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
            min=analytic_min_received(rank, world, L, halo_size) * B * D * x.element_size(),
        )
    return per


def bench_rank(rank, world, configs, reps):
    """Every configuration on this rank, one after the other."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "(?s).*is deprecated", FutureWarning)  # the baselines, as named
    return [measure(rank, world, dist.group.WORLD, cfg, reps) for cfg in configs]


# --- torch.compile of a Gemma 3 decoder layer under CP -------------------------------------------


def layer_inputs(model, local):
    """Each decoder layer's (args, kwargs) in one forward of the model."""
    captured, handles = {}, []
    for index, layer in enumerate(model.model.layers):
        hook = lambda module, args, kwargs, index=index: captured.setdefault(index, (args, kwargs))  # noqa: E731
        handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(**local)
    for handle in handles:
        handle.remove()
    return captured


def layer_rank(rank, world, cfg, reps):
    """examples.train's Gemma 3 made CP by torch_impl.hf; for a sliding-window and a global decoder
    layer, one forward+backward eager and compiled (inductor, fullgraph=True): per rep, the
    slowest rank's time."""
    from cp_support.models import VOCAB, build_model
    from torch_impl import hf

    torch.set_num_threads(1)
    group, S = dist.group.WORLD, world * cfg["L"]
    model = build_model("gemma3", S, cfg["window"], torch.float32)
    hf.parallelize(model, group)
    ids = torch.randint(0, VOCAB, (1, S), generator=torch.Generator().manual_seed(0))
    inputs = layer_inputs(model, hf.shard_batch({"input_ids": ids}, group))
    kinds = model.config.layer_types
    times = {}
    for kind in ("sliding_attention", "full_attention"):
        index = kinds.index(kind)
        layer, (args, kwargs) = model.model.layers[index], inputs[index]
        variants = {"eager": layer, "compiled": torch.compile(layer, backend=cfg["backend"], fullgraph=True)}

        def run(fn, args=args, kwargs=kwargs):
            x = args[0].detach().requires_grad_(True)
            y = fn(x, *args[1:], **kwargs)
            y.backward(torch.ones_like(y))

        for fn in variants.values():
            run(fn)  # warm-up (compiles)
        times |= {(kind, name): [] for name in variants}
        for _ in range(reps):
            for name, fn in variants.items():
                dist.barrier(group)
                start = time.perf_counter()
                run(fn)
                times[(kind, name)].append(time.perf_counter() - start)
    return times


def layer_bench(world, cfg, reps):
    per_rank = run_ranks(layer_rank, world, cfg, reps, timeout_s=900, env={"OMP_NUM_THREADS": "1"})
    rows = []
    for kind in ("sliding_attention", "full_attention"):
        ms = {
            name: 1000 * statistics.median(max(r[(kind, name)][i] for r in per_rank) for i in range(reps))
            for name in ("eager", "compiled")
        }
        rows.append({"world": world, **cfg, "layer": kind, **{f"{k}_ms": v for k, v in ms.items()}})
        rows[-1]["compiled_ratio"] = ms["compiled"] / ms["eager"]
    shape = f"n={world}, L={cfg['L']}, window {cfg['window']}"
    print(f"# torch.compile ({cfg['backend']}): a Gemma 3 decoder layer made CP ({shape})")
    for r in rows:
        print(
            f"#   {r['layer']:<18} eager {r['eager_ms']:8.1f} ms  compiled {r['compiled_ms']:8.1f} ms"
            f"  ratio {r['compiled_ratio']:.2f}"
        )
    return rows


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


HEADER = (
    f"{'world':>5} {'B':>2} {'L':>6} {'halo':>6} {'variant':<16}{'fb ms':>9}{'fwd ms':>9}{'peak MiB':>10}"
    f"{'t/base':>8}{'m/base':>8}{'recv MiB max':>13}{'=min':>6}{'wire MiB':>10}{'calls':>6}"
)


def format_row(r):
    halo = "-" if r.get("halo_size") is None else str(r["halo_size"])
    counted = r["recv_is_min"] is not None  # a compiled variant's calls are not counted, its TCP bytes are
    recv = f"{max(r['recv']) / 2**20:.2f}" if counted else "-"
    equal = ("yes" if r["recv_is_min"] else "no") if counted else "-"
    return (
        f"{r['world']:>5} {r['batch']:>2} {r['L']:>6} {halo:>6} {r['variant']:<16}{r['fb_ms']:>9.1f}"
        f"{r['fwd_ms']:>9.1f}{r['peak_mib']:>10.1f}{r['time_ratio']:>8.2f}{r['mem_ratio']:>8.2f}"
        f"{recv:>13}{equal:>6}{max(r['wire']) / 2**20:>10.2f}{r['calls'] or '-':>6}"
    )


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, metric, label in ((axes[0], "time_ratio", "time"), (axes[1], "mem_ratio", "peak memory")):
        for world in sorted({r["world"] for r in rows}):
            for L in sorted({r["L"] for r in rows if r["world"] == world}):
                pts = sorted(
                    (r["halo_size"] / r["L"], r[metric])
                    for r in rows
                    if r["variant"] == "torch_impl"
                    and r.get("halo_size") is not None
                    and r["world"] == world
                    and r["L"] == L
                    and r["batch"] == 1
                )
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=f"n={world}, L={L}")
        ax.axhline(1, color="gray", lw=0.8)
        ax.set_xlabel("halo_size / L")
        ax.set_ylabel(f"{label} / full_then_slice")
        ax.set_title(f"gather_halo {label}, forward+backward")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    ax = axes[2]
    seq = [r for r in rows if r["halo_size"] is None and r["batch"] == 1]
    small = min(r["L"] for r in seq)
    for i, variant in enumerate(("torch_impl", "funcol", "dtensor", "raw")):
        color = f"C{i}"
        for metric, style in (("time_ratio", "-o"), ("mem_ratio", "--s")):
            pts = sorted((r["world"], r[metric]) for r in seq if r["variant"] == variant and r["L"] == small)
            if pts:
                ax.plot(
                    *zip(*pts, strict=True), style, color=color, label=f"{variant} {metric.split('_')[0]}"
                )
            big = [(r["world"], r[metric]) for r in seq if r["variant"] == variant and r["L"] > small]
            if big:
                ax.plot(*zip(*big, strict=True), "*", color=color, markersize=12)
    ax.axhline(1, color="gray", lw=0.8)
    ax.set_xlabel(f"world size (lines: L={small}; stars: larger L)")
    ax.set_ylabel("ratio to list_cat")
    ax.set_title("gather_sequence, forward+backward")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_targets(rows):
    """The targets at n=4, B=1, L=16384, D=512, float32, forward+backward, where that was measured."""

    def row(variant, halo_size):
        for r in rows:
            if (r["world"], r["batch"], r["L"], r["halo_size"], r["variant"]) == (
                4,
                1,
                16384,
                halo_size,
                variant,
            ):
                return r
        return None

    seq, seq_raw, seq_alloc, halo = (
        row("torch_impl", None),
        row("raw", None),
        row("raw_alloc", None),
        row("torch_impl", 4096),
    )
    halo_rows = [r for r in rows if r["variant"] == "torch_impl" and r["halo_size"] is not None]
    checks = [
        (
            "bytes received == analytic minimum, every rank, every halo_size",
            all(r["recv_is_min"] for r in halo_rows),
            "",
        ),
    ]
    if seq and halo:
        checks += [
            ("gather_sequence time <= 0.8x list_cat", seq["time_ratio"] <= 0.8, f"{seq['time_ratio']:.2f}x"),
            (
                "gather_sequence peak memory <= 0.8x list_cat",
                seq["mem_ratio"] <= 0.8,
                f"{seq['mem_ratio']:.2f}x",
            ),
            (
                "gather_sequence forward <= 1.1x raw all_gather_single",
                seq["fwd_ms"] <= 1.1 * seq_raw["fwd_ms"],
                f"{seq['fwd_ms'] / seq_raw['fwd_ms']:.2f}x raw; "
                f"{seq['fwd_ms'] / seq_alloc['fwd_ms']:.2f}x raw_alloc",
            ),
            (
                "gather_halo(L/4) time <= 0.2x full_then_slice",
                halo["time_ratio"] <= 0.2,
                f"{halo['time_ratio']:.2f}x",
            ),
            (
                "gather_halo(L/4) peak memory <= 0.25x full_then_slice",
                halo["mem_ratio"] <= 0.25,
                f"{halo['mem_ratio']:.2f}x",
            ),
        ]
    print("# targets (n=4, B=1, L=16384, D=512, float32, forward+backward)")
    for name, met, figure in checks:
        print(f"#   {'met   ' if met else 'MISSED'} {name}  {figure}")


def print_compile(rows):
    """gather_halo's all_to_all exchange run eagerly and under torch.compile(fullgraph=True,
    inductor), as ratios to the eager p2p exchange of the same configuration in the same run."""
    print("# torch.compile: gather_halo forward+backward, ratios to eager gather_halo (p2p)")
    print(f"# {'world':>5} {'L':>6} {'halo':>6}{'all_to_all time':>17}{'compiled time':>15}{'TCP bytes':>11}")
    for r in rows:
        if r["variant"] != "compiled":
            continue
        same = {k: r[k] for k in ("world", "batch", "L", "halo_size")}
        eager, a2a = (
            next(x for x in rows if x["variant"] == v and all(x[k] == same[k] for k in same))
            for v in ("torch_impl", "all_to_all")
        )
        print(
            f"# {r['world']:>5} {r['L']:>6} {r['halo_size']:>6}{a2a['fb_ms'] / eager['fb_ms']:>17.2f}"
            f"{r['fb_ms'] / eager['fb_ms']:>15.2f}{max(r['wire']) / max(max(eager['wire']), 1):>11.2f}"
        )


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
    with open(args.json, "w") as f:
        json.dump(rows + layers, f, indent=1)
    plot(rows, args.plot)
    print(f"json: {args.json}\nplot: {args.plot}")
    return rows + layers


if __name__ == "__main__":
    main()
