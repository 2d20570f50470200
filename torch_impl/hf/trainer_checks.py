"""Which trainers `ContextParallelMixin` (torch_impl.hf.trainer) makes exact and what it refuses,
with ValueError on every rank before the first step: TRL's trainers by their loss (`SUPPORTED`:
a token mean, rows pooled whole, TRL's own loss on whole rows, rollouts first) and the others
(`check_trainer`), GRPO's and RLOO's config before TRL's `__init__` reads it (`rollout_config`),
then, once the base class has set the trainer up, the parallelisms, options and models whose loss
would not equal the dp-only run's (`refuse_inexact`)."""

import inspect

from torch_impl.hf import rl, whole_rows

# TRL's trainers whose loss is a function of values per row that every CP rank holds whole (a
# reward model's pooled logits, torch_impl.hf.heads): each CP rank computes the replica's loss
ROW_LOSSES = ("RewardTrainer",)
# TRL's trainers whose own loss runs on whole rows, scored through the hooked fused LM head
WHOLE_ROWS = whole_rows.TRAINERS
# of those, the ones that generate their rows first: torch_impl.hf.rl
ROLLOUTS = ("GRPOTrainer", "RLOOTrainer")
SUPPORTED = ("SFTTrainer", *ROW_LOSSES, *WHOLE_ROWS)


def trl_trainer(cls):
    """The TRL trainer class `cls` derives from (one of trl.trainer's or trl.experimental's), or None."""
    return next((base for base in cls.__mro__ if base.__module__.startswith("trl.")), None)


def check_trainer(cls):
    """ValueError naming the trainer when `cls` (the class mixed with ContextParallelMixin) is one
    of TRL's trainers other than those SUPPORTED: transformers' Trainer and SFTTrainer (a token
    mean), RewardTrainer (pooled rows), DPOTrainer and KTOTrainer (whole rows), GRPOTrainer and
    RLOOTrainer (rollouts) are the ones the mixin makes exact."""
    trl = trl_trainer(cls)
    if trl is None or (trl.__module__.startswith("trl.trainer.") and trl.__name__ in SUPPORTED):
        return
    name = trl.__name__ if trl.__module__.startswith("trl.trainer.") else f"{trl.__module__}.{trl.__name__}"
    raise ValueError(
        f"torch_impl.hf: TRL's {name} is not supported: the mixin was not made exact for its "
        "loss, which each CP rank would compute from its own shard of the row; supported: "
        f"transformers' Trainer and TRL's {', '.join(SUPPORTED)}"
    )


def rollout_config(name, cp_size, args, kwargs):
    """GRPO's or RLOO's config (`args`, or its third positional argument), refused where it is not exact
    or its batches cannot be split over the dp replicas (torch_impl.hf.rl.batch_refusal), its
    generation batch counting the dp replicas' rows (torch_impl.hf.rl.replica_config)."""
    positional = kwargs.get("args") is None and len(args) > 2
    config = args[2] if positional else kwargs.get("args")
    if config is None:
        raise ValueError(
            f"torch_impl.hf: TRL's {name} needs its `args` passed: under CP its generation "
            "batch is sized by the data-parallel replicas, not by the processes"
        )
    why = rl.refusal(config) or rl.batch_refusal(config, cp_size)
    if why is not None:
        raise ValueError(f"torch_impl.hf: TRL's {name} with {why}")
    config = rl.replica_config(config, cp_size)
    if positional:
        return (*args[:2], config, *args[3:]), kwargs
    return args, kwargs | {"args": config}


def refuse_inexact(t):
    """ValueError for what would not equal the dp-only run in `t`, the mixin's trainer once the
    base class has set it up (the same on every rank)."""
    config = getattr(t.accelerator, "parallelism_config", None)
    for what in ("cp", "sp", "tp"):
        if config is not None and getattr(config, f"{what}_enabled", False):
            raise ValueError(
                f"torch_impl.hf: accelerate's parallelism_config has {what} enabled; its CP "
                "replaces the models' masks by is_causal (sliding windows and documents lost): "
                "use one or the other"
            )
    if t.is_fsdp_enabled and not t.accelerator.is_fsdp2:
        raise ValueError(
            "torch_impl.hf: FSDP1 is not supported (accelerate's FSDP2 is the one tested with "
            "CP): pass fsdp_config={'fsdp_version': 2}"
        )
    if t.is_deepspeed_enabled:
        raise ValueError(
            "torch_impl.hf: DeepSpeed through the trainer is not supported (its ZeRO engine is "
            "not tested with CP: the test environment cannot install DeepSpeed without a CUDA build of "
            "torch); shard with FSDP2 instead, fsdp=True, fsdp_config={'fsdp_version': 2}"
        )
    refused = {
        "label_smoothing_factor > 0": t.args.label_smoothing_factor > 0,
        "compute_loss_func": t.compute_loss_func is not None,
        "compute_metrics": t.compute_metrics is not None,
        "preprocess_logits_for_metrics": t.preprocess_logits_for_metrics is not None,
    }
    for name, present in refused.items():
        if present:
            raise ValueError(
                f"torch_impl.hf: `{name}` is not supported: it would see each CP rank's slice "
                "of the sequence (its labels or logits), not the whole"
            )
    text = t.model.config.get_text_config()
    aux = getattr(t, "aux_loss_enabled", None)  # TRL's switch; transformers': the model config's
    if aux is None:
        aux = getattr(text, "output_router_logits", False) and getattr(text, "router_aux_loss_coef", 0.0)
    if aux:
        raise ValueError(
            "torch_impl.hf: the MoE router's auxiliary loss would be each CP rank's own, a "
            "load-balancing statistic of its slice's tokens, not of the sequence's: set "
            f"router_aux_loss_coef=0.0 in the {type(t.args).__name__} (TRL's SFT, DPO, KTO, GRPO and "
            "RLOO configs have it), or output_router_logits=False in the model config"
        )
    trl = trl_trainer(type(t))
    if trl is not None and trl.__name__ in WHOLE_ROWS:
        why = rl.refusal(t.args, t) if trl.__name__ in ROLLOUTS else whole_rows.refusal(t)
        if why is not None:
            raise ValueError(f"torch_impl.hf: TRL's {trl.__name__} with {why}")
        return
    if trl is not None and trl.__name__ in ROW_LOSSES:  # its loss reads the model's pooled logits
        return
    model = t.model.get_base_model() if hasattr(t.model, "get_base_model") else t.model  # PEFT
    if type(model).__name__.endswith("ForSequenceClassification"):
        raise ValueError(
            f"torch_impl.hf: {type(model).__name__}: a sequence classification loss is made exact "
            "under CP with TRL's RewardTrainer only (the mixin's other loss path is a causal LM's token "
            "mean); use RewardTrainer, or hf.parallelize in your own loop (the model's loss is then each "
            "rank's 1/n share)"
        )
    forward = inspect.signature(model.forward).parameters.values()
    if not t.model_accepts_loss_kwargs and all(p.kind != p.VAR_KEYWORD for p in forward):
        raise ValueError(
            f"torch_impl.hf: {type(model).__name__}'s forward takes no `**kwargs`, so the count of "
            "a micro-batch's labels cannot reach its loss, and each CP rank's loss would be its "
            "own slice's mean, not its share of the sequence's"
        )
