"""TRL's GRPOTrainer with context parallelism: `hf.ContextParallelMixin`.

    torchrun --standalone --nproc-per-node 2 -m examples.recipes.grpo

Prompts of 3 to 6 words; Gemma 3 (sliding window 8 and a global layer) samples 4 completions of
up to 16 tokens for each, a Python function rewards each completion by the share of its words
that its prompt holds, and GRPO's loss (TRL's default, dapo) weighs each completion's tokens by
its advantage within its prompt's group. Every CP rank generates its replica's completions with
the model itself (as one process: generation is not sharded), the replica's ranks agree on CP
rank 0's, then score and train on their shards of the rows (torch_impl.hf.rl). Prints each
step's `loss`, `grad_norm` and mean reward, and the `eval_loss`. `--cp-size 1` runs the plain
GRPOTrainer (the tests compare the two: parity_tests/trainer/test_trainer.py).
"""

import argparse
import os

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from examples.recipes import trainer_data
from examples.recipes.trainer import TRAINING, finish, gemma3, report
from torch_impl import hf


class CPGRPOTrainer(hf.ContextParallelMixin, GRPOTrainer):
    pass


def on_topic(prompts, completions, **kwargs):
    """A reward: the share of a completion's words that its prompt holds."""
    rewards = []
    for prompt, completion in zip(prompts, completions, strict=True):
        words = completion.split()
        rewards.append(sum(word in prompt.split() for word in words) / len(words) if words else 0.0)
    return rewards


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)), help="1: no CP")
    p.add_argument("--layout", default="contiguous", choices=("contiguous", "head_tail"))
    p.add_argument("--output-dir", default="out/recipes/grpo")
    args = p.parse_args(argv)
    cp = {} if args.cp_size == 1 else {"cp_size": args.cp_size, "cp_layout": args.layout}
    config = GRPOConfig(
        args.output_dir,
        # GRPOConfig's default autocasts to bfloat16 where it can, the CPU included
        **TRAINING | {"bf16": False, "per_device_train_batch_size": 4, "per_device_eval_batch_size": 4},
        num_generations=4,
        max_completion_length=16,
    )
    trainer = (GRPOTrainer if args.cp_size == 1 else CPGRPOTrainer)(
        model=gemma3(),
        reward_funcs=on_topic,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": trainer_data.sentences(24, 3, 6, seed=0)}),
        eval_dataset=Dataset.from_dict({"prompt": trainer_data.sentences(4, 3, 6, seed=1)}),
        processing_class=trainer_data.tokenizer(),
        **cp,
    )
    trainer.train()
    result = {"log": [h for h in trainer.state.log_history if "loss" in h], **trainer.evaluate()}
    report(trainer, result)
    if trainer.accelerator.is_main_process:
        print("mean reward by step: " + ", ".join(f"{h['reward']:.6f}" for h in result["log"]))
    return result


if __name__ == "__main__":
    main()
    finish()
