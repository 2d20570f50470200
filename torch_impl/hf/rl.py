"""TRL's GRPOTrainer and RLOOTrainer under CP, for `ContextParallelMixin`: generation as the
dp-only run does it, then TRL's own scoring and loss on whole rows (torch_impl.hf.whole_rows).

A replica's CP ranks stand for one process of the run over dp processes. So here:

- **Rows and seeds.** TRL sizes its generation batch by the processes (dp x cp) and seeds each
  process by its index; the mixin sizes it by the dp replicas (`replica_config`: the generation
  batch / cp) and seeds every CP rank of replica d as the dp-only run seeds its process d. The
  loader gives a replica's CP ranks the same prompts (`ContextParallelMixin._by_replica`).
- **Generation** runs on every CP rank with the model itself (its unsharded calls run as one
  process), as in the dp-only run (and as FSDP2 needs: every rank takes part in each forward).
  Then CP rank 0's completions and random states are broadcast over the CP group (`agree`), so
  the replica's ranks hold the same rows by construction, also where a GPU's kernels do not
  sample bit for bit alike, and draw the same numbers after (TRL's shuffle of the batch).
- **Rewards, advantages, scoring and the loss** are TRL's own code, run with the trainer's
  accelerator seen as the dp-only run's (`whole_rows.as_replicas`: its gathers over the dp
  replicas, one CP rank each, its process index and count the replica's) and the model's fused
  LM head calls with whole rows made CP (`whole_rows.hook`: the rows sharded, the per-token
  outputs gathered back over the row). TRL's module-level gathers (the rewards, the completions
  table) are cut to one CP rank per replica (`one_per_replica`, `as_replicas`).
- **RLOO** gathers each row's KL penalty with accelerate's module-level `gather` where it scores
  its completions, over every process; so its scoring is restated (`rloo_scored`, TRL 1.16's for
  text prompts) with that gather over the replicas. Its loss is TRL's own.

`refusal` names what is not made exact.
"""

from collections import defaultdict
import contextlib
import copy
import random

import numpy as np
import torch
import torch.distributed as dist

from torch_impl.hf import whole_rows


def refusal(args, trainer=None):
    """Why GRPOTrainer or RLOOTrainer with `args` (its config) and, once built, `trainer`'s own
    options is not exact under CP here; None where it is. Called with the config alone before
    TRL's `__init__` (which would fail first on a missing vLLM), then with the trainer."""
    if args.use_vllm:
        return "`use_vllm`: vLLM generates outside the model the mixin makes context-parallel (untested)"
    if args.use_transformers_continuous_batching:
        return "`use_transformers_continuous_batching`: its paged attention is not made CP here"
    if args.use_liger_kernel:
        return "`use_liger_kernel`: Liger's loss reads the model's hidden states, not its fused LM head"
    if trainer is None:
        return None
    if getattr(trainer, "rollout_func", None) is not None:
        return "`rollout_func`: its own rollouts (and their env_mask) are not made CP here"
    if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None) is not None:
        return "tools or environments: their tool masks are not made CP here"
    if trainer._is_vlm:
        return "a vision-language model: this trainer's images are not split across CP ranks"
    return whole_rows.prompt_learning(trainer.model)


def replica_config(args, cp_size):
    """A copy of a GRPOConfig or RLOOConfig whose generation batch counts the dp replicas' rows, as
    the run over dp processes has it for the same per-device batch and steps per generation (TRL's
    counts every process: dp x cp)."""
    args = copy.copy(args)
    args.generation_batch_size //= cp_size
    return args


# --- generation: the replica's ranks agree, and TRL's gathers see the replicas -----------------


def _random_states():
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_random_states(states):
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])


def agree(t, completion_ids):
    """CP rank 0's completions (lists of token ids) and random states, on every CP rank."""
    sent = [completion_ids, _random_states()]
    dist.broadcast_object_list(sent, src=dist.get_global_rank(t.cp_group, 0), group=t.cp_group)
    _set_random_states(sent[1])
    return sent[0]


def one_per_replica(t, gathered):
    """What a gather over every process returned ([processes * n, ...], by rank), one CP rank's
    part per replica: [dp * n, ...], as the gather over the dp-only run's processes."""
    if t.cp_size == 1:
        return gathered
    return gathered.unflatten(0, (dist.get_world_size(), -1))[:: t.cp_size].flatten(0, 1)


LOGGED_PER_PROCESS = ("prompt", "completion", "images")  # what TRL logs through gather_object


@contextlib.contextmanager
def as_replicas(t):
    """Run TRL's generation and scoring code as the dp-only run's: the accelerator seen over the
    replicas, and what TRL's gather_object adds to its completions table (a list per process, by
    rank) cut to one CP rank per replica."""
    logs = t._logs
    t._logs = {key: defaultdict(list) if isinstance(value, dict) else [] for key, value in logs.items()}
    try:
        with whole_rows.as_replicas(t):
            yield
    finally:
        added, t._logs = t._logs, logs
    processes = dist.get_world_size() if dist.is_initialized() else 1

    def cut(values):  # [processes * n] by rank -> one CP rank's n per replica
        n = len(values) // processes
        return [v for p in range(0, processes, t.cp_size) for v in values[p * n : (p + 1) * n]]

    for key in LOGGED_PER_PROCESS:
        logs[key].extend(cut(added[key]))
    for column, values in added["extra"].items():
        logs["extra"][column].extend(cut(values))
    for name, values in added["rewards"].items():  # from the rewards, already one per replica
        logs["rewards"][name].extend(values)
    logs["advantages"].extend(added["advantages"])


# --- RLOO: its scoring gathers each row's KL over every process, so it is restated -------------


def rloo_scored(t, inputs):
    """TRL 1.16's RLOOTrainer._generate_and_score_completions for text prompts (a vision-language
    model is refused), run under `as_replicas`: the rows scored whole through TRL's own
    `_get_per_token_logps_and_entropies` (the hooked fused LM head), each row's KL penalty gathered
    over the dp replicas where TRL gathers it over every process; all else as TRL computes it."""
    from accelerate.utils import gather_object
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.utils import nanstd, pad, use_adapter

    device = t.accelerator.device
    mode = "train" if t.model.training else "eval"
    prompts = [x["prompt"] for x in inputs]
    prompt_ids_list, completion_ids_list, completions = t._generate(prompts)

    def padded(rows, value, side):
        rows = [torch.tensor(row) for row in rows]
        multiple = t.pad_to_multiple_of
        return pad(rows, padding_value=value, padding_side=side, pad_to_multiple_of=multiple).to(device)

    pad_id = t._tokenizer.pad_token_id
    prompt_ids = padded(prompt_ids_list, pad_id, "left")
    prompt_mask = padded([[1] * len(ids) for ids in prompt_ids_list], 0, "left")
    completion_ids = padded(completion_ids_list, pad_id, "right")
    completion_mask = padded([[1] * len(ids) for ids in completion_ids_list], 0, "right")
    if t.mask_truncated_completions:
        eos_and_pad = [*t.eos_token_ids, pad_id]
        ended = torch.tensor([row[-1] in eos_and_pad for row in completion_ids_list], device=device)
        completion_mask = completion_mask * ended.unsqueeze(1).int()  # truncated rows masked out
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention = torch.cat([prompt_mask, completion_mask], dim=1)
    C = completion_ids.size(1)
    batch_size = t.args.per_device_train_batch_size if mode == "train" else t.args.per_device_eval_batch_size

    def scores(model):  # [B, C]: the completion tokens' log-probs
        return t._get_per_token_logps_and_entropies(model, ids, attention, C, batch_size)[0]

    with torch.no_grad(), disable_gradient_checkpointing(t.model, t.args.gradient_checkpointing_kwargs):
        old = scores(t.model)
        old_logps = (old * completion_mask).sum(1)  # [B]
        if t.beta != 0.0:
            if t.ref_model is not None:
                ref = scores(t.ref_model)
            else:  # PEFT: the adapter off (or the initial copy TRL loaded as "ref")
                model = t.accelerator.unwrap_model(t.model)
                with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
                    ref = scores(t.model)

    rewards_per_func = t._calculate_rewards(inputs, prompts, completions, completion_ids_list)
    num_generations = t.num_generations if mode == "train" else t.num_generations_eval
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * t.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    if t.reward_clip_range:
        rewards = rewards.clamp(min=t.reward_clip_range[0], max=t.reward_clip_range[1])
    if t.beta != 0.0:  # RLOO's KL penalty in the reward: a row's first-order log-ratio sum
        per_token_kl = old - ref
        kl = t.accelerator.gather((per_token_kl * completion_mask).sum(-1))  # over the replicas
        rewards = rewards - t.beta * kl

    grouped = rewards.view(-1, num_generations)
    std_rewards = nanstd(grouped, dim=1) if num_generations > 1 else torch.zeros_like(grouped[:, 0])
    scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    if num_generations > 1:  # the leave-one-out baseline over a group's scorable siblings
        baselines = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scorable - 1)
        advantages = rewards - baselines.view(-1)
    else:
        advantages = torch.zeros_like(rewards)
    if t.normalize_advantages:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + 1e-4)
    advantages = torch.nan_to_num(advantages, nan=0.0)
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
    index = t.accelerator.process_index  # the replica's
    all_advantages = advantages.clone()
    advantages = advantages[index * len(prompts) : (index + 1) * len(prompts)]

    metrics = t._metrics[mode]
    if t.beta != 0.0:  # TRL's reduce over every process: here over the replicas
        totals = torch.stack([(per_token_kl * completion_mask).sum(), completion_mask.sum().to(old.dtype)])
        totals = t.accelerator.gather(totals[None]).sum(0)
        metrics["kl"].append((totals[0] / totals[1].clamp(min=1.0)).item())
    for i, name in enumerate(t.reward_func_names):
        metrics[f"rewards/{name}/mean"].append(torch.nanmean(rewards_per_func[:, i]).item())
        metrics[f"rewards/{name}/std"].append(nanstd(rewards_per_func[:, i]).item())
    rewards = (rewards_per_func * t.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    metrics["reward"].append(torch.nanmean(rewards).item())
    metrics["reward_std"].append(nanstd(rewards).item())
    metrics["frac_reward_zero_std"].append(is_std_zero.float().mean().item())

    t._logs["prompt"].extend(gather_object(prompts))  # by rank: `as_replicas` keeps one per replica
    t._logs["completion"].extend(gather_object(completions))
    for i, name in enumerate(t.reward_func_names):
        t._logs["rewards"][name].extend(rewards_per_func[:, i].tolist())
    t._logs["advantages"].extend(all_advantages.tolist())
    for column in sorted(set(gather_object(list(t._pending_extra_logs)))):  # the reward functions'
        values = t._pending_extra_logs.get(column, [None] * len(prompts))
        t._logs["extra"][column].extend(gather_object(values))
    t._pending_extra_logs.clear()
    for name in sorted(set(gather_object(list(t._pending_metrics)))):
        values = t._pending_metrics.get(name, [])
        stats = torch.tensor([sum(values), len(values)], dtype=torch.float32, device=device)
        total, count = t.accelerator.gather(stats).view(-1, 2).sum(dim=0).tolist()
        metrics[name].append(total / count)
    t._pending_metrics.clear()
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "old_logps": old_logps,
        "advantages": advantages,
    }


SCORED = {"RLOOTrainer": rloo_scored}  # the trainers whose generation and scoring is restated here
