"""TRL's GRPOTrainer and RLOOTrainer under CP, for `ContextParallelMixin`: generation as the
dp-only run does it, then scoring and training on the sharded rows.

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
- **Rewards, advantages and the metrics of generation** are TRL's own code, run with the trainer's
  accelerator seen as the dp-only run's (`ReplicaView`: its gathers over the dp replicas, one CP
  rank each, its process index and count the replica's); TRL's module-level gathers (the rewards,
  the completions table) are cut to one CP rank per replica (`one_per_replica`).
- **Scoring** (old-policy and reference log-probs) and the **training forward** run on this rank's
  shard of the rows (prompt + completion, padded as the layout needs) through TRL's fused LM
  head (`scores`): per-token values of this rank's tokens only, kept as they are.
- **The loss** (`grpo_loss`) restates TRL 1.16's `_compute_loss` for every loss type: a row's
  sums over its completion (its loss, a sequence-level ratio, VESPO's log-weight, the off-policy
  KL) are `sum_sequence` (one all-reduce of values per row); completion lengths come from the
  global mask every rank holds; so each CP rank computes its replica's loss, and `sum_sequence`'s
  backward, summing the CP ranks' gradients, and DDP's average over dp x cp give the dp-only
  gradient. Token means in the metrics are each rank's partial sums reduced over every process
  (the ranks hold disjoint tokens); per-row values are gathered over the replicas.
- **RLOO** sums each row's log-probs and KL inline where it scores its completions, so its
  scoring is restated (`rloo_scored`, TRL 1.16's for text prompts) with those sums
  `sum_sequence`'s, and its loss (`rloo_loss`: a row's ratio to the old policy) likewise.

`refusal` names what is not made exact.
"""

from collections import defaultdict
import contextlib
import copy
import random

import numpy as np
import torch
import torch.distributed as dist

from torch_impl.hf.inputs import IGNORE_INDEX
from torch_impl.reductions import sum_sequence

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")


def refusal(args, trainer=None):
    """Why GRPOTrainer or RLOOTrainer with `args` (its config) and, once built, `trainer`'s own
    options is not exact under CP here; None where it is. Called with the config alone before
    TRL's `__init__` (which would fail first on a missing vLLM), then with the trainer."""
    if args.use_vllm:
        return "`use_vllm`: vLLM generates outside the model the mixin makes context-parallel (untested)"
    if args.use_transformers_continuous_batching:
        return "`use_transformers_continuous_batching`: its paged attention is not made CP here"
    if args.use_liger_kernel:
        return "`use_liger_kernel`: Liger replaces the model's kernels, which CP hooks"
    if getattr(args, "loss_type", LOSS_TYPES[0]) not in LOSS_TYPES:  # GRPO's
        return f"`loss_type` {args.loss_type!r}: not among {list(LOSS_TYPES)}"
    if trainer is None:
        return None
    if getattr(trainer, "rollout_func", None) is not None:
        return "`rollout_func`: its own rollouts (and their env_mask) are not made CP here"
    if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None) is not None:
        return "tools or environments: their tool masks are not made CP here"
    if trainer._is_vlm:
        return "a vision-language model: images are not split across CP ranks"
    return None


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


class ReplicaView:
    """The trainer's accelerator as the dp-only run's process for this replica sees it: its
    gather over the dp replicas (one CP rank each), its process index and count the replica's;
    all else the accelerator's own (`world`)."""

    def __init__(self, t):
        self.world, self._t = t.accelerator, t

    def __getattr__(self, name):
        return getattr(self.world, name)

    @property
    def process_index(self):
        return self._t.dp_index

    @property
    def num_processes(self):
        return self._t.dp_size

    def gather(self, tensor):
        return one_per_replica(self._t, self.world.gather(tensor))


LOGGED_PER_PROCESS = ("prompt", "completion", "images")  # what TRL logs through gather_object


@contextlib.contextmanager
def as_replicas(t):
    """Run TRL's generation and scoring code as the dp-only run's: the accelerator seen over the
    replicas, and what TRL's gather_object adds to its completions table (a list per process, by
    rank) cut to one CP rank per replica."""
    logs, view = t._logs, ReplicaView(t)
    t._logs = {key: defaultdict(list) if isinstance(value, dict) else [] for key, value in logs.items()}
    t.accelerator = view
    try:
        yield
    finally:
        t.accelerator, added, t._logs = view.world, t._logs, logs
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


# --- scoring and the loss on this rank's shard -------------------------------------------------


def scores(t, model, input_ids, attention_mask, logits_to_keep, batch_size=None, entropy=False):
    """TRL's fused LM head on this rank's shard of [B, S] rows whose last `logits_to_keep` tokens
    are the completion (t.shard: padded for the layout and sharded), in chunks of `batch_size`
    rows: (log-probs [B, L] of this rank's tokens' next tokens, their entropies or None). A token
    counts where its next token is a completion token (`counted`)."""
    batch_size = batch_size or input_ids.size(0)
    logps, entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        rows = slice(start, start + batch_size)
        local = t.shard(_scored(input_ids[rows], attention_mask[rows], logits_to_keep))
        with t.accelerator.autocast():
            outputs = model(**local, fused_lm_head=True)
        logps.append(outputs.log_probs)
        entropies.append(outputs.entropy)
    return torch.cat(logps), torch.cat(entropies) if entropy else None


def _scored(input_ids, attention_mask, logits_to_keep):
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    labels[:, :-logits_to_keep] = IGNORE_INDEX
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def counted(t, input_ids, attention_mask, logits_to_keep):
    """bool [B, L]: this rank's tokens whose next token is a completion token (TRL's mask)."""
    return t.shard(_scored(input_ids, attention_mask, logits_to_keep))["shift_labels"] != IGNORE_INDEX


def _token_mean(t, x, where):
    """TRL's global_masked_mean: over every counted token of the dp-only run's processes (here
    each rank's own, reduced over every process: the ranks hold disjoint tokens), or for values
    per row [B, 1], over the replicas' rows."""
    if x.shape[1] == 1:
        local = torch.stack([x.sum(), x.new_tensor(x.shape[0])]).detach()
        totals = t._gather_replicas(local[None], cut=False).sum(0)
    else:
        totals = torch.stack([torch.where(where, x, 0).sum(), where.sum().to(x.dtype)]).detach()
        if dist.is_initialized():
            dist.all_reduce(totals)
    return (totals[0] / totals[1].clamp(min=1.0)).item()


def grpo_loss(t, model, inputs):
    """TRL's GRPOTrainer loss and metrics on this rank's shard of the rows (every CP rank: its
    replica's loss)."""
    mode = "train" if t.model.training else "eval"
    prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
    completion_mask = inputs["completion_mask"]
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
    C = completion_ids.size(1)
    per_token_logps, entropies = scores(t, model, ids, attention, C, entropy=True)
    mask = counted(t, ids, attention, C)  # [B, L], this rank's completion tokens

    def rows(x):  # each row's sum over its completion: [B], every CP rank
        return sum_sequence(x.expand_as(per_token_logps), t.cp_group, mask)

    lengths = completion_mask.sum(-1).to(per_token_logps.dtype)  # [B], from the global mask
    entropy_mask = None
    if t.top_entropy_quantile < 1.0:  # TRL's quantile over every process's tokens: all of them here
        entropy_mask = t.get_high_entropy_mask(entropies, mask, 1 - t.top_entropy_quantile)

    advantages = inputs["advantages"]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old = inputs.get("old_per_token_logps")
    old = per_token_logps.detach() if old is None else old
    if t.off_policy_mask_threshold is not None:  # DeepSeek-V3.2's: a row's mean KL to the sampler
        with torch.no_grad():
            kl = torch.nan_to_num(old - per_token_logps.detach(), nan=0.0)
            mean_kl = (rows(kl) / lengths.clamp(min=1.0)).unsqueeze(1)
        off_policy_mask = ((advantages >= 0) | (mean_kl <= t.off_policy_mask_threshold)).to(old.dtype)

    log_ratio = per_token_logps - old
    if t.importance_sampling_level == "token":
        log_weights = log_ratio
    else:  # a row's mean log-ratio over its completion, summed over the CP ranks
        log_weights = (rows(log_ratio) / lengths.clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_weights)
    if t.beta != 0.0:
        ref = inputs["ref_per_token_logps"]
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        if t.args.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1

    if t.loss_type == "cispo":
        per_token_loss = -torch.clamp(coef_1, max=t.epsilon_high).detach() * advantages * per_token_logps
    elif t.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        coef_2 = torch.clamp(coef_1, 1 - t.epsilon_low, 1 + t.epsilon_high)
        if t.args.delta is not None:
            coef_1 = torch.clamp(coef_1, max=t.args.delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    elif t.loss_type == "sapo":
        temperatures = torch.where(advantages > 0, t.args.sapo_temperature_pos, t.args.sapo_temperature_neg)
        per_token_loss = -torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * advantages
    else:  # vespo: TRL's gamma weights of a row's summed (per token clamped) log-ratio
        with torch.no_grad():
            summed = rows(torch.clamp(log_ratio, -20.0, 20.0)).unsqueeze(1)  # [B, 1]
        args = t.args
        phi_seq = t.get_gamma_weights(
            advantages, summed, torch.ones_like(summed), None,
            args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg, args.vespo_lambda_neg,
        )  # fmt: skip
        per_token_loss = -phi_seq * advantages * per_token_logps
    if t.off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * off_policy_mask
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if t.beta != 0.0:
        per_token_loss = per_token_loss + t.beta * per_token_kl

    accumulation = t.current_gradient_accumulation_steps if mode == "train" else 1.0
    row_losses = rows(per_token_loss)
    if t.loss_type in ("grpo", "sapo"):
        loss = (row_losses / lengths.clamp(min=1.0)).mean()
    elif t.loss_type == "bnpo":
        loss = row_losses.sum() / lengths.sum().clamp(min=1.0)
    elif t.loss_type == "dr_grpo":
        loss = row_losses.sum() / (row_losses.size(0) * t.max_completion_length)
    elif t.loss_type == "luspo":
        loss = row_losses.mean()
    if t.loss_type in ("cispo", "dapo", "vespo"):  # num_items_in_batch: the dp-only run's processes'
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / t.dp_size
        if mode == "train":
            normalizer = normalizer * t.current_gradient_accumulation_steps / t.args.steps_per_generation
        loss = row_losses.sum() / normalizer
        policy_loss = loss.detach()
    else:
        policy_loss = loss.detach()
        loss = loss / accumulation

    metrics = t._metrics[mode]
    if t._entropy_bonus_enabled:
        effective = mask if entropy_mask is None else entropy_mask
        loss = _entropy_bonus(t, mode, loss, policy_loss, entropies, effective, accumulation)

    if t.beta != 0.0:
        metrics["kl"].append(_token_mean(t, per_token_kl, mask))
    metrics["entropy"].append(_token_mean(t, entropies, mask))

    def row_mean(x):  # TRL's masked_seq_mean: a row's mean over its completion
        return x.squeeze(1) if x.shape[1] == 1 else rows(x) / lengths

    if t.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        low = ((coef_1 < 1 - t.epsilon_low) & (advantages < 0)).to(lengths.dtype)
        high = ((coef_1 > 1 + t.epsilon_high) & (advantages > 0)).to(lengths.dtype)
        with torch.no_grad():
            metrics["clip_ratio/low_mean"].append(_token_mean(t, low, mask))
            metrics["clip_ratio/high_mean"].append(_token_mean(t, high, mask))
            metrics["clip_ratio/region_mean"].append(_token_mean(t, torch.maximum(low, high), mask))
            metrics["clip_ratio/low_min"].append(_nanmin(t._gather_replicas(row_mean(low), cut=False)))
            metrics["clip_ratio/high_max"].append(_nanmax(t._gather_replicas(row_mean(high), cut=False)))
    elif t.loss_type == "cispo":
        clipped = ((coef_1 > t.epsilon_high) & (advantages > 0)).to(lengths.dtype)
        metrics["cispo_clip_ratio"].append(_token_mean(t, clipped, mask))
    elif t.loss_type == "vespo":
        metrics["vespo/phi_seq_mean"].append(_token_mean(t, phi_seq, mask))
    return loss


def _nanmin(x):
    from trl.trainer.utils import nanmin

    return nanmin(x).item()


def _nanmax(x):
    from trl.trainer.utils import nanmax

    return nanmax(x).item()


def _entropy_bonus(t, mode, loss, policy_loss, entropies, effective, accumulation):
    """TRL's entropy bonus (a token mean of the entropy over the tokens the loss acts on,
    `effective`) and its adaptive coefficient, the token count over the CP ranks."""
    count = effective.sum().to(entropies.dtype)
    if t.cp_size > 1:
        dist.all_reduce(count, group=t.cp_group)
    entropy_sum = sum_sequence(entropies, t.cp_group, effective).sum()
    entropy_loss = entropy_sum / count.clamp(min=1.0) / accumulation
    if t.use_adaptive_entropy:
        coef = t.entropy_coef if t._last_world_entropy <= t.args.entropy_target else 0.0
    else:
        coef = t.entropy_coef
    loss = loss - coef * entropy_loss
    t._metrics[mode]["policy_loss"].append(t._gather_replicas(policy_loss[None], cut=False).nanmean().item())
    if t.use_adaptive_entropy and mode == "train":  # every process's own tokens, summed over all
        stats = torch.stack([torch.where(effective, entropies, 0).sum(), effective.sum().to(entropies.dtype)])
        window = t._entropy_window_stats
        t._entropy_window_stats = stats.detach() if window is None else window + stats.detach()
        if t.accelerator.sync_gradients:
            window = t.accelerator.reduce(t._entropy_window_stats, reduction="sum")
            world_entropy = (window[0] / window[1].clamp(min=1.0)).item()
            if world_entropy <= t.args.entropy_target:
                t.entropy_coef = min(t.entropy_coef + t.args.entropy_coef_delta, t.args.entropy_coef_max)
            else:
                t.entropy_coef = max(t.entropy_coef - t.args.entropy_coef_delta, t.args.entropy_coef_min)
            t._last_world_entropy = world_entropy
            t._entropy_window_stats = None
    if mode == "train" and t.accelerator.sync_gradients:
        t._metrics[mode]["entropy_coef"].append(t.entropy_coef)
    return loss


# --- RLOO: its scoring sums each row inline, so it is restated on the shards ---------------------


def rloo_scored(t, inputs):
    """TRL 1.16's RLOOTrainer._generate_and_score_completions for text prompts (a vision-language
    model is refused), run under `as_replicas`: the rows scored on this rank's shard, a row's
    log-prob and KL sums over its completion `sum_sequence`'s (on every CP rank), the KL's token
    mean each rank's partial sums reduced over every process; all else as TRL computes it."""
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
    mask = counted(t, ids, attention, C)  # [B, L], this rank's completion tokens

    with torch.no_grad(), disable_gradient_checkpointing(t.model, t.args.gradient_checkpointing_kwargs):
        old, _ = scores(t, t.model, ids, attention, C, batch_size)
        old_logps = sum_sequence(old, t.cp_group, mask)  # [B], every CP rank
        if t.beta != 0.0:
            if t.ref_model is not None:
                ref, _ = scores(t, t.ref_model, ids, attention, C, batch_size)
            else:  # PEFT: the adapter off (or the initial copy TRL loaded as "ref")
                model = t.accelerator.unwrap_model(t.model)
                with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
                    ref, _ = scores(t, t.model, ids, attention, C, batch_size)

    rewards_per_func = t._calculate_rewards(inputs, prompts, completions, completion_ids_list)
    num_generations = t.num_generations if mode == "train" else t.num_generations_eval
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * t.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    if t.reward_clip_range:
        rewards = rewards.clamp(min=t.reward_clip_range[0], max=t.reward_clip_range[1])
    if t.beta != 0.0:  # RLOO's KL penalty in the reward: a row's first-order log-ratio sum
        per_token_kl = old - ref  # this rank's tokens
        kl = t.accelerator.gather(sum_sequence(per_token_kl, t.cp_group, mask))  # over the replicas
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
    if t.beta != 0.0:
        metrics["kl"].append(_token_mean(t, per_token_kl, mask))
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


def rloo_loss(t, model, inputs):
    """TRL's RLOOTrainer loss and metrics on this rank's shard of the rows: a row's log-prob is
    `sum_sequence`'s, so every CP rank computes its replica's loss (unscaled, as TRL's: the
    trainer divides it by the accumulation steps)."""
    mode = "train" if t.model.training else "eval"
    completion_ids = inputs["completion_ids"]
    ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    C = completion_ids.size(1)
    per_token_logps, entropies = scores(t, model, ids, attention, C, entropy=True)
    mask = counted(t, ids, attention, C)
    log_ratio = sum_sequence(per_token_logps, t.cp_group, mask) - inputs["old_logps"]
    advantages = inputs["advantages"]
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - t.epsilon_low, 1 + t.epsilon_high)
    loss = -torch.min(coef_1 * advantages, coef_2 * advantages).mean()

    metrics = t._metrics[mode]
    metrics["entropy"].append(_token_mean(t, entropies, mask))
    low = (coef_1 < 1 - t.epsilon_low) & (advantages < 0)
    high = (coef_1 > 1 + t.epsilon_high) & (advantages > 0)
    low, high, region = (t._gather_replicas(x.float(), cut=False) for x in (low, high, low | high))
    metrics["clip_ratio/low_mean"].append(low.nanmean().item())
    metrics["clip_ratio/low_min"].append(_nanmin(low))
    metrics["clip_ratio/high_mean"].append(high.nanmean().item())
    metrics["clip_ratio/high_max"].append(_nanmax(high))
    metrics["clip_ratio/region_mean"].append(region.nanmean().item())
    return loss


LOSSES = {"GRPOTrainer": grpo_loss, "RLOOTrainer": rloo_loss}
SCORED = {"RLOOTrainer": rloo_scored}  # the trainers whose generation and scoring is restated here
