"""TRL's DPOTrainer with context parallelism: `hf.ContextParallelMixin`.

    torchrun --standalone --nproc-per-node 2 -m examples.recipes.dpo

Preference pairs (a prompt of 3 to 6 words, a chosen and a rejected completion of 2 to 30) on
Gemma 3 (sliding window 8 and a global layer), against a frozen reference copy of the model: TRL's
sigmoid loss on each pair's log-prob margin. Each row's completion log-prob is summed over its CP
ranks' shards (`torch_impl.reductions.sum_sequence`: one value per row on the wire), so every CP
rank computes its replica's loss as one process would. Prints each step's `loss` and `grad_norm`,
the rewards' margin, and the `eval_loss`. `--cp-size 1` runs the plain DPOTrainer (the tests
compare the two: parity_tests/trainer/test_trainer.py).
"""

import argparse
import os

from datasets import Dataset
from trl import DPOConfig, DPOTrainer

from examples.recipes import trainer_data
from examples.recipes.trainer import TRAINING, finish, gemma3, report
from torch_impl import hf


class CPDPOTrainer(hf.ContextParallelMixin, DPOTrainer):
    pass


def preference_pairs(n, seed):
    """n prompts with a chosen and a rejected completion of random words."""
    prompts = trainer_data.sentences(n, 3, 6, seed)
    chosen, rejected = ([" " + c for c in trainer_data.sentences(n, 2, 30, seed + k)] for k in (100, 200))
    return Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)), help="1: no CP")
    p.add_argument("--layout", default="contiguous", choices=("contiguous", "head_tail"))
    p.add_argument("--output-dir", default="out/recipes/dpo")
    args = p.parse_args(argv)
    cp = {} if args.cp_size == 1 else {"cp_size": args.cp_size, "cp_layout": args.layout}
    trainer = (DPOTrainer if args.cp_size == 1 else CPDPOTrainer)(
        model=gemma3(),
        ref_model=gemma3(),  # the reference: the model's initial weights, frozen
        # DPOConfig's default autocasts to bfloat16 where it can, the CPU included
        args=DPOConfig(args.output_dir, **TRAINING | {"bf16": False, "dataset_num_proc": None}),
        train_dataset=preference_pairs(48, seed=0),
        eval_dataset=preference_pairs(8, seed=1),
        processing_class=trainer_data.tokenizer(),
        **cp,
    )
    trainer.train()
    result = {"log": [h for h in trainer.state.log_history if "loss" in h], **trainer.evaluate()}
    report(trainer, result)
    if trainer.accelerator.is_main_process:
        print(f"eval rewards/margins {result['eval_rewards/margins']:.6f}")
    return result


if __name__ == "__main__":
    main()
    finish()
