"""GRPO's and RLOO's scoring under ContextParallelMixin: TRL's own methods, their module-level
gathers (the rewards, RLOO's each row's KL penalty, the completions table) rebound to the gathers
over the dp replicas (torch_impl.hf.rl.rebound), equal TRL's unchanged methods in one process
(cp_size 1), for each option RLOO reads: the same completions, old log-probs, advantages, loss,
gradient and every metric. GRPO's and RLOO's losses are TRL's own (torch_impl.hf.whole_rows); the
trainers over CP ranks against the runs without CP: test_trainer.py. What is not exact is refused
in `__init__`.

The bound: TRL's fused LM head computes each token's log-prob in float32 in both paths; a float32
sum over a row's completion (at most 12 tokens) or a batch's (at most 48) rounds in another order:
every value within 64 u32 of the largest magnitude it is built from.
"""

import inspect
import re
import types

import accelerate.utils
import pytest
import torch
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from parity_tests.harness import bounds
from parity_tests.trainer import trainer_jobs
from torch_impl import hf
from torch_impl.hf.trainer_checks import rollout_config

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


@pytest.mark.parametrize("config", [GRPOConfig, RLOOConfig])
@pytest.mark.parametrize(
    "options,says",
    [  # TRL's defaults (num_generations 8) with 4 rows a device: 8 rows over 2 processes, 4 a replica
        (
            {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1},
            "generation batch of 4 rows (per_device_train_batch_size 4 x 1 replica(s) x "
            "steps_per_generation 1) must be divisible by num_generations (8)",
        ),
        (  # training splits (8 rows a replica); an evaluation batch of 4 rows a replica does not
            {"per_device_train_batch_size": 8, "per_device_eval_batch_size": 4, "eval_strategy": "steps"},
            "evaluation batch of 4 rows (per_device_eval_batch_size 4 x 1 replica(s)) must be divisible "
            "by the evaluation's num_generations (8)",
        ),
    ],
)
def test_batches_that_do_not_split_over_the_replicas_are_refused(tmp_path, config, options, says):
    """A config that TRL's own checks pass over 2 processes but not over its 1 replica at cp 2 (the
    dp-only run's process would hold half a prompt's group: a ZeroDivisionError in `train()`, a
    `view` error at the first evaluation) is refused before TRL's `__init__`, naming cp_size, the
    batch and num_generations; at cp 1 (2 replicas) it passes."""
    over_two = type("OverTwo", (config,), {"world_size": property(lambda self: 2)})
    args = over_two(str(tmp_path), use_cpu=True, report_to=[], num_generations=8, **options)
    name = f"{config.__name__.removesuffix('Config')}Trainer"
    with pytest.raises(ValueError, match=rf"TRL's {name} with cp_size=2 over 2 processes leaves 1 data"):
        rollout_config(name, 2, (), {"args": args})
    with pytest.raises(ValueError, match=re.escape(says)):
        rollout_config(name, 2, (), {"args": args})
    kept = rollout_config(name, 1, (), {"args": args})[1]["args"]
    assert kept.generation_batch_size == args.generation_batch_size


def test_the_replicas_gathers_keep_one_cp_rank_per_replica(monkeypatch):
    """rl.replica_gathers over 4 processes at cp 2: `gather_object` (TRL's completions table: a list
    per process, by rank) keeps CP rank 0's list of each replica, as accelerate's over the dp-only
    run's 2 processes; `gather` is the mixin's gather over the replicas."""
    from torch_impl.hf import rl

    lists = [["a", "b"], ["a", "b"], ["c", "d"], ["c", "d"]]  # by rank: replica 0, then replica 1

    def all_gather_object(every, obj):
        every[:] = lists

    monkeypatch.setattr(rl.dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(rl.dist, "all_gather_object", all_gather_object)
    gathered = []
    t = types.SimpleNamespace(cp_size=2, _gather_replicas=lambda x, cut: gathered.append((x, cut)) or x)
    gathers = rl.replica_gathers(t)
    assert gathers["gather_object"](["a", "b"]) == ["a", "b", "c", "d"]
    assert gathers["gather"]("rewards") == "rewards" and gathered == [("rewards", False)]


def test_trls_scoring_is_rebound_not_restated():
    """The mixin's GRPO and RLOO methods that gather are TRL's own code objects, run with the
    replicas' gathers; one that loads a collective the table does not rebind is refused."""
    from torch_impl.hf import rl

    def mixed(trainer):  # an instance of the mixin over `trainer`, not set up (rebound reads its class)
        t = object.__new__(type("CP", (hf.ContextParallelMixin, trainer), {}))
        t.cp_size, t._gather_replicas = 2, lambda x, cut: x
        return t

    for trainer in (GRPOTrainer, RLOOTrainer):
        for name, method in rl.rebound(mixed(trainer), trainer).items():
            inner = inspect.unwrap(method.__func__)
            assert inner.__code__ is inspect.unwrap(getattr(trainer, name)).__code__, name
            for key in rl.REBOUND[trainer.__name__][name]:
                assert inner.__globals__[key] is not getattr(accelerate.utils, key), (name, key)
    Changed = type(
        "RLOOTrainer", (RLOOTrainer,), {"_calculate_rewards": GRPOTrainer._generate_and_score_completions}
    )
    with pytest.raises(
        ValueError, match=r"RLOOTrainer._calculate_rewards calls accelerate's \['gather_object'\]"
    ):
        rl.rebound(mixed(Changed), Changed)
    Renamed = type("RLOOTrainer", (RLOOTrainer,), {"_calculate_rewards": GRPOTrainer._generate})  # no gather
    with pytest.raises(
        ValueError, match=r"RLOOTrainer._calculate_rewards cannot run .* loads no global \['gather'\]"
    ):
        rl.rebound(mixed(Renamed), Renamed)
