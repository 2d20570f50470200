"""Per-rank work under both sequence layouts: every CP rank's forward+backward time, contiguous vs head_tail.

    python -m benchmarks.layout_balance [--n 8] [--len 2048] [--models llama,gemma3] [--reps 2]

A CP step lasts as long as its slowest rank. Each rank r of n is played, one at a time, through
torch's fake process group (real buffers and kernels, no data moved), each (model, layout, rank) in
a fresh process with one thread (cp_support.launch.RANK_ENV), the median of `--reps` forward+backward steps
after a warm-up. Models, float32, activation checkpointing:

  llama   all-global: Llama, 4 full-attention layers, hidden 256, 4 heads, 1 KV head of 64
  gemma3  the demo's Gemma 3 layout (bench-capacity's model: 5 sliding layers of window 512, then
          a global one; hidden 256, 4 heads of 64, 1 KV head)

Prints per model and layout the time of every rank, the slowest / fastest and the slowest against
contiguous's slowest (the ideal for the attention share: (n+1)/(2n)); writes JSON and a figure of
time per rank (`out/layout_balance.json`, `.png`).
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

LAYOUTS = ("contiguous", "head_tail")


def build(model, max_positions):
    import transformers as tf

    torch.manual_seed(0)
    if model == "llama":
        config = tf.LlamaConfig(
            vocab_size=256,
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=64,
            max_position_embeddings=max_positions,
            attn_implementation="sdpa",
        )
        return tf.LlamaForCausalLM(config)
    from benchmarks import rank_capacity
    from cp_support.models import capacity_model

    return capacity_model(rank_capacity.parse([]), max_positions)


def child(args):
    """One (model, layout, rank) in this process: prints the median step in ms."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torch_impl import hf

    dist.init_process_group("fake", store=FakeStore(), rank=args.child_rank, world_size=args.n)
    model = build(args.model, args.n * args.len)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=hf.checkpoint_kwargs())
    model.train()
    hf.parallelize(model, dist.group.WORLD, layout=args.layout, verbose=False)
    ids = torch.randint(0, 256, (1, args.n * args.len), generator=torch.Generator().manual_seed(0))
    local = hf.shard_batch({"input_ids": ids, "labels": ids}, dist.group.WORLD, layout=args.layout)
    times = []
    for _ in range(args.reps + 1):  # the first warms up
        began = time.perf_counter()
        model(**local).loss.backward()
        times.append(time.perf_counter() - began)
    print(json.dumps({"ms": 1000 * statistics.median(times[1:])}))


def run(args):
    from cp_support.launch import RANK_ENV

    rows = []
    for model in args.models.split(","):
        for r in range(args.n):
            for layout in LAYOUTS:  # interleaved per rank: drift hits both alike
                command = [sys.executable, "-m", "benchmarks.layout_balance", "--child-rank", str(r)]
                command += [f"--model={model}", f"--layout={layout}", f"--n={args.n}", f"--len={args.len}"]
                command += [f"--reps={args.reps}"]
                done = subprocess.run(
                    command, capture_output=True, text=True, timeout=1800, env=os.environ | RANK_ENV
                )
                if done.returncode:
                    raise RuntimeError(f"{model} {layout} rank {r} failed:\n{done.stderr[-3000:]}")
                row = {"model": model, "layout": layout, "rank": r} | json.loads(done.stdout.splitlines()[-1])
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def summary(rows, n):
    lines = ["| model | layout | ms per rank 0 .. n-1 | slowest / fastest | slowest / contiguous's slowest |"]
    lines.append("|---|---|---|---|---|")
    for model in dict.fromkeys(r["model"] for r in rows):
        base = max(r["ms"] for r in rows if r["model"] == model and r["layout"] == "contiguous")
        for layout in LAYOUTS:
            ms = [
                r["ms"]
                for r in sorted(rows, key=lambda r: r["rank"])
                if (r["model"], r["layout"]) == (model, layout)
            ]
            lines.append(
                f"| {model} | {layout} | {', '.join(f'{m:.0f}' for m in ms)} | {max(ms) / min(ms):.2f} "
                f"| {max(ms) / base:.2f} |"
            )
    lines.append(f"(ideal for the attention share: (n+1)/(2n) = {(n + 1) / (2 * n):.2f})")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for layout, style in zip(LAYOUTS, ("o-", "s-"), strict=True):
            points = sorted(
                (r["rank"], r["ms"] / 1000) for r in rows if (r["model"], r["layout"]) == (model, layout)
            )
            ax.plot(*zip(*points, strict=True), style, label=layout)
        ax.set_title(f"{model}: forward+backward per CP rank")
        ax.set_xlabel("CP rank")
        ax.set_ylabel("seconds")
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--len", type=int, default=2048, help="tokens per rank")
    p.add_argument("--models", default="llama,gemma3")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--json", default="out/layout_balance.json")
    p.add_argument("--plot", default="out/layout_balance.png")
    p.add_argument("--child-rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--layout", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    if args.child_rank is not None:
        return child(args)
    rows = run(args)
    print(summary(rows, args.n))
    results.write(args.json, args, rows)
    plot(rows, args.plot)
    print(f"# {args.json}, {args.plot}")
    return rows


if __name__ == "__main__":
    main()
