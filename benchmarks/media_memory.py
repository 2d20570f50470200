"""A CP rank's peak memory and time with images or a video across the ranks, against the rank alone.

    python -m benchmarks.media_memory [--model gemma3 gemma4 qwen3_vl] [--n 2] [--len 4096] [--reps 2]
                                      [--layout head_tail] [--quick] [--json FILE]

Three vision-language models at small widths, each a text model of 6 layers (hidden 256, 4 heads of
64, one KV head) and a vision tower of 2 layers, 128 wide; media items of 64 tokens every L / 8
tokens, placed so that one crosses every shard edge:

  gemma3    `Gemma3ForConditionalGeneration`: its images' tokens see every token of their image, so
            a chunk holding image tokens runs the model's attention per block of 256 queries on a
            dense mask. The demo's layout (5 sliding layers, window 512, then a global one), a
            SigLIP tower on 224 x 224 images (16 x 16 patches pooled to 8 x 8).
  gemma4    `Gemma4ForConditionalGeneration` with `use_bidirectional_attention="vision"`: its
            images see themselves on the sliding layers only (the same layout, window 512, past an
            image's 64 tokens; the global layer's heads 128 wide, Gemma 4's 2 x), no per-layer
            inputs; its tower on 16 x 16 patches of 16 pixels, pooled 2 x 2.
  qwen3_vl  `Qwen3VLForConditionalGeneration`, causal, given one video (`pixel_values_videos`,
            `video_grid_thw`): its frames (temporal patches of 16 x 16 patches, merged 2 x 2), each
            between the vision start and end marks (text between them, where its timestamps go),
            with mRoPE positions over the whole row.

Each rank encodes its share of the items (Qwen3-VL's video split into frames), so about 1 / n of
the vision tower's work; float32, train mode with activation checkpointing
(`hf.checkpoint_kwargs()`), one thread a rank, the head_tail layout (balanced causal work; Qwen3-VL's
layers are all full attention, each CP rank's queries over twice its own keys on average, which
the rank alone does not pay):

  alone       one process: the plain model on a row of L tokens (7 items), no CP
  torch_impl  n gloo ranks: a row of n L tokens (8 n - 1 items) made CP by hf.parallelize and
              sharded by hf.shard_batch; each rank's figures (under head_tail, rank 0 holds 7
              items' tokens, rank 1 8)
  ..., text   the same, on the same token ids without the media (`--text`, Qwen3-VL's by default):
              what the text alone costs under CP

Each variant of each model in fresh processes (cp_support.launch.run_ranks, RANK_ENV): a warm-up
step, then the resident set's peak rise above the warmed-up process over `--reps` steps and their
median time.
"""

import argparse
import statistics
import time

import torch

from cp_support import results
from cp_support.launch import RANK_ENV, run_ranks

MEDIA_TOKENS = 64  # an image's or a video frame's placeholder tokens: 8 x 8 (pooled or merged)
VOCAB = 256
PLACEHOLDER, BEGIN, END = VOCAB - 1, VOCAB - 2, VOCAB - 3  # an item's placeholder id and marks
TEXT = dict(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=1)
TEXT |= dict(head_dim=64, num_hidden_layers=6, vocab_size=VOCAB, max_position_embeddings=1 << 16)
SLIDING = dict(sliding_window=512, layer_types=["sliding_attention"] * 5 + ["full_attention"])
TOWER = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4)


def spacing(L):
    """Tokens from one item to the next: L / 8; 128 at L = 512 (--quick), so that text (marks)
    parts the items."""
    return max(L // 8, 2 * MEDIA_TOKENS)


def starts(S, L):
    """The first placeholder of each item: one every spacing(L) tokens from half an item before it
    on (one across each multiple of L)."""
    return range(spacing(L) - MEDIA_TOKENS // 2, S - MEDIA_TOKENS + 1, spacing(L))


def placed(S, L, kind, gen, marks=False):
    """A row of S text tokens (clear of the special ids) with the items' placeholders (`marks`: each
    between BEGIN and END), their token types (`kind`: 1 image, 2 video) and the labels (text only)."""
    ids = torch.randint(4, END, (1, S), generator=gen)  # [1, S]
    types = torch.zeros_like(ids)  # [1, S]
    for start in starts(S, L):
        ids[0, start : start + MEDIA_TOKENS] = PLACEHOLDER
        types[0, start : start + MEDIA_TOKENS] = kind
        if marks:
            ids[0, start - 1], ids[0, start + MEDIA_TOKENS] = BEGIN, END
    return ids, types, ids.masked_fill(types != 0, -100)


# --- the three cases: a model and a batch each --------------------------------------------------


def gemma3():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    vision = TOWER | dict(image_size=224, patch_size=14)  # 16 x 16 patches, pooled to 8 x 8
    config = Gemma3Config(text_config=TEXT | SLIDING, vision_config=vision, mm_tokens_per_image=MEDIA_TOKENS)
    config.image_token_id, config.boi_token_index, config.eoi_token_index = PLACEHOLDER, BEGIN, END
    return Gemma3ForConditionalGeneration(config)


def gemma3_batch(config, S, L, gen):
    """The images' pixels [images, 3, 224, 224] and the processor's token types."""
    ids, types, labels = placed(S, L, 1, gen)
    side = config.vision_config.image_size
    pixels = torch.randn(len(starts(S, L)), 3, side, side, generator=gen)
    return {"input_ids": ids, "token_type_ids": types, "pixel_values": pixels, "labels": labels}


def gemma4():
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = TEXT | SLIDING | dict(global_head_dim=128, hidden_size_per_layer_input=0)
    text |= dict(use_bidirectional_attention="vision")  # images see themselves (sliding layers)
    vision = TOWER | dict(num_key_value_heads=4, head_dim=32, patch_size=16, pooling_kernel_size=2)
    vision |= dict(position_embedding_size=16)  # (x, y) of 16 x 16 patches
    marks = dict(image_token_id=PLACEHOLDER, boi_token_id=BEGIN, eoi_token_id=END)
    return Gemma4ForConditionalGeneration(Gemma4Config(text_config=text, vision_config=vision, **marks))


def gemma4_batch(config, S, L, gen):
    """The images' patch rows [images, 256, 3 P P] in [0, 1] and their (x, y), the token types."""
    ids, types, labels = placed(S, L, 1, gen)
    images, P = len(starts(S, L)), config.vision_config.patch_size
    xs, ys = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="xy")
    where = torch.stack([xs, ys], dim=-1).reshape(-1, 2)  # [256, 2]
    pixels = torch.rand(images, len(where), 3 * P * P, generator=gen)  # [images, 256, 3 P P]
    batch = {"input_ids": ids, "mm_token_type_ids": types, "labels": labels}
    return batch | {"pixel_values": pixels, "image_position_ids": where.expand(images, -1, -1).clone()}


def qwen3_vl():
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    rope = dict(rope_type="default", rope_theta=5e5, mrope_section=[12, 10, 10])  # (t, h, w): head_dim / 2
    vision = dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=4, patch_size=16)
    vision |= dict(
        out_hidden_size=TEXT["hidden_size"], num_position_embeddings=256, deepstack_visual_indexes=[1]
    )
    marks = dict(video_token_id=PLACEHOLDER, vision_start_token_id=BEGIN, vision_end_token_id=END)
    config = Qwen3VLConfig(text_config=TEXT | dict(rope_parameters=rope), vision_config=vision, **marks)
    return Qwen3VLForConditionalGeneration(config)


def qwen3_vl_batch(config, S, L, gen):
    """One video, a frame (a temporal patch of 16 x 16 patches) an item between the vision start and
    end marks: its patch rows [frames * 256, 3 T P P], its (t, h, w) grid, the token types."""
    ids, types, labels = placed(S, L, 2, gen, marks=True)
    frames, vision = len(starts(S, L)), config.vision_config
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(frames * 16 * 16, width, generator=gen)  # [frames * 256, 3 T P P]
    batch = {"input_ids": ids, "mm_token_type_ids": types, "labels": labels}
    return batch | {"pixel_values_videos": pixels, "video_grid_thw": torch.tensor([[frames, 16, 16]])}


CASES = {
    "gemma3": (gemma3, gemma3_batch),
    "gemma4": (gemma4, gemma4_batch),
    "qwen3_vl": (qwen3_vl, qwen3_vl_batch),
}


LAUNCH = dict(timeout_s=1800, env=RANK_ENV)


def build(name):
    """The case's model, float32, train mode, checkpointed as under CP."""
    from torch_impl import hf

    torch.manual_seed(0)
    model = CASES[name][0]().train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=hf.checkpoint_kwargs())
    return model


def batch(name, config, S, L, text=False, seed=0):
    """The case's row of S tokens: its items every L / 8 tokens (starts), one across each multiple of
    L; `text`: the same token ids without the media (the placeholders text), for comparison."""
    made = CASES[name][1](config, S, L, torch.Generator().manual_seed(seed))
    return {key: made[key] for key in ("input_ids", "labels")} if text else made


def rank_figures(rank, world, name, L, reps, cp, layout, text):
    """On this rank: its peak resident-set rise (MiB) over `reps` steps and their median time (ms)."""
    import torch.distributed as dist

    from cp_support.memory import peak_mib, reset_peak
    from torch_impl import hf

    torch.set_num_threads(1)
    model = build(name)
    kwargs = batch(name, model.config, world * L if cp else L, L, text)
    if cp:
        hf.parallelize(model, dist.group.WORLD, layout=layout, verbose=False)
        kwargs = hf.shard_batch(kwargs, dist.group.WORLD, layout=layout)

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
    p.add_argument("--model", nargs="+", choices=list(CASES), default=list(CASES), help="one after another")
    p.add_argument("--n", type=int, default=2, help="CP ranks (gloo processes)")
    p.add_argument("--layout", choices=["contiguous", "head_tail"], default="head_tail")
    p.add_argument("--len", type=int, default=4096, help="tokens a rank (a multiple of 512)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument(
        "--text",
        nargs="*",
        choices=list(CASES),
        default=["qwen3_vl"],
        help="models also run on their rows without the media (variants 'alone, text', 'torch_impl, text')",
    )
    p.add_argument("--quick", action="store_true", help="512 tokens a rank, one step")
    p.add_argument("--json", default="out/media_memory.json")
    args = p.parse_args(argv)
    if args.quick:
        args.len, args.reps = 512, 1
    rows = []
    runs = [(name, text) for name in args.model for text in (False, True) if not text or name in args.text]
    for name, text in runs:
        for variant, world in (("alone", 1), ("torch_impl", args.n)):
            cp, variant = variant != "alone", variant + (", text" if text else "")
            figures = run_ranks(
                rank_figures, world, name, args.len, args.reps, cp, args.layout, text, **LAUNCH
            )
            for rank, f in enumerate(figures):
                row = {"model": name, "variant": variant, "rank": rank, "L": args.len}
                rows.append(row | {"every": spacing(args.len)} | f)
                print(rows[-1], flush=True)
    for name, text in runs:
        mine = [r for r in rows if r["model"] == name and r["variant"].endswith(", text") == text]
        alone = next(r for r in mine if r["variant"].startswith("alone"))
        worst = max((r for r in mine if r is not alone), key=lambda r: r["peak_mib"])
        peak, step = worst["peak_mib"] / alone["peak_mib"], worst["ms"] / alone["ms"]
        print(
            f"# {name}{', text' if text else ''}: the worst rank's peak {peak:.2f}x alone's, "
            f"its step {step:.2f}x"
        )
    results.write(args.json, args, rows)


if __name__ == "__main__":
    main()
