"""transformers' Trainer with context parallelism: `hf.ContextParallelMixin` on a sliding-window model.

    torchrun --standalone --nproc-per-node 2 -m examples.recipes.trainer

Gemma 3 (sliding window 8, which reaches across the two ranks' shards, and a global layer), padded
rows of 13 to 31 tokens, SGD, gradient accumulation 2. Each rank gets every row of its replica's
batch and runs its shard of each sequence; nothing else in the script changes. Prints each step's
`loss` and `grad_norm` and the `eval_loss`, then reloads the saved checkpoint as the plain model.
`--cp-size 1` runs the same script as a plain data-parallel Trainer (the tests compare the two:
parity_tests/trainer/test_trainer.py).
"""

import argparse
import gc
import os

import torch
import transformers as tf

from examples.recipes import trainer_data
from torch_impl import hf


class CPTrainer(hf.ContextParallelMixin, tf.Trainer):
    pass


def gemma3(dtype=torch.float32):
    torch.manual_seed(0)  # the same weights on every rank (or load the same checkpoint)
    config = tf.Gemma3TextConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
    )
    return tf.Gemma3ForCausalLM(config).to(dtype)


# both recipes' training: SGD (a constant gradient scale would show in its update; AdamW would hide one)
TRAINING = dict(
    optim="sgd",
    learning_rate=0.5,
    lr_scheduler_type="constant",
    per_device_train_batch_size=2,
    per_device_eval_batch_size=2,
    gradient_accumulation_steps=2,
    max_steps=3,
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    use_cpu=True,
    seed=0,
    disable_tqdm=True,
)


def training_args(output_dir, **overrides):
    """TRAINING, the Trainer recipe's rows kept whole (its collator reads them)."""
    return tf.TrainingArguments(output_dir, **TRAINING | {"remove_unused_columns": False} | overrides)


def report(trainer, result):
    """Rank 0 prints the logged steps and the evaluation."""
    if trainer.accelerator.is_main_process:
        for h in result["log"]:
            print(f"step {h['step']}: loss {h['loss']:.6f}, grad_norm {h['grad_norm']:.6f}")
        print(f"eval_loss {result['eval_loss']:.6f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)), help="1: no CP")
    p.add_argument("--layout", default="contiguous", choices=("contiguous", "head_tail"))
    p.add_argument("--output-dir", default="out/recipes/trainer")
    args = p.parse_args(argv)
    cp = {} if args.cp_size == 1 else {"cp_size": args.cp_size, "cp_layout": args.layout}
    trainer = (tf.Trainer if args.cp_size == 1 else CPTrainer)(
        model=gemma3(),
        args=training_args(args.output_dir, save_strategy="steps", save_steps=3),
        train_dataset=trainer_data.token_rows(24, 13, 31, seed=0),
        eval_dataset=trainer_data.token_rows(8, 13, 31, seed=1),
        data_collator=trainer_data.pad_rows,
        **cp,
    )
    trainer.train()
    result = {"log": [h for h in trainer.state.log_history if "loss" in h], **trainer.evaluate()}
    report(trainer, result)
    if trainer.accelerator.is_main_process:
        reloaded = tf.AutoModelForCausalLM.from_pretrained(f"{args.output_dir}/checkpoint-3")
        print(f"checkpoint-3 reloads as {type(reloaded).__name__} ({reloaded.config._attn_implementation})")
    return result


def finish():
    """End the process group (torchrun's): gloo work held in reference cycles freed first."""
    if torch.distributed.is_initialized():
        gc.collect()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    finish()
