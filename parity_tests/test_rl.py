"""TRL's GRPO loss as ContextParallelMixin computes it (torch_impl.hf.rl: per-token values of a
rank's own tokens, each row's sums through `sum_sequence`, TRL's formulas restated) equals TRL's
own `_compute_loss` in one process (cp_size 1), for every loss type, both importance-sampling
levels and the options the mixin accepts: the loss, its gradient and every metric logged. RLOO's
restated scoring and loss likewise against TRL's `_generate_and_score_completions` and
`_compute_loss`, for each option they read. The trainers over CP ranks against the runs without
CP: test_trainer.py. What is not exact is refused in `__init__`.

The batch: completions TRL's generation sampled, with old-policy and reference log-probs moved
off the policy's (so that ratios clip and the KL is not zero). The bound: TRL's fused LM head
computes each token's log-prob in float32 in both paths, from a float64 model whose norms
transformers rounds through float32; a float32 sum over a row's completion (at most 12 tokens)
or a batch's (at most 48) rounds in another order: every value within 64 u32 of the largest
magnitude it is built from.
"""

import types

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from parity_tests import bounds, trainer_jobs
from torch_impl import hf
from torch_impl.hf.rl import LOSS_TYPES, scores

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


def _batch(t):
    """A generated batch in the mixin's layout (per-token values at each token's own position, the
    one before the token it scores) and in TRL's ([B, C] over the completion), the old-policy and
    reference log-probs moved off the policy's by seeded noise."""
    t.model.train()
    t.current_gradient_accumulation_steps = t.args.gradient_accumulation_steps  # set by train()
    mine = t._prepare_inputs(next(iter(t.get_train_dataloader())))
    P, C = mine["prompt_ids"].size(1), mine["completion_ids"].size(1)
    generator = torch.Generator().manual_seed(0)
    ids = torch.cat([mine["prompt_ids"], mine["completion_ids"]], dim=1)
    attention = torch.cat([mine["prompt_mask"], mine["completion_mask"]], dim=1)
    with torch.no_grad():
        policy, _ = scores(t, t.model, ids, attention, C)
    for key in ("old_per_token_logps", "ref_per_token_logps"):
        mine[key] = policy + 0.3 * torch.randn(policy.shape, generator=generator, dtype=policy.dtype)
    theirs = dict(mine)
    for key in ("old_per_token_logps", "ref_per_token_logps"):
        theirs[key] = mine[key][:, P - 1 : P - 1 + C]
    return mine, theirs


def _both(t, mine, theirs):
    """(loss, grads, metrics) from TRL's own _compute_loss (with TRL's scoring) and the mixin's."""
    results = []
    trl_scores = types.MethodType(GRPOTrainer._get_per_token_logps_and_entropies, t)
    for batch, scoring in ((theirs, trl_scores), (mine, None)):
        if scoring is not None:
            t._get_per_token_logps_and_entropies = scoring
        try:
            t.model.zero_grad()
            t._metrics["train"].clear()
            t._entropy_window_stats, t._last_world_entropy = None, float("inf")
            coef = t.entropy_coef
            loss = (GRPOTrainer._compute_loss if scoring else type(t).compute_loss)(t, t.model, batch)
            t.entropy_coef = coef  # the adaptive controller's step, taken once per side
            loss.backward()
        finally:
            t.__dict__.pop("_get_per_token_logps_and_entropies", None)
        grads = {k: p.grad.clone() for k, p in t.model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads, {k: list(v) for k, v in t._metrics["train"].items()}))
    return results


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


VARIANTS = (
    [{"loss_type": kind} for kind in LOSS_TYPES]
    + [{"loss_type": kind, "importance_sampling_level": "sequence"} for kind in LOSS_TYPES]
    + [
        {"loss_type": "grpo", "beta": 0.0},
        {"loss_type": "dapo", "use_bias_correction_kl": True, "delta": 1.2},
        {"loss_type": "dapo", "off_policy_mask_threshold": 0.05},
        {"loss_type": "grpo", "top_entropy_quantile": 0.5},
        {"loss_type": "bnpo", "entropy_coef": 0.01},
        {"loss_type": "dapo", "use_adaptive_entropy": True, "top_entropy_quantile": 0.5},
    ]
)
ARGS = ("use_bias_correction_kl", "delta")  # read from t.args; the rest from the trainer's own


def test_grpo_loss_is_trls_for_every_loss_type(tmp_path):
    t = _trainer(tmp_path, epsilon=0.1)  # with the noise above, ratios clip on both sides
    mine, theirs = _batch(t)
    defaults = {
        "loss_type": "dapo", "importance_sampling_level": "token", "beta": 0.04,
        "off_policy_mask_threshold": None, "top_entropy_quantile": 1.0, "entropy_coef": 0.0,
        "use_adaptive_entropy": False, "use_bias_correction_kl": False, "delta": None,
    }  # fmt: skip
    for variant in VARIANTS:
        for key, value in (defaults | variant).items():
            setattr(t.args if key in ARGS else t, key, value)
        t._entropy_bonus_enabled = t.entropy_coef != 0.0 or t.use_adaptive_entropy
        want, got = _both(t, mine, theirs)
        _check(got, want, str(variant))


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
    trl_scores = types.MethodType(RLOOTrainer._get_per_token_logps_and_entropies, t)
    defaults = {"beta": 0.05, "mask_truncated_completions": False, "reward_clip_range": None}
    for variant in RLOO_VARIANTS:
        for key, value in (defaults | {"normalize_advantages": False} | variant).items():
            setattr(t, key, value)
        sides = []
        for theirs in (True, False):
            if theirs:
                t._get_per_token_logps_and_entropies = trl_scores
            try:
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
                loss = (RLOOTrainer._compute_loss if theirs else type(t).compute_loss)(t, t.model, batch)
                loss.backward()
            finally:
                t.__dict__.pop("_get_per_token_logps_and_entropies", None)
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
