"""RLOO's scoring as ContextParallelMixin restates it (torch_impl.hf.rl.rloo_scored: TRL 1.16's,
its module-level gather of each row's KL penalty over the dp replicas) equals TRL's own
`_generate_and_score_completions` in one process (cp_size 1), for each option it reads: the same
completions, old log-probs, advantages, loss, gradient and every metric. GRPO's and RLOO's losses
are TRL's own (torch_impl.hf.whole_rows); the trainers over CP ranks against the runs without CP:
test_trainer.py. What is not exact is refused in `__init__`.

The bound: TRL's fused LM head computes each token's log-prob in float32 in both paths; a float32
sum over a row's completion (at most 12 tokens) or a batch's (at most 48) rounds in another order:
every value within 64 u32 of the largest magnitude it is built from.
"""

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from parity_tests.harness import bounds
from parity_tests.trainer import trainer_jobs
from torch_impl import hf

U32 = bounds.u(torch.float32)
R = 64 * U32


def _trainer(tmp_path, **overrides):
    args = GRPOConfig(str(tmp_path), **trainer_jobs.GRPO_TRAINING | {"beta": 0.04} | overrides)
    cp = type("CP", (hf.ContextParallelMixin, GRPOTrainer), {})
    return cp(
        model=trainer_jobs.saved_as_reference(
            trainer_jobs.hf_models.build("llama"), str(tmp_path / "initial")
        ),
        reward_funcs=trainer_jobs.even_tokens,
        args=args,
        processing_class=trainer_jobs.trainer_data.tokenizer(),
        train_dataset=trainer_jobs.prompt_rows(16, 0),
        cp_size=1,
    )


@pytest.mark.parametrize(
    "option,says",
    [
        ({"use_vllm": True}, "`use_vllm`"),  # before TRL's own check that vLLM is installed
        ({"use_liger_kernel": True}, "`use_liger_kernel`"),
        ({"use_transformers_continuous_batching": True}, "`use_transformers_continuous_batching`"),
    ],
)
def test_what_is_not_exact_is_refused_in_init(tmp_path, option, says):
    with pytest.raises(ValueError, match=f"TRL's GRPOTrainer with {says}"):
        _trainer(tmp_path, **option)


def _check(got, want, what):
    (loss, grads, metrics), (want_loss, want_grads, want_metrics) = got, want
    bounds.check(abs(loss - want_loss), R * max(abs(want_loss), 1.0), f"{what} loss")
    assert grads.keys() == want_grads.keys(), what
    scale = max(g.abs().max() for g in want_grads.values())
    for key, g in want_grads.items():
        bounds.check((grads[key] - g).abs().max(), R * scale, f"{what} grad {key}")
    assert metrics.keys() == want_metrics.keys(), (what, metrics.keys() ^ want_metrics.keys())
    for key, values in want_metrics.items():
        for g, w in zip(metrics[key], values, strict=True):
            bounds.check(abs(g - w), R * max(abs(w), 1.0), f"{what} {key}")


def _rloo(tmp_path):
    """RLOO at cp 1 with its default KL penalty (beta 0.05) to a reference of other weights."""
    args = RLOOConfig(str(tmp_path), **trainer_jobs.GRPO_TRAINING)
    cp = type("CP", (hf.ContextParallelMixin, RLOOTrainer), {})
    path = str(tmp_path / "reference")
    trainer_jobs.saved_as_reference(trainer_jobs.hf_models.build("llama", seed=1), path)
    policy = trainer_jobs.hf_models.build("llama")
    policy.config._name_or_path = path  # TRL loads the reference from the policy's path
    return cp(
        model=policy,
        reward_funcs=trainer_jobs.even_tokens,
        args=args,
        processing_class=trainer_jobs.trainer_data.tokenizer(),
        train_dataset=trainer_jobs.prompt_rows(16, 0),
        cp_size=1,
    )


RLOO_VARIANTS = (
    {},
    {"beta": 0.0},
    {"mask_truncated_completions": True},
    {"reward_clip_range": (0.45, 0.6)},
    {"normalize_advantages": True},
)


def test_rloo_scoring_and_loss_are_trls(tmp_path):
    """The same prompts, sampled from the same seed on both sides: the same completions; the old
    log-probs, advantages, loss (old log-probs moved by seeded noise, so that ratios clip), its
    gradient and every metric within the bound above."""
    t = _rloo(tmp_path)
    t.model.train()
    t.current_gradient_accumulation_steps = t.args.gradient_accumulation_steps  # set by train()
    prompts = next(iter(t.get_train_dataloader()))
    defaults = {"beta": 0.05, "mask_truncated_completions": False, "reward_clip_range": None}
    for variant in RLOO_VARIANTS:
        for key, value in (defaults | {"normalize_advantages": False} | variant).items():
            setattr(t, key, value)
        sides = []
        for theirs in (True, False):
            torch.manual_seed(0)
            t.state.num_input_tokens_seen = 0
            t._metrics["train"].clear()
            score = (
                RLOOTrainer._generate_and_score_completions
                if theirs
                else type(t)._generate_and_score_completions
            )
            batch = score(t, prompts)
            generator = torch.Generator().manual_seed(1)
            noise = 0.3 * torch.randn(batch["old_logps"].shape, generator=generator)
            batch["old_logps"] = batch["old_logps"] + noise.to(batch["old_logps"].dtype)
            t.model.zero_grad()
            loss = type(t).compute_loss(t, t.model, batch)
            loss.backward()
            grads = {k: p.grad.clone() for k, p in t.model.named_parameters() if p.grad is not None}
            sides.append(
                (batch, (loss.detach(), grads, {k: list(v) for k, v in t._metrics["train"].items()}))
            )
        (want_batch, want), (got_batch, got) = sides
        for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"):
            assert torch.equal(got_batch[key], want_batch[key]), (variant, key)
        for key in ("old_logps", "advantages"):
            scale = want_batch[key].abs().max().clamp(min=1.0)
            bounds.check((got_batch[key] - want_batch[key]).abs().max(), R * scale, f"{variant} {key}")
        _check(got, want, f"RLOO {variant}")


@pytest.mark.parametrize(
    "option,says",
    [
        ({"use_vllm": True}, "`use_vllm`"),
        ({"use_liger_kernel": True}, "`use_liger_kernel`"),
    ],
)
def test_what_rloo_cannot_make_exact_is_refused_in_init(tmp_path, option, says):
    cp = type("CP", (hf.ContextParallelMixin, RLOOTrainer), {})
    with pytest.raises(ValueError, match=f"TRL's RLOOTrainer with {says}"):
        cp(
            model=trainer_jobs.hf_models.build("llama"),
            reward_funcs=trainer_jobs.even_tokens,
            args=RLOOConfig(str(tmp_path), **trainer_jobs.GRPO_TRAINING | option),
            processing_class=trainer_jobs.trainer_data.tokenizer(),
            train_dataset=trainer_jobs.prompt_rows(16, 0),
            cp_size=1,
        )
