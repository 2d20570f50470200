"""The vision tower's cost under CP: one rank's encoding of a batch's images against one process's.

    python -m benchmarks.media_cost [--images 16] [--side 224] [--repeats 5] [--quick]

For n = 2, 4, 8, the last rank's encoding of its share of the images (torch_impl.hf.media.share:
contiguous, balanced by pixel rows) against one process encoding every image, run side by side,
alternating, in one thread each: the time ratio is the median over the repeats. The features'
all-gather is counted, not timed: a rank receives the feature rows (image tokens) of every other
rank's share, each the text model's width (bytes: rows x hidden size x the dtype's size).
The tower is Qwen2-VL's at a small width (depth 4, 128 wide), random weights, float32, no grad.
"""

import argparse
import statistics
import time

import torch

from cp_support import results

PATCH, MERGE = 14, 2


def build(args):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    vision = dict(depth=4, embed_dim=128, num_heads=4, hidden_size=64, mlp_ratio=2)
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
    text |= dict(
        num_key_value_heads=4,
        vocab_size=256,
        rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3]),
    )
    config = Qwen2VLConfig(vision_config=vision, text_config=text)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).eval()
    side = args.side // PATCH
    grid = torch.tensor([[1, side, side]] * args.images)
    width = 3 * 2 * PATCH * PATCH
    pixels = torch.randn(int(grid.prod(-1).sum()), width)
    return model.model, pixels, grid


def seconds(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=16)
    p.add_argument("--side", type=int, default=224, help="image side in pixels (multiple of 28)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="4 images of 56 pixels, 2 repeats")
    p.add_argument("--json", default="out/media_cost.json")
    args = p.parse_args(argv)
    if args.quick:
        args.images, args.side, args.repeats = 4, 56, 2
    from torch_impl.hf import media

    torch.set_num_threads(1)  # one core a rank, as on a GPU node each rank has its own device
    module, pixels, grid = build(args)
    patches = grid.prod(-1)  # [images]: pixel rows
    per_image = int(patches[0]) // MERGE**2  # feature rows (image tokens) an image
    rows = []
    with torch.no_grad():

        def whole():
            return module.get_image_features(pixels, grid, return_dict=True)

        whole()  # warm up
        for n in (2, 4, 8):
            lo, hi = media.share(patches.tolist(), n)[n - 1]  # the last rank's images
            start, stop = int(patches[:lo].sum()), int(patches[:hi].sum())

            def mine(a=start, b=stop, g=grid[lo:hi]):
                return module.get_image_features(pixels[a:b], g, return_dict=True)

            mine()
            pairs = [(seconds(mine), seconds(whole)) for _ in range(args.repeats)]
            rows.append(
                {
                    "n": n,
                    "images": hi - lo,
                    "time_ratio": statistics.median(a / b for a, b in pairs),
                    "received_rows": (args.images - (hi - lo)) * per_image,
                    "feature_rows": args.images * per_image,
                }
            )
            print(rows[-1], flush=True)
    results.write(args.json, args, rows)


if __name__ == "__main__":
    main()
