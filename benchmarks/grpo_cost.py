"""What the training part of a GRPO step costs one CP rank: TRL's GRPOTrainer with
`hf.ContextParallelMixin` on rank 7 of 8 (torch's fake process group) against the plain
GRPOTrainer on the rank's own tokens.

    python -m benchmarks.grpo_cost [--lens 1024,4096] [--reps 3] [--json docs/results/grpo_cost.json]

The training part of a step: the trainer's `compute_loss` on two generated rows (a prompt of the
first 1/8, a completion of the rest, advantages +1 and -1), then backward: TRL's own default loss
(`dapo`) and every metric it logs on whole rows, the policy's rows sharded and its fused LM head's
per-token outputs gathered back over the row (torch_impl.hf.whole_rows). GRPOConfig's defaults
otherwise: `beta` 0 and one pass per generation, so no reference or old-policy forward.
Generation is not measured: it runs as one process on the whole rollout (the parallelized model
steps aside), so its memory is one process's, not bounded by CP. The model, the variants and what
is measured: benchmarks/dpo_cost.py's.
"""

import torch

from benchmarks import dpo_cost


def trainer(variant, L, out):
    """The GRPOTrainer (or the mixin's, cp 8 as rank 7 of the fake group) and a generated batch."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from examples.recipes import trainer_data
    from torch_impl import hf

    S = L if variant == "alone" else dpo_cost.N * L
    cp = dpo_cost.as_rank_7(variant)
    classes = (GRPOTrainer, type("CPGRPOTrainer", (hf.ContextParallelMixin, GRPOTrainer), {}))
    P = S // 8
    args = GRPOConfig(
        out, bf16=False, use_cpu=True, report_to=[], per_device_train_batch_size=2, num_generations=2,
        max_completion_length=S - P,
    )  # fmt: skip
    t = classes[variant != "alone"](
        model=dpo_cost.model(S), reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=args, train_dataset=Dataset.from_dict({"prompt": ["a b"] * 2}),
        processing_class=trainer_data.tokenizer(), **cp,
    )  # fmt: skip
    t.model.activation_checkpointing_enable(
        activation_checkpointing_kwargs=t.args.gradient_checkpointing_kwargs
    )
    t.model.train()
    t.current_gradient_accumulation_steps = 1  # set by train()
    ids = torch.randint(0, dpo_cost.VOCAB, (2, S), generator=torch.Generator().manual_seed(0))
    ones = torch.ones_like(ids)
    batch = {
        "prompt_ids": ids[:, :P], "prompt_mask": ones[:, :P],
        "completion_ids": ids[:, P:], "completion_mask": ones[:, P:],
        "advantages": torch.tensor([1.0, -1.0]), "num_items_in_batch": ones[:, P:].sum(),
    }  # fmt: skip
    return t, batch


def main(argv=None):
    return dpo_cost.main(argv, __doc__, "grpo_cost", trainer)


if __name__ == "__main__":
    main()
