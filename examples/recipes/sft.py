"""TRL's SFTTrainer with context parallelism and packing: `hf.ContextParallelMixin`.

    torchrun --standalone --nproc-per-node 2 -m examples.recipes.sft

Prompt-completion pairs packed (`packing=True`: best-fit decreasing, padding-free, position_ids
restarting at every document) into rows of up to 48 tokens, the loss on the completions only, on
Gemma 3 (sliding window 8 and a global layer). TRL refuses packing under accelerate's CP
(documents would attend across their boundaries); here each packed document attends only within
itself on every rank, as in one process. Prints each step's `loss` and `grad_norm` and the
`eval_loss`. `--cp-size 1` runs the plain SFTTrainer (the tests compare the two).
"""

import argparse
import os

from datasets import Dataset
from trl import SFTConfig, SFTTrainer

from examples.recipes import trainer_data
from examples.recipes.trainer import TRAINING, finish, gemma3, report
from torch_impl import hf


class CPSFTTrainer(hf.ContextParallelMixin, SFTTrainer):
    pass


def pairs(n, seed):
    """n prompt-completion pairs of random words."""
    prompts = trainer_data.sentences(n, 3, 9, seed)
    completions = trainer_data.sentences(n, 2, 12, seed + 100)
    return Dataset.from_dict({"prompt": prompts, "completion": [" " + c for c in completions]})


def sft_config(output_dir, **overrides):
    """The Trainer recipe's TRAINING, packed into rows of up to 48 tokens."""
    args = dict(
        packing=True,
        max_length=48,
        dataset_num_proc=None,
        bf16=False,  # SFTConfig's default autocasts to bfloat16 where it can, the CPU included
    )
    return SFTConfig(output_dir, **TRAINING | args | overrides)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)), help="1: no CP")
    p.add_argument("--output-dir", default="out/recipes/sft")
    args = p.parse_args(argv)
    cp = {} if args.cp_size == 1 else {"cp_size": args.cp_size}
    trainer = (SFTTrainer if args.cp_size == 1 else CPSFTTrainer)(
        model=gemma3(),
        args=sft_config(args.output_dir),
        train_dataset=pairs(64, seed=0),
        eval_dataset=pairs(16, seed=1),
        processing_class=trainer_data.tokenizer(),
        **cp,
    )
    trainer.train()
    result = {"log": [h for h in trainer.state.log_history if "loss" in h], **trainer.evaluate()}
    report(trainer, result)
    return result


if __name__ == "__main__":
    main()
    finish()
