"""TRL's DPOTrainer and KTOTrainer losses under CP, for `ContextParallelMixin`.

TRL 1.16's `_compute_loss` (trl/trainer/dpo_trainer.py, kto_trainer.py) reads its fused LM head's
per-token outputs (log-probs, entropy, mean logits, top-1 hits) in two ways: a row's sum over its
completion (the completion's log-prob), and a batch's total over tokens, gathered from every
process (the metrics). Under CP a rank holds its shard of every row, so here:

- a row's sum is `sum_sequence`: one all-reduce of a value per row, the same on every CP rank,
  which then computes its replica's loss as the dp-only run's rank does (backward: the ranks'
  gradients of the row summed back to every rank's tokens; DDP's average over dp x cp undoes the
  CP size, as for RewardTrainer);
- a batch's token total is each rank's partial sum, all-reduced over the CP group;
- counts per row (completion lengths) are read from the global masks, which every rank holds;
- what TRL gathers over processes is gathered over the dp replicas, one CP rank each, and cut as
  accelerate's `gather_for_metrics` cuts the last batch (`ContextParallelMixin._gather_replicas`).

The formulas after the row values are TRL's, restated for the loss types in DPO_LOSSES and
KTO_LOSSES; `refusal` names what is not made exact here.
"""

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torch_impl.hf.inputs import IGNORE_INDEX
from torch_impl.reductions import sum_sequence

DPO_LOSSES = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
    "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
)  # fmt: skip
KTO_LOSSES = ("kto", "apo_zero_unpaired")


def refusal(trainer, name):
    """Why TRL's trainer `name` (DPOTrainer, KTOTrainer), as `trainer.args` configure it, is not
    exact under CP here; None where it is."""
    args = trainer.args
    if getattr(trainer, "_is_vision_dataset", False):
        return "a vision dataset: images are not split across CP ranks"
    if args.use_liger_kernel:
        return "`use_liger_kernel`: Liger replaces the model's forward, which CP hooks"
    if name == "DPOTrainer":
        if args.use_weighting:
            return "`use_weighting` (WPO): its weights are per-token means not made CP here"
        if args.ld_alpha is not None:
            return "`ld_alpha` (LD-DPO): its shared and tail masks are not made CP here"
        unknown = sorted(set(args.loss_type) - set(DPO_LOSSES))
        if unknown:
            return f"`loss_type` {unknown}: not among {list(DPO_LOSSES)}"
    elif args.loss_type not in KTO_LOSSES:
        return f"`loss_type` {args.loss_type!r}: not among {list(KTO_LOSSES)}"
    return None


def _score(t, model, ids, padding, completion):
    """The fused LM head on this rank's shard of [B, S] rows (t.shard: padded for the layout and
    sharded): (each row's log-prob summed over its completion, [B] on every CP rank; the head's
    per-token outputs on this rank's tokens [B, L]; where they count, bool [B, L])."""
    labels = ids.masked_fill(completion == 0, IGNORE_INDEX)
    local = t.shard({"input_ids": ids, "attention_mask": padding, "labels": labels})
    counted = local["shift_labels"] != IGNORE_INDEX  # completion tokens, as TRL's completion_mask[:, 1:]
    outputs = model(**local, fused_lm_head=True)
    return sum_sequence(outputs.log_probs, t.cp_group), outputs, counted


@contextlib.contextmanager
def _reference(t):
    """The reference model to call, as TRL's trainers choose it: `ref_model`, or for a PEFT model
    without one the model with its adapter off (or its "ref" adapter), under no_grad and without
    activation checkpointing."""
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.utils import use_adapter

    with torch.no_grad(), disable_gradient_checkpointing(t.model, t.args.gradient_checkpointing_kwargs):
        if t.ref_model is not None:
            yield t.ref_model
            return
        unwrapped = t.accelerator.unwrap_model(t.model)
        with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
            yield t.model


def _token_totals(t, *partials):
    """Batch totals over tokens, as TRL's `gather_for_metrics(x).sum()` gives them over the dp-only
    run's processes: this rank's partial sums, all-reduced over its CP ranks, then gathered over
    the replicas. A float64 [len(partials)]."""
    local = torch.stack([p.detach().to(torch.float64) for p in partials])
    if t.cp_size > 1:
        dist.all_reduce(local, group=t.cp_group)
    return t._gather_replicas(local[None]).sum(0)


def _token_metrics(t, mode, outputs, counted, chosen_rows, rejected_rows, top1=False):
    """The metrics TRL's two trainers log from the head's per-token outputs: entropy, the chosen
    and rejected completions' mean logits, (DPO) the chosen completions' token accuracy."""
    chosen, rejected = counted & chosen_rows[:, None], counted & rejected_rows[:, None]
    entropy, logits = outputs.entropy.detach(), outputs.mean_logits
    parts = [
        torch.where(counted, entropy, 0).sum(), counted.sum(),
        logits[chosen].sum(), chosen.sum(), logits[rejected].sum(), rejected.sum(),
        (outputs.is_top1 & chosen).sum() if top1 else chosen.sum(),
    ]  # fmt: skip
    entropy_sum, tokens, chosen_sum, chosen_n, rejected_sum, rejected_n, correct = _token_totals(
        t, *parts
    ).tolist()
    t._metrics[mode]["entropy"].append(entropy_sum / tokens if tokens > 0 else 0.0)
    return chosen_sum, chosen_n, rejected_sum, rejected_n, correct


def _count_tokens(t, mode, padding):
    """TRL's `num_tokens`: the real tokens trained on so far, over the dp-only run's processes."""
    if mode == "train":
        t._total_train_tokens += int(t._gather_replicas(padding.sum()[None]).sum().item()) // t._tp_size
    t._metrics[mode]["num_tokens"] = [t._total_train_tokens]


def dpo_loss(t, model, inputs):
    """TRL's DPOTrainer loss and metrics on this rank's shards of the rows (every CP rank: its
    replica's loss)."""
    mode = "train" if t.model.training else "eval"
    ids, padding, completion = inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"]
    logps, outputs, counted = _score(t, model, ids, padding, completion)
    chosen_logps, rejected_logps = logps.chunk(2)  # the batch is [chosen, rejected]
    if t.precompute_ref_logps:
        ref_chosen_logps, ref_rejected_logps = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
    else:
        with _reference(t) as reference:
            ref_chosen_logps, ref_rejected_logps = _score(t, reference, ids, padding, completion)[0].chunk(2)
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    chosen_scores, rejected_scores = (_f_divergence(t, r) for r in (chosen_logratios, rejected_logratios))
    delta = chosen_scores - rejected_scores
    lengths = completion.sum(dim=1).clamp(min=1.0).chunk(2)  # per row, from the global mask
    chosen_tokens = completion[: len(chosen_logps), 1:].sum()
    beta, smoothing = t.beta, t.label_smoothing
    loss = 0.0
    for loss_type, weight in zip(t.loss_types, t.loss_weights, strict=True):
        if loss_type == "sigmoid":
            per_row = -F.logsigmoid(beta * delta)
        elif loss_type == "hinge":
            per_row = torch.relu(1 - beta * delta)
        elif loss_type == "ipo":
            per_row = (chosen_scores / lengths[0] - rejected_scores / lengths[1] - 1 / (2 * beta)) ** 2
        elif loss_type == "exo_pair":
            epsilon = torch.tensor(smoothing, device=delta.device)
            per_row = torch.sigmoid(beta * delta) * (F.logsigmoid(beta * delta) - torch.log1p(-epsilon)) + (
                torch.sigmoid(-beta * delta) * (F.logsigmoid(-beta * delta) - torch.log(epsilon))
            )
        elif loss_type == "nca_pair":
            chosen, rejected = beta * chosen_logratios, beta * rejected_logratios
            per_row = -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)
        elif loss_type == "robust":
            clean = -(1 - smoothing) * F.logsigmoid(beta * delta)
            flipped = -smoothing * F.logsigmoid(-beta * delta)
            per_row = (clean - flipped) / (1 - 2 * smoothing)
        elif loss_type == "bco_pair":
            per_row = -F.logsigmoid(beta * chosen_logratios) - F.logsigmoid(-beta * rejected_logratios)
        elif loss_type == "sppo_hard":
            per_row = (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
        elif loss_type in ("aot", "aot_unpaired"):
            if loss_type == "aot":
                first, second = chosen_logps - rejected_logps, ref_chosen_logps - ref_rejected_logps
            else:
                first, second = chosen_logratios, rejected_logratios
            gap = torch.sort(first, dim=0)[0] - torch.sort(second, dim=0)[0]
            per_row = -F.logsigmoid(beta * gap) * (1 - smoothing) - F.logsigmoid(-beta * gap) * smoothing
        elif loss_type == "apo_zero":
            per_row = 1 - torch.sigmoid(beta * chosen_logratios) + torch.sigmoid(beta * rejected_logratios)
        elif loss_type == "apo_down":
            per_row = (
                torch.sigmoid(beta * chosen_logratios)
                + 1
                - torch.sigmoid(beta * (chosen_logratios - rejected_logratios))
            )
        elif loss_type == "discopop":
            logits = delta * beta
            modulation = torch.sigmoid(logits / t.args.discopop_tau)
            per_row = -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation
        elif loss_type == "sft":  # the chosen completions' token mean, the tokens counted globally
            per_row = (-chosen_logps.sum() / chosen_tokens).expand(len(chosen_logps))
        else:  # sigmoid_norm
            per_row = -F.logsigmoid(beta * (chosen_scores / lengths[0] - rejected_scores / lengths[1]))
        loss = loss + per_row.mean() * weight

    chosen_rows = torch.arange(len(logps), device=logps.device) < len(chosen_logps)
    chosen_sum, chosen_n, rejected_sum, rejected_n, correct = _token_metrics(
        t, mode, outputs, counted, chosen_rows, ~chosen_rows, top1=True
    )
    _count_tokens(t, mode, padding)
    metrics = t._metrics[mode]
    metrics["logits/chosen"].append(chosen_sum / chosen_n if chosen_n > 0 else 0.0)
    metrics["logits/rejected"].append(rejected_sum / rejected_n if rejected_n > 0 else 0.0)
    metrics["mean_token_accuracy"].append(correct / chosen_n if chosen_n > 0 else 0.0)
    chosen_rewards, rejected_rewards = beta * chosen_logratios.detach(), beta * rejected_logratios.detach()
    rows = {
        "rewards/chosen": chosen_rewards,
        "rewards/rejected": rejected_rewards,
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
        "rewards/margins": chosen_rewards - rejected_rewards,
        "logps/chosen": chosen_logps.detach(),
        "logps/rejected": rejected_logps.detach(),
    }
    for key, values in rows.items():  # TRL's accelerator.gather(...).mean(), over the replicas
        metrics[key].append(t._gather_replicas(values, cut=False).mean().item())
    return loss


def _f_divergence(t, logratios):
    """TRL's DPO scores of a row's log-ratio under `f_divergence_type`."""
    kind = t.f_divergence_type
    if kind == "reverse_kl":
        return logratios
    if kind == "forward_kl":
        return 1 - torch.exp(-logratios)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    alpha = t.f_alpha_divergence_coef  # alpha_divergence
    if abs(alpha - 1.0) < 1e-6:
        return logratios
    scaled = (alpha - 1.0) * logratios
    bound = {torch.float16: 11.0, torch.bfloat16: 80.0, torch.float32: 80.0}[scaled.dtype]
    return (torch.exp(torch.clamp(scaled.float(), max=bound)) - 1.0).to(scaled.dtype) / (alpha - 1.0)


def kto_loss(t, model, inputs):
    """TRL's KTOTrainer loss and metrics on this rank's shards of the rows (every CP rank: its
    replica's loss)."""
    mode = "train" if t.model.training else "eval"
    ids, padding, completion = inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"]
    kl_rows = (inputs.get("KL_input_ids"), inputs.get("KL_attention_mask"), inputs.get("KL_completion_mask"))
    desirable = torch.as_tensor(inputs["label"], dtype=torch.bool, device=ids.device)
    kl_logps = None
    if t.calculate_KL:
        with torch.no_grad():
            kl_logps = _score(t, model, *kl_rows)[0]
    logps, outputs, counted = _score(t, model, ids, padding, completion)
    if t.precompute_ref_logps:
        ref_logps, ref_kl_logps = inputs["ref_logps"], inputs.get("ref_KL_logps")
    else:
        with _reference(t) as reference:
            ref_kl_logps = _score(t, reference, *kl_rows)[0] if t.calculate_KL else None
            ref_logps = _score(t, reference, ids, padding, completion)[0]
    if t.calculate_KL:
        kl = (kl_logps - ref_kl_logps).mean().detach()
        kl = t._gather_replicas(kl[None]).mean().clamp(min=0)
    else:
        kl = torch.zeros(1, dtype=logps.dtype, device=logps.device)
    logratios = logps - ref_logps
    chosen, rejected = logratios[desirable], logratios[~desirable]
    if t.loss_type == "kto":
        chosen_losses = 1 - F.sigmoid(t.beta * (chosen - kl))
        rejected_losses = 1 - F.sigmoid(t.beta * (kl - rejected))
    else:  # apo_zero_unpaired
        chosen_losses, rejected_losses = 1 - F.sigmoid(t.beta * chosen), F.sigmoid(t.beta * rejected)
    losses = torch.cat((t.desirable_weight * chosen_losses, t.undesirable_weight * rejected_losses))
    metrics = t._metrics[mode]
    metrics["kl"].append(kl.item())
    chosen_sum, chosen_n, rejected_sum, rejected_n, _ = _token_metrics(
        t, mode, outputs, counted, desirable, ~desirable
    )
    _count_tokens(t, mode, padding)
    if chosen_n > 0:
        metrics["logits/chosen"].append(chosen_sum / chosen_n)
    if rejected_n > 0:
        metrics["logits/rejected"].append(rejected_sum / rejected_n)
    # TRL's gather_for_metrics of per-process sums, over the replicas
    n_chosen, n_rejected = (
        t._gather_replicas(torch.stack([desirable.sum(), (~desirable).sum()])[None]).sum(0).tolist()
    )
    rows = {"chosen": (desirable, n_chosen), "rejected": (~desirable, n_rejected)}
    for side, (which, count) in rows.items():
        if count > 0:
            for key, values in (("rewards", t.beta * logratios.detach()), ("logps", logps.detach())):
                total = t._gather_replicas(values[which].nansum()[None]).nansum().item()
                metrics[f"{key}/{side}"].append(total / count)
    if n_chosen > 0 and n_rejected > 0:
        metrics["rewards/margins"].append(metrics["rewards/chosen"][-1] - metrics["rewards/rejected"][-1])
    return losses.nanmean()


LOSSES = {"DPOTrainer": dpo_loss, "KTOTrainer": kto_loss}
