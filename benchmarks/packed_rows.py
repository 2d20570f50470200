"""`make bench-packed`: packed rows under CP cost what their documents need.

    python -m benchmarks.packed_rows [--n 8] [--len 4096] [--mixes short,long]
                                     [--layouts contiguous,head_tail] [--ranks last|all]
                                     [--variants alone,torch_impl] [--quick] [--json FILE]

A row of S = n * L tokens is packed with documents, position_ids restarting at each: `short` draws
their lengths uniformly from 256 to 3072 tokens; `long` is a mix with a few long documents (one in
five of 4096 to 16384 tokens, the rest 256 to 1024). One CP rank at a time (the last, or every
rank) is played through torch's fake process group, in a fresh process, on make bench-capacity's
model (cp_support.models.capacity_model: Gemma 3's layout, 5 sliding layers of window 512 then a
global one, hidden 256, float32, activation checkpointing). The fake group moves no data, so the
model's one gather of the positions is answered here with the row's positions, as a real group
would answer it: every other buffer and kernel is real.

  alone       the plain model on the rank's own L tokens and their positions (its documents cut at
              its chunks' edges): what the rank's own tokens cost
  torch_impl  torch_impl.hf on the rank's shard of the packed row (`layout` contiguous or head_tail)

Per rank: the peak resident-set rise and the median step time of `--reps` steps, as ratios to
alone; and the bytes torch_impl's rank receives per layer kind in one more step (counted at the
c10d calls, without checkpointing), against the documents' minimum: per chunk, the K and V of the
tokens before it back to the start of the document that holds its first token (a sliding layer:
at most W - 1 of them) that other ranks hold, and backward the gradients of the tokens it lent.
Prints a table; writes `out/packed_rows.json`.
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
from cp_support.models import capacity_model

VARIANTS = ("alone", "torch_impl")
MIXES = {"short": ((1.0, 256, 3072),), "long": ((0.8, 256, 1024), (0.2, 4096, 16384))}


def packed_positions(mix, S, seed=0):
    """int64 [S]: position_ids of one row packed with documents drawn from MIXES[mix]."""
    gen = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < S:
        u, acc = torch.rand((), generator=gen).item(), 0.0
        for share, lo, hi in MIXES[mix]:  # noqa: B007 (the one drawn is used below)
            acc += share
            if u <= acc:
                break
        length = int(torch.randint(lo, hi + 1, (), generator=gen))
        lengths.append(min(length, S - total))
        total += lengths[-1]
    return torch.cat([torch.arange(n) for n in lengths])


def minimum_bytes(positions, n, r, L, layout, config, item=4):
    """{layer kind: bytes} rank r must receive in one step on this packed row, over all the layers
    of that kind (module docstring)."""
    from torch_impl.layout import ShardPlan

    shards = [ShardPlan.of(layout, n, q, L) for q in range(n)]
    owner = {int(t): q for q, shard in enumerate(shards) for t in shard.rows()}
    per_token = 2 * config.num_key_value_heads * config.head_dim * item
    out = {}
    for kind, cap in (("full_attention", None), ("sliding_attention", config.sliding_window - 1)):
        windows = []  # per rank: the global rows of its chunks' windows
        for shard in shards:
            rows = []
            for w in shard.windows():
                reach = int(positions[w.start])  # how far back the document of its first token began
                rows += range(w.start - (reach if cap is None else min(reach, cap)), w.start)
            windows.append(rows)
        received = sum(owner[t] != r for t in windows[r])
        lent = sum(owner[t] == r for q in range(n) if q != r for t in windows[q])
        out[kind] = (received + lent) * per_token * config.layer_types.count(kind)  # every such layer
    return out


def prepare(args, variant):
    """The model and this rank's kwargs (the fake group set up as rank args.rank of args.n)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torch_impl import hf
    from torch_impl.hf import inputs
    from torch_impl.layout import ShardPlan

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.n)
    model = capacity_model(args, args.n * args.len).to(getattr(torch, args.dtype))
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=hf.checkpoint_kwargs())
    model.train()
    S = args.n * args.len
    positions = packed_positions(args.mix, S)[None]  # [1, S]
    ids = torch.randint(0, args.vocab, (1, S), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids, "position_ids": positions}
    if variant == "alone":
        rows = ShardPlan.of(args.layout, args.n, args.rank, args.len).rows()
        return model, {key: value[:, rows] for key, value in batch.items()} | {"use_cache": False}
    hf.parallelize(model, dist.group.WORLD, layout=args.layout, verbose=False)
    inputs.gather_metadata = lambda x, group, layout: positions.expand(len(x), -1).clone()
    return model, hf.shard_batch(batch, dist.group.WORLD, layout=args.layout)


def counted_bytes(model, kwargs):
    """{layer kind: bytes received} in one forward+backward without checkpointing (a recomputed
    forward would fetch its keys again)."""
    from cp_support.traffic import count_step

    model.activation_checkpointing_disable()
    kinds, out = model.config.layer_types, {}
    for call in count_step(model, kwargs):
        if isinstance(call.tag, tuple) and call.dtype.is_floating_point:  # K and V, not the positions
            out[kinds[call.tag[1]]] = out.get(kinds[call.tag[1]], 0) + call.received
    return out


def child(args):
    """One (variant, layout, mix, rank) in this fresh process: prints its JSON line."""
    model, kwargs = prepare(args, args.child)
    model(**kwargs).loss.backward()  # warm-up: allocates the gradients
    base, times = reset_peak(), []
    for _ in range(args.reps):
        began = time.perf_counter()
        model(**kwargs).loss.backward()
        times.append(time.perf_counter() - began)
    row = {"peak_mib": peak_mib() - base, "ms": 1000 * statistics.median(times)}
    if args.child == "torch_impl":
        positions = packed_positions(args.mix, args.n * args.len)
        row["bytes"] = counted_bytes(model, kwargs)
        row["minimum"] = minimum_bytes(positions, args.n, args.rank, args.len, args.layout, model.config)
    print(json.dumps(row))


def run(args):
    from cp_support.launch import RANK_ENV

    ranks = range(args.n) if args.ranks == "all" else [args.n - 1]
    rows = []
    for mix in args.mixes.split(","):
        for layout in args.layouts.split(","):
            for rank in ranks:
                for variant in args.variants.split(","):  # interleaved: drift hits both alike
                    command = [sys.executable, "-m", "benchmarks.packed_rows", "--child", variant]
                    command += [f"--mix={mix}", f"--layout={layout}", f"--rank={rank}", *forwarded(args)]
                    done = subprocess.run(
                        command, capture_output=True, text=True, timeout=1800, env=os.environ | RANK_ENV
                    )
                    if done.returncode:
                        raise RuntimeError(
                            f"{variant} {mix} {layout} rank {rank} failed:\n{done.stderr[-3000:]}"
                        )
                    row = {"mix": mix, "layout": layout, "rank": rank, "variant": variant}
                    row |= json.loads(done.stdout.splitlines()[-1])
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    return rows


def forwarded(args):
    return [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in SHARED]


SHARED = (
    "n",
    "len",
    "hidden",
    "heads",
    "layers",
    "head_dim",
    "vocab",
    "intermediate",
    "window",
    "dtype",
    "reps",
)


def table(rows):
    """Markdown: per (mix, layout, rank), torch_impl's peak and time as ratios to alone, and its
    bytes per layer kind against the documents' minimum."""
    lines = [
        "| documents | layout | rank | peak x alone | time x alone | full layer bytes / minimum "
        "| sliding layer bytes / minimum |",
        "|---|---|---|---|---|---|---|",
    ]
    alone = {(r["mix"], r["layout"], r["rank"]): r for r in rows if r["variant"] == "alone"}
    for r in rows:
        if r["variant"] != "torch_impl":
            continue
        base = alone.get((r["mix"], r["layout"], r["rank"]))
        peak = f"{r['peak_mib'] / base['peak_mib']:.2f}" if base else ""
        ms = f"{r['ms'] / base['ms']:.2f}" if base else ""
        kinds = [
            f"{r['bytes'].get(k, 0)} / {r['minimum'][k]}" for k in ("full_attention", "sliding_attention")
        ]
        lines.append(
            f"| {r['mix']} | {r['layout']} | {r['rank']} | {peak} | {ms} | {kinds[0]} | {kinds[1]} |"
        )
    for mix in dict.fromkeys(r["mix"] for r in rows):
        for layout in dict.fromkeys(r["layout"] for r in rows):
            ms = [
                r["ms"] for r in rows if (r["mix"], r["layout"], r["variant"]) == (mix, layout, "torch_impl")
            ]
            if len(ms) > 1:
                lines.append(
                    f"\n{mix}, {layout}: slowest rank {max(ms):.0f} ms, fastest {min(ms):.0f} ms "
                    f"({max(ms) / min(ms):.2f}x)"
                )
    return "\n".join(lines)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8, help="CP ranks")
    p.add_argument("--len", type=int, default=4096, help="tokens per rank L")
    p.add_argument("--mixes", default="short,long", help=f"document length mixes, of {sorted(MIXES)}")
    p.add_argument("--layouts", default="contiguous,head_tail")
    p.add_argument("--ranks", choices=("last", "all"), default="last")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=6, help="5 sliding, 1 global, repeated")
    p.add_argument("--head-dim", type=int, default=0, help="default hidden / heads")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=0, help="default 3 * hidden")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="n 4, L 512, one repetition (the tests)")
    p.add_argument("--json", default="out/packed_rows.json")
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--mix", choices=sorted(MIXES), help=argparse.SUPPRESS)
    p.add_argument("--layout", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.model, args.topk = "gemma3", 0  # capacity_model's arguments
    if args.quick:
        args.n, args.len, args.reps, args.window = 4, 512, 1, 128
    return args


def main(argv=None):
    args = parse(argv)
    if args.child:
        return child(args)
    print(
        f"# packed rows, one CP rank of {args.n} (fake process group), L = {args.len}: Gemma 3 layout, "
        f"hidden {args.hidden}, window {args.window}, {args.dtype}, activation checkpointing"
    )
    rows = run(args)
    print(table(rows))
    results.write(args.json, args, rows)
    print(f"# {args.json}")
    return rows


if __name__ == "__main__":
    main()
