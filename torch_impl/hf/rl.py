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
  outputs gathered back over the row). Where TRL gathers with accelerate's module-level
  `gather` / `gather_object` instead (the rewards; RLOO's each row's KL penalty; the completions
  table), its method runs with those names bound to the gathers over the replicas (`rebound`,
  through torch_impl.hf.rebind, which checks the names on the method's bytecode: a TRL release
  that changes them is refused, not run).

`refusal` names what is not made exact.
"""

import copy
import functools
import random
import types

import numpy as np
import torch
import torch.distributed as dist

from torch_impl.hf import whole_rows
from torch_impl.hf.rebind import global_loads, rebind


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
    counts every process: dp x cp). TRL's config checked its batches over every process; they are
    checked again over the replicas first (`batch_refusal`)."""
    args = copy.copy(args)
    args.generation_batch_size //= cp_size
    return args


def batch_refusal(args, cp_size):
    """Why TRL's divisibility checks of a GRPOConfig or RLOOConfig (`__post_init__`, over
    `args.world_size` processes) fail over its dp replicas, world_size / cp_size, as they would in
    the dp-only run: each prompt's group of num_generations completions must fit whole in a
    generation batch, and in an evaluation batch where the config evaluates; None if they pass."""
    world = args.world_size
    if world % cp_size:
        return f"`cp_size` ({cp_size}) must divide the number of processes ({world}): the world is dp x cp"
    dp = world // cp_size
    rows, G, B = args.generation_batch_size // cp_size, args.num_generations, args.per_device_train_batch_size
    if rows % G:
        return (
            f"cp_size={cp_size} over {world} processes leaves {dp} data-parallel replica(s), whose "
            f"generation batch of {rows} rows (per_device_train_batch_size {B} x {dp} replica(s) x "
            f"steps_per_generation {args.steps_per_generation}) must be divisible "
            f"by num_generations ({G}): raise per_device_train_batch_size or steps_per_generation, "
            "lower num_generations or cp_size"
        )
    G = args.num_generations_eval or args.num_generations
    rows = args.per_device_eval_batch_size * dp
    if args.do_eval and args.eval_strategy != "no" and rows % G:
        return (
            f"cp_size={cp_size} over {world} processes leaves {dp} data-parallel replica(s), whose "
            f"evaluation batch of {rows} rows (per_device_eval_batch_size {args.per_device_eval_batch_size} "
            f"x {dp} replica(s)) must be divisible by the evaluation's num_generations ({G}): raise "
            "per_device_eval_batch_size, lower num_generations_eval or cp_size"
        )
    return None


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


# --- TRL's scoring as TRL runs it, its module-level gathers over the replicas -----------------

# accelerate's module-level collectives that TRL's trainers import; a method of REBOUND's that
# loads one it does not rebind is refused (a new release gathering something new over every process)
COLLECTIVES = frozenset({"gather", "gather_object", "broadcast", "broadcast_object_list", "reduce"})
# per trainer, its methods that call accelerate's module-level gathers over every process (the
# rewards; RLOO's each row's KL penalty; the completions table's prompts and completions), and
# those names, rebound to the gathers over the dp replicas
REBOUND = {
    "GRPOTrainer": {"_generate_and_score_completions": ("gather_object",), "_calculate_rewards": ("gather",)},
    "RLOOTrainer": {
        "_generate_and_score_completions": ("gather", "gather_object"),
        "_calculate_rewards": ("gather",),
    },
}


def replica_gathers(t):
    """accelerate's `gather` and `gather_object` as the dp-only run's processes see them: over the
    dp replicas, one CP rank each, in the replicas' order ([dp * n, ...]; each replica's list, one
    after another)."""

    def gather_object(obj):
        if t.cp_size == 1:
            from accelerate.utils import gather_object as over_every_process

            return over_every_process(obj)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, obj)  # by rank
        return [item for replica in every[:: t.cp_size] for item in replica]

    return {"gather": functools.partial(t._gather_replicas, cut=False), "gather_object": gather_object}


def rebound(t, trainer):
    """{name: bound method of t} for each of REBOUND's methods of `trainer` (TRL's class): TRL's own
    code, its module-level gathers the replicas' (torch_impl.hf.rebind: ValueError, naming it,
    where the method no longer loads a name, or loads one of COLLECTIVES that is not rebound, or
    where a class between the mixin and TRL's overrides it)."""
    gathers, methods = replica_gathers(t), {}
    mro = type(t).__mro__
    after = mro[1 + next(i for i, cls in enumerate(mro) if cls.__module__ == "torch_impl.hf.trainer") :]
    for name, names in REBOUND[trainer.__name__].items():
        owner = next(cls for cls in after if name in vars(cls))  # what the mixin's super() would call
        if owner is not next(cls for cls in trainer.__mro__ if name in vars(cls)):  # not TRL's
            raise ValueError(
                f"torch_impl.hf: {owner.__qualname__}.{name} overrides TRL's {trainer.__name__}.{name}, "
                "which the mixin runs itself with its gathers over the dp replicas: an override "
                "below the mixin would not run; override it above the mixin (calling super())"
            )
        function = getattr(trainer, name)
        unbound = sorted((global_loads(function) & COLLECTIVES) - set(names))
        if unbound:
            raise ValueError(
                f"torch_impl.hf: TRL's {trainer.__name__}.{name} calls accelerate's {unbound} over "
                "every process, which the mixin does not see over the dp replicas (this TRL release "
                "is not the one tested)"
            )
        try:
            rebound_function = rebind(function, {key: gathers[key] for key in names})
        except ValueError as error:  # a name it no longer loads, or a decorator rebind cannot keep
            raise ValueError(
                f"torch_impl.hf: TRL's {trainer.__name__}.{name} cannot run with its gathers over the dp "
                f"replicas: {error} (this TRL release is not the one tested)"
            ) from error
        methods[name] = types.MethodType(rebound_function, t)
    return methods
