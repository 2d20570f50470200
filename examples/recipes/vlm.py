"""TRL's SFTTrainer on images and text with context parallelism: `hf.ContextParallelMixin` on LLaVA.

    torchrun --standalone --nproc-per-node 2 -m examples.recipes.vlm

Rows of one or two images (16 x 16 pixels of noise, 4 placeholder tokens each) among 3 to 9
words, each followed by a completion of 2 to 12 words, the loss on the completions only. TRL's
vision collator (`DataCollatorForVisionLanguageModeling`) runs the processor on each batch: the
images become `pixel_values`, every `<image>` its 4 placeholders, each row's prompt and completion
joined and padded on the right. Under CP each rank gets the replica's whole batch, encodes about
1/n of its images and gathers the features (torch_impl.hf.media), and runs its shard of each row;
an image's placeholders may straddle the shards. The vision tower and the projector train with the language
model. Prints each step's `loss` and `grad_norm` and the `eval_loss`. `--cp-size 1` runs the plain
SFTTrainer (the tests compare the two).
"""

import argparse
import os

from datasets import Dataset
import numpy as np
from PIL import Image
import torch
import transformers as tf
from trl import SFTTrainer

from examples.recipes import sft, trainer_data
from examples.recipes.trainer import finish, report

IMAGE = "<image>"  # the processor's placeholder: 4 tokens an image (16 x 16 pixels, patches of 8)


def processor():
    """A LlavaProcessor built in memory: trainer_data's word-level tokenizer with IMAGE, and
    CLIP's image processor (PIL) resizing to 16 x 16 pixels. No download."""
    words = trainer_data.tokenizer()
    words.add_special_tokens({"additional_special_tokens": [IMAGE]})
    size = {"shortest_edge": 16}
    images = tf.CLIPImageProcessorPil(size=size, crop_size={"height": 16, "width": 16})
    return tf.LlavaProcessor(
        image_processor=images,
        tokenizer=words,
        patch_size=8,
        vision_feature_select_strategy="default",  # the CLS token dropped: (16 / 8)^2 tokens
        num_additional_image_tokens=1,
        image_token=IMAGE,
    )


def llava(dtype=torch.float32):
    """A tiny LLaVA: CLIP's tower (2 layers, width 32), a Llama of 2 layers, width 64."""
    torch.manual_seed(0)  # the same weights on every rank (or load the same checkpoint)
    vision = tf.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=16,
        patch_size=8,
    )
    text = tf.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    image = processor().tokenizer.convert_tokens_to_ids(IMAGE)
    config = tf.LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=image, vision_feature_layer=-1
    )
    return tf.LlavaForConditionalGeneration(config).to(dtype)


def rows(n, seed, placeholder=IMAGE):
    """n rows {"images", "prompt", "completion"}: one or two images of noise, each `placeholder`
    (the processor's text for an image) placed before a random word of the prompt or after its
    last."""
    gen = np.random.default_rng(seed)
    prompts = trainer_data.sentences(n, 3, 9, seed)
    completions = trainer_data.sentences(n, 2, 12, seed + 100)
    data = {"images": [], "prompt": [], "completion": [" " + c for c in completions]}
    for prompt in prompts:
        words = prompt.split()
        count = int(gen.integers(1, 3))
        for at in sorted(gen.integers(0, len(words) + 1, count), reverse=True):
            words.insert(int(at), placeholder)
        data["prompt"].append(" ".join(words))
        data["images"].append(
            [Image.fromarray(gen.integers(0, 256, (16, 16, 3), dtype=np.uint8)) for _ in range(count)]
        )
    return Dataset.from_dict(data)


def vlm_config(output_dir, **overrides):
    """The SFT recipe's training, rows unpacked (TRL packs no vision dataset)."""
    return sft.sft_config(output_dir, **{"packing": False, "max_length": None} | overrides)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)), help="1: no CP")
    p.add_argument("--output-dir", default="out/recipes/vlm")
    args = p.parse_args(argv)
    cp = {} if args.cp_size == 1 else {"cp_size": args.cp_size}
    trainer = (SFTTrainer if args.cp_size == 1 else sft.CPSFTTrainer)(
        model=llava(),
        args=vlm_config(args.output_dir),
        train_dataset=rows(24, seed=0),
        eval_dataset=rows(8, seed=1),
        processing_class=processor(),
        **cp,
    )
    trainer.train()
    result = {"log": [h for h in trainer.state.log_history if "loss" in h], **trainer.evaluate()}
    report(trainer, result)
    return result


if __name__ == "__main__":
    main()
    finish()
