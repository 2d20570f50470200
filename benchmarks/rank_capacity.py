"""`make bench-capacity`: one CP rank's peak memory and time, against the same rank without CP.

    python -m benchmarks.rank_capacity [--model gemma3|deepseek_v32|qwen3_5|mamba2|minimax] [--n 8]
                                       [--lens 1024,2048,4096]
                                       [--quick] [--json FILE]

One rank, the last (rank n-1 of n: the most keys), is played through torch's fake process group:
every buffer and kernel is real, no data moves (received tensors hold whatever their memory held).
The model is Gemma 3's text model in the demo's layout (5 sliding-window layers, window 512, then a
global one; one KV head), at hidden size 256 (4 heads of 64), vocabulary 256, float32 (`--layers`,
`--hidden`, `--heads`, `--head-dim`, `--vocab`, `--intermediate` set other shapes: `make gpu-check`
runs Gemma-3-1B's), with activation checkpointing (`hf.checkpoint_kwargs()`). `--model deepseek_v32`
is DeepSeek V3.2's sparse attention instead (`cp_support.models.capacity_dsa`: 2 layers, MLA with
16 heads, an indexer picking `--topk` keys per query; variants alone, torch_impl and allgather);
`--model qwen3_5`, `mamba2` and `minimax` are recurrent layers alone (Gated DeltaNet, Mamba2,
MiniMax's lightning attention: cp_support.models), their bytes per layer counted;
`--model gemma2` (soft-capping, window 512) and `--model gpt_oss` (sinks, window 128) alternate
sliding and global layers on eager attention, the only one transformers gives them, which is
also what `alone` and `dense` run.
Per tokens-per-rank L (global S = n * L), one forward+backward of:

  alone       the plain model on the rank's L tokens, no CP: what the rank's own tokens cost
  torch_impl  torch_impl.hf: halos and gathers, then torch_impl.attention (no [L, T] mask)
  dense       torch_impl.hf's transport with the dense [L, T] masks of the model's own sdpa
              (eager for Gemma 2 and GPT-OSS: what torch_impl.hf did before torch_impl.attention,
              and for those two until it computed their soft-cap and sinks; the fallback path)
  allgather   cp_support/allgather.py: every attention layer all-gathers K and V (same math)

CPU: each (variant, L) in a fresh process, peak resident set above the resident set after a
warm-up step (glibc returning freed blocks at once, as make bench's ranks: cp_support.launch.RANK_ENV), and
the median time of `--reps` steps. CUDA (when present): in this process, `max_memory_allocated`
above weights and gradients, and also the largest L each variant fits (doubling until out of memory).
Writes JSON (`out/rank_capacity.json`) and a figure (`out/rank_capacity.png`: peak memory against
tokens per rank); prints a table with the ratios to `alone`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from cp_support import results
from cp_support.memory import peak_mib, reset_peak
from cp_support.models import WINDOWS, capacity_model
from cp_support.traffic import PayloadCounter

VARIANTS = ("alone", "torch_impl", "dense", "allgather")
RECURRENT = ("qwen3_5", "mamba2", "minimax")  # recurrent layers alone: their bytes counted per layer


def prepare(variant, args, L, device):
    """The model and this rank's kwargs for one variant, the fake group set up for CP variants."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from cp_support import allgather
    from torch_impl import hf

    dtype = getattr(torch, args.dtype)
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=args.n - 1, world_size=args.n)
    with torch.device(device):
        model = capacity_model(args, args.n * L).to(dtype)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=hf.checkpoint_kwargs())
    model.train()
    gen = torch.Generator().manual_seed(0)
    if variant == "alone":
        ids = torch.randint(0, args.vocab, (1, L), generator=gen).to(device)
        return model, {"input_ids": ids, "labels": ids, "use_cache": False}
    # dense: the fallback path, the model's own sdpa on a dense [L, T] mask
    hf.parallelize(model, dist.group.WORLD, dense=variant == "dense")
    if variant == "allgather":
        model.set_attn_implementation(allgather.IMPLEMENTATION)
    ids = torch.randint(0, args.vocab, (1, args.n * L), generator=gen).to(device)
    return model, hf.shard_batch({"input_ids": ids, "labels": ids}, dist.group.WORLD)


def measure(variant, args, L, device):
    """{"peak_mib", "ms"}: peak memory of a forward+backward above the warmed-up model with its
    gradients, and the median time of args.reps of them."""
    model, kwargs = prepare(variant, args, L, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step():
        model(**kwargs).loss.backward()
        sync()

    step()  # warm-up: allocates the gradients
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = reset_peak()  # the resident set's high-water mark restarts from here
    times = []
    for _ in range(args.reps):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = peak_mib() - base
    result = {"peak_mib": peak, "ms": 1000 * statistics.median(times)}
    if variant != "alone" and args.model in RECURRENT:  # one more step, its bytes counted
        with PayloadCounter() as counter:
            step()
        result["received_per_layer"] = counter.received // args.layers
    if variant != "alone" and args.model == "deepseek_v4":
        result |= received_per_kind(model, kwargs)
    return result


def received_per_kind(model, kwargs):
    """DeepSeek V4: the bytes each layer receives in one forward, by its type, beside what an
    all-gather of that layer's keys (one KV head) would receive."""
    received, hooks = {}, []
    with PayloadCounter() as counter, torch.no_grad():
        for layer in model.model.layers:
            kind = layer.self_attn.layer_type
            hooks.append(
                layer.register_forward_pre_hook(lambda *_, k=kind: received.__setitem__(k, -counter.received))
            )
            hooks.append(
                layer.register_forward_hook(
                    lambda *_, k=kind: received.__setitem__(k, received[k] + counter.received)
                )
            )
        model(**kwargs)
    for hook in hooks:
        hook.remove()
    n, (_, L), config = dist.get_world_size(), kwargs["input_ids"].shape, model.config
    keys = (n - 1) * L * config.head_dim * model.dtype.itemsize
    return {"received": received, "allgather_keys": keys}


def child(args):
    """One (variant, L) in this fresh process (CPU): prints its JSON line."""
    result = measure(args.child, args, args.child_len, torch.device("cpu"))
    print(json.dumps(result))


def run_cpu(args, lens):
    from cp_support.launch import RANK_ENV

    rows = []
    for L in lens:
        for variant in args.variants.split(","):  # interleaved per L: drift hits every variant alike
            command = [sys.executable, "-m", "benchmarks.rank_capacity", "--child", variant]
            command += ["--child-len", str(L), *forwarded(args)]
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=1800, env=os.environ | RANK_ENV
            )
            if done.returncode:
                raise RuntimeError(f"{variant} at L={L} failed:\n{done.stderr[-3000:]}")
            row = {"variant": variant, "L": L, "S": args.n * L} | json.loads(done.stdout.splitlines()[-1])
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def run_cuda(args, lens):
    """Every variant in this process; after the given lengths, the largest L that fits (doubling)."""
    device, rows = torch.device("cuda"), []
    for variant in args.variants.split(","):
        L, fits = lens[0], None
        while True:
            try:
                row = {"variant": variant, "L": L, "S": args.n * L} | measure(variant, args, L, device)
                fits = L
            except torch.OutOfMemoryError:
                row = {"variant": variant, "L": L, "S": args.n * L, "error": "out of memory"}
            torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
            rows.append(row)
            if "error" in row or (L >= lens[-1] and not args.find_limit):
                break
            L = L * 2 if L >= lens[-1] else next(x for x in lens if x > L)
        rows.append({"variant": variant, "largest_L": fits})
    return rows


def forwarded(args):
    return [
        f"--n={args.n}",
        f"--model={args.model}",
        f"--topk={args.topk}",
        f"--hidden={args.hidden}",
        f"--heads={args.heads}",
        f"--layers={args.layers}",
        f"--head-dim={args.head_dim or 0}",
        f"--vocab={args.vocab}",
        f"--intermediate={args.intermediate or 0}",
        f"--window={args.window}",
        f"--dtype={args.dtype}",
        f"--reps={args.reps}",
    ]


def table(rows):
    """Markdown rows: per L, each variant's peak and time and their ratios to `alone`."""
    lines = [
        "| tokens per rank L (S = n L) | variant | peak MiB | x alone | fwd+bwd ms | x alone |",
        "|---|---|---|---|---|---|",
    ]
    alone = {r["L"]: r for r in rows if r.get("variant") == "alone" and "peak_mib" in r}
    for r in rows:
        if "peak_mib" not in r:
            continue
        base = alone.get(r["L"])
        ratio = (
            (f"{r['peak_mib'] / base['peak_mib']:.2f}", f"{r['ms'] / base['ms']:.2f}") if base else ("", "")
        )
        lines.append(
            f"| {r['L']} ({r['S']}) | {r['variant']} | {r['peak_mib']:.0f} | {ratio[0]} | {r['ms']:.0f} "
            f"| {ratio[1]} |"
        )
    return "\n".join(lines)


def plot(rows, path, device):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"alone": ("o-", 1.5), "torch_impl": ("s-", 4), "dense": ("^-", 1.5), "allgather": ("x--", 1.5)}
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for variant in VARIANTS:  # allgather's dashed line lies on torch_impl's thick one
        points = sorted(
            (r["L"], r["peak_mib"]) for r in rows if r.get("variant") == variant and "peak_mib" in r
        )
        if points:
            style, width = styles[variant]
            ax.plot(*zip(*points, strict=True), style, lw=width, label=variant)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per rank L (rank n-1 of n)")
    ax.set_ylabel("peak MiB above weights and gradients" if device == "cuda" else "peak resident MiB rise")
    ax.set_title(f"one CP rank's memory, forward+backward ({device})")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8, help="CP ranks; this process plays rank n-1")
    p.add_argument(
        "--model",
        choices=("gemma3", "gemma2", "gpt_oss", "deepseek_v32", "deepseek_v4", *RECURRENT),
        default="gemma3",
    )
    p.add_argument(
        "--topk", type=int, default=256, help="deepseek_v32, deepseek_v4: keys (entries) a query picks"
    )
    p.add_argument("--lens", default="1024,2048,4096", help="tokens per rank")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=6, help="gemma3: 5 sliding, 1 global, repeated")
    p.add_argument("--head-dim", type=int, default=0, help="gemma3: default hidden / heads")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=0, help="gemma3: default 3 * hidden")
    p.add_argument("--window", type=int, default=0, help="default: 512 (gpt_oss: 128)")
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--variants", help="a comma-separated subset (default: all the model has)")
    p.add_argument("--find-limit", action="store_true", help="CUDA: double L until out of memory")
    p.add_argument("--quick", action="store_true", help="one small length, one repetition (the tests)")
    p.add_argument("--json", default="out/rank_capacity.json")
    p.add_argument("--plot", default="out/rank_capacity.png")
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--child-len", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    known = VARIANTS
    if args.model in ("deepseek_v32", "deepseek_v4", *RECURRENT):  # no dense path; recurrent layers alone
        known = (
            ("alone", "torch_impl", "allgather") if args.model == "deepseek_v32" else ("alone", "torch_impl")
        )
    args.variants = args.variants or ",".join(known)
    unknown = set(args.variants.split(",")) - set(known)
    if unknown:
        p.error(f"--variants: {sorted(unknown)} not for --model {args.model}; choose from {known}")
    if args.dtype is None:
        args.dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    if args.quick:
        args.lens, args.reps = "256", 1
    return args


def main(argv=None):
    args = parse(argv)
    if args.child:
        return child(args)
    lens = [int(x) for x in args.lens.split(",")]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = {
        "deepseek_v32": f"DeepSeek V3.2 (build_dsa), top-k {args.topk}",
        "deepseek_v4": f"DeepSeek V4's sliding, CSA and HCA layers (capacity_deepseek_v4), top-k {args.topk}",
        "qwen3_5": f"Qwen3.5's Gated DeltaNet, {args.layers} layers, hidden {args.hidden}, 16 heads of 128",
        "mamba2": f"Mamba2 at Nemotron-H's head sizes, {args.layers} layers, hidden {args.hidden}",
        "minimax": f"MiniMax's lightning attention, {args.layers} layers, heads of 128, hidden {args.hidden}",
    }.get(args.model) or f"{args.model}, hidden {args.hidden}, window {args.window or WINDOWS[args.model]}"
    print(
        f"# one CP rank (rank {args.n - 1} of {args.n}, fake process group) on {device}: {model}, "
        f"{args.dtype}, activation checkpointing"
    )
    rows = run_cuda(args, lens) if device == "cuda" else run_cpu(args, lens)
    print(table(rows))
    results.write(args.json, args, rows)
    plot(rows, args.plot, device)
    print(f"# {args.json}, {args.plot}")
    return rows


if __name__ == "__main__":
    main()
