"""The main job: a context-parallel hybrid block on gloo ranks equals the single-process block.

    python -m examples.demo [--world 4] [--seq-len 4096] [--window 1280] [--kernel 4] [--dim 64]
                            [--dtype float32] [--figure out/cp_routing.png] [--routing]

Runs examples.hybrid_block on one process over the whole sequence, then on `--world` gloo ranks
each holding a contiguous shard, with the same weights; prints the max abs difference of the
output, the input gradient and every parameter gradient (exit status 1 if any is over the dtype's
tolerance), then per layer the bytes each rank received through torch_impl against a full gather,
and the forward+backward time; draws which global tokens each rank owns and receives.
`--routing` prints the JAX reference's routing table instead.
"""

import argparse
import statistics
import sys
import time

import torch

from cp_support.launch import run_ranks
from cp_support.traffic import PayloadCounter
from examples import hybrid_block as hb

TOLERANCE = {"float32": 1e-5, "float64": 1e-12}
LAYERS = ["causal_conv", "sliding_window_attention", "full_attention"]


def _layer_call(block, name, x, group, positions, valid):
    fn = getattr(block, name)
    return fn(x, group, positions, valid) if name == "full_attention" else fn(x, group)


def measure_layers(block, x, group, positions, valid, reps):
    """Per layer, on this rank: payload bytes received in one forward+backward, and the median time."""
    report = {}
    cotangent = torch.randn_like(x)
    for name in LAYERS:
        xs = x.detach().clone().requires_grad_(True)
        with PayloadCounter() as counted:
            _layer_call(block, name, xs, group, positions, valid).backward(cotangent)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            _layer_call(block, name, xs, group, positions, valid).backward(cotangent)
            times.append(time.perf_counter() - start)
        report[name] = {
            "received": counted.received,
            "calls": counted.calls,
            "seconds": statistics.median(times),
        }
    return report


def cp_rank_main(rank, world, config, state, inputs):
    """One CP rank: the block's forward+backward on its shard, then per-layer traffic and time."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    group = dist.group.WORLD
    block = hb.make_block(config["dim"], config["heads"], config["kernel"], config["window"], config["dtype"])
    block.load_state_dict(state)
    x, cotangent, positions, valid = inputs
    y, grad_x, grads = hb.cp_forward_backward(block, x, cotangent, group, positions, valid)
    L = x.shape[1] // world
    shard = slice(rank * L, (rank + 1) * L)
    layers = measure_layers(block, x[:, shard], group, positions[:, shard], valid[:, shard], config["reps"])
    return y, grad_x, grads, layers


def print_cost_table(config, per_rank_layers):
    n, S, D = config["world"], config["seq_len"], config["dim"]
    L = S // n
    item = torch.tensor([], dtype=config["dtype"]).element_size()
    tensors = {"causal_conv": 1, "sliding_window_attention": 2, "full_attention": 2}
    print("\nPer layer and rank: bytes received through torch_impl in one forward+backward (counted at the")
    print("c10d calls), against a full gather of the same tensors (all-gather forward, reduce-scatter")
    print("backward: 2*(n-1)*L tokens each). tokens in: per tensor, in forward. time: the layer's")
    print("forward+backward, median of --reps.")
    columns = (
        ("rank", 5),
        ("tokens in", 12),
        ("received", 14),
        ("full gather", 14),
        ("ratio", 8),
        ("time ms", 10),
    )
    print(f"{'layer':<26}" + "".join(f"{name:>{width}}" for name, width in columns))
    for name in LAYERS:
        for r, layers in enumerate(per_rank_layers):
            got = layers[name]["received"]
            full = tensors[name] * 2 * (n - 1) * L * config["batch"] * D * item
            halo = {"causal_conv": config["kernel"] - 1, "sliding_window_attention": config["window"] - 1}
            tokens = min(r * L, halo[name]) if name in halo else (n - 1) * L
            print(
                f"{name:<26}{r:>5}{tokens:>12}{got:>14,}{full:>14,}{got / full:>8.3f}"
                f"{1000 * layers[name]['seconds']:>10.2f}"
            )
    print("(full_attention also gathers int64 positions and a bool mask: its ratio is a little over 1)")


def draw_routing(config, path):
    """For each rank and layer: the tokens it owns (blue) and those it receives (the layer's color)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n, S, K, W = config["world"], config["seq_len"], config["kernel"], config["window"]
    L = S // n
    layers = [
        (f"conv halo (K-1={K - 1})", "#ff7f0e", lambda r: [(r * L - min(r * L, K - 1), r * L)]),
        (f"window halo (W-1={W - 1})", "#2ca02c", lambda r: [(r * L - min(r * L, W - 1), r * L)]),
        ("full gather", "#9e9e9e", lambda r: [(0, r * L), ((r + 1) * L, S)]),
    ]
    fig, ax = plt.subplots(figsize=(10, 0.6 + 0.75 * n * len(layers) / 2))
    ticks, labels = [], []
    for r in range(n):
        for k, (label, color, spans) in enumerate(layers):
            y = r * (len(layers) + 0.8) + k
            ticks.append(y)
            labels.append(f"rank {r}  {label.split(' (')[0]}")
            ax.barh(y, L, left=r * L, height=0.7, color="#1f77b4", label="owned" if y == 0 else None)
            for lo, hi in spans(r):
                if hi > lo:
                    ax.barh(y, hi - lo, left=lo, height=0.7, color=color, label=label if r == n - 1 else None)
                    if hi - lo < S / 200:  # too thin to see: point at it
                        ax.annotate(
                            f"{hi - lo} tokens",
                            (lo, y),
                            xytext=(lo - S / 8, y + 0.1),
                            fontsize=7,
                            arrowprops={"arrowstyle": "->", "lw": 0.8},
                            va="center",
                        )
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, S)
    ax.set_xlabel("global token position")
    ax.set_title(f"What each CP rank owns and receives: n={n}, L={L}, kernel {K}, window {W}")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4, frameon=False, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(config, figure=None, timeout_s=300):
    """The whole job; returns the max differences and each rank's layer report."""
    n, S = config["world"], config["seq_len"]
    if S % n:
        raise ValueError(f"`--seq-len` must be a multiple of `--world`, got {S} and {n}")
    block = hb.make_block(config["dim"], config["heads"], config["kernel"], config["window"], config["dtype"])
    inputs = hb.make_inputs(config["batch"], S, config["dim"], config["pad"], config["dtype"])
    print(f"[1/4] single-process block over {S} tokens", flush=True)
    start = time.perf_counter()
    reference = hb.forward_backward(block, *inputs[:2], None, *inputs[2:])
    print(f"      forward+backward {time.perf_counter() - start:.2f}s", flush=True)
    print(f"[2/4] CP block on {n} gloo ranks, {S // n} tokens each", flush=True)
    start = time.perf_counter()
    results = run_ranks(cp_rank_main, n, config, block.state_dict(), inputs, timeout_s=timeout_s)
    print(f"      done in {time.perf_counter() - start:.2f}s (process start included)", flush=True)
    print("[3/4] CP vs single process, max abs difference:", flush=True)
    diffs = hb.max_differences(reference, [res[:3] for res in results])
    for name, d in diffs.items():
        print(f"      {name:<32}{d:.3e}")
    print("[4/4] cost per layer", flush=True)
    print_cost_table(config, [res[3] for res in results])
    if figure:
        draw_routing(config, figure)
        print(f"\nfigure: {figure}")
    return diffs, [res[3] for res in results]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--window", type=int, default=1280)
    parser.add_argument("--kernel", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=sorted(TOLERANCE), default="float32")
    parser.add_argument("--pad", type=int, default=None, help="padded tokens at the end (default seq_len/16)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--figure", default="out/cp_routing.png")
    parser.add_argument("--routing", action="store_true", help="print the JAX reference's routing table")
    args = parser.parse_args(argv)
    if args.routing:
        from examples import routing_table

        return routing_table.main([])
    config = vars(args) | {"dtype": getattr(torch, args.dtype)}
    config["pad"] = args.seq_len // 16 if args.pad is None else args.pad
    if args.figure:
        import os

        os.makedirs(os.path.dirname(args.figure) or ".", exist_ok=True)
    diffs, _ = run(config, args.figure)
    worst = max(diffs.values())
    tolerance = TOLERANCE[args.dtype]
    verdict = "EQUAL" if worst <= tolerance else "DIFFERENT"
    print(f"\n{verdict}: largest difference {worst:.3e} (tolerance {tolerance:g} for {args.dtype})")
    return 0 if worst <= tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
