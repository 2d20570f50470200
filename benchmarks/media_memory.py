"""A CP rank's peak memory and time with images across the ranks, against the rank alone.

    python -m benchmarks.media_memory [--n 2] [--len 4096] [--reps 2] [--quick] [--json FILE]

Gemma 3 (`Gemma3ForConditionalGeneration`: its images' tokens see every token of their image, so a
chunk holding image tokens runs the model's attention per block of 256 queries on a dense mask, and
its vision tower's work is split over the ranks) at small widths: the text model in the demo's
layout (5 sliding layers, window 512, then a global one; hidden 256, 4 heads of 64, one KV head),
a SigLIP tower of 2 layers, 128 wide, on 224 x 224 images of 64 tokens; float32, train mode with
activation checkpointing (`hf.checkpoint_kwargs()`), one thread a rank. Images of 64 tokens every
L / 8 tokens, placed so that one crosses every shard edge:

  alone       one process: the plain model on a row of L tokens (7 images), no CP
  torch_impl  n gloo ranks: a row of n L tokens (8 n - 1 images) made CP by hf.parallelize and
              sharded by hf.shard_batch; each rank's figures (the last holds 7.5 images' tokens)

Each variant in fresh processes (cp_support.launch.run_ranks, RANK_ENV): a warm-up step, then the
resident set's peak rise above the warmed-up process over `--reps` steps and their median time.
"""

import argparse
import statistics
import time

import torch

from cp_support import results
from cp_support.launch import RANK_ENV, run_ranks

IMAGE_TOKENS = 64
VOCAB = 256
IMAGE = VOCAB - 1  # the image placeholder's id (its begin and end marks: the two before)


def build():
    """The benchmark's Gemma 3, float32, train mode, checkpointed as under CP."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from torch_impl import hf

    text = dict(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=1)
    text |= dict(head_dim=64, num_hidden_layers=6, sliding_window=512, max_position_embeddings=1 << 16)
    text |= dict(layer_types=["sliding_attention"] * 5 + ["full_attention"], vocab_size=VOCAB)
    vision = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4)
    vision |= dict(image_size=224, patch_size=14)  # 16 x 16 patches, pooled to 8 x 8: 64 tokens
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=IMAGE_TOKENS)
    config.image_token_id, config.boi_token_index, config.eoi_token_index = IMAGE, IMAGE - 1, IMAGE - 2
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=hf.checkpoint_kwargs())
    return model


def batch(config, S, L, seed=0):
    """A row of S tokens, an image of IMAGE_TOKENS every L / 8 tokens from L / 8 - 32 on (one across
    each multiple of L), with the processor's token types and the images' pixels."""
    gen = torch.Generator().manual_seed(seed)
    spacing = L // 8
    ids = torch.randint(4, IMAGE - 2, (1, S), generator=gen)  # text: clear of the special ids
    types = torch.zeros_like(ids)
    starts = range(spacing - IMAGE_TOKENS // 2, S - IMAGE_TOKENS + 1, spacing)
    for start in starts:
        ids[0, start : start + IMAGE_TOKENS] = IMAGE
        types[0, start : start + IMAGE_TOKENS] = 1
    side = config.vision_config.image_size
    pixels = torch.randn(len(starts), 3, side, side, generator=gen)
    labels = ids.masked_fill(types == 1, -100)
    return {"input_ids": ids, "token_type_ids": types, "pixel_values": pixels, "labels": labels}


def rank_figures(rank, world, L, reps, cp):
    """On this rank: its peak resident-set rise (MiB) over `reps` steps and their median time (ms)."""
    import torch.distributed as dist

    from cp_support.memory import peak_mib, reset_peak
    from torch_impl import hf

    torch.set_num_threads(1)
    model = build()
    kwargs = batch(model.config, world * L if cp else L, L)
    if cp:
        hf.parallelize(model, dist.group.WORLD, verbose=False)
        kwargs = hf.shard_batch(kwargs, dist.group.WORLD)

    def step():
        model(**kwargs).loss.backward()

    step()  # warm-up: allocates the gradients
    base, times = reset_peak(), []
    for _ in range(reps):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    return {"peak_mib": peak_mib() - base, "ms": 1000 * statistics.median(times)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2, help="CP ranks (gloo processes)")
    p.add_argument("--len", type=int, default=4096, help="tokens a rank (a multiple of 512)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="512 tokens a rank, one step")
    p.add_argument("--json", default="out/media_memory.json")
    args = p.parse_args(argv)
    if args.quick:
        args.len, args.reps = 512, 1
    rows = []
    for variant, world in (("alone", 1), ("torch_impl", args.n)):
        figures = run_ranks(
            rank_figures, world, args.len, args.reps, variant != "alone", timeout_s=1800, env=RANK_ENV
        )
        for rank, f in enumerate(figures):
            rows.append({"variant": variant, "rank": rank, "L": args.len} | f)
            print(rows[-1], flush=True)
    alone = rows[0]
    worst = max((r for r in rows if r["variant"] == "torch_impl"), key=lambda r: r["peak_mib"])
    print(
        f"# the worst rank's peak {worst['peak_mib'] / alone['peak_mib']:.2f}x the rank alone's, "
        f"its step {worst['ms'] / alone['ms']:.2f}x"
    )
    results.write(args.json, args, rows)


if __name__ == "__main__":
    main()
