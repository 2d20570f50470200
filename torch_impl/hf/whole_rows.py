"""TRL's trainers that score whole rows through their fused LM head (DPO, KTO, GRPO, RLOO), under CP.

TRL's DPOTrainer, KTOTrainer, GRPOTrainer and RLOOTrainer read the model through one call,
`model(**rows, labels=labels, fused_lm_head=True)` (`trl.trainer.utils.add_fused_lm_head`), which
returns one value per position of the rows ([B, S - 1]: the next token's log-prob and, where
asked, the distribution's entropy, mean logit, log of summed squared probabilities and the
label's top-1 hit), never [B, S, V] logits. That call is the one substitution point (`hook`):

1. A forward pre-hook on the model shards the call's whole rows [B, S] as the mixin's step does
   (`ContextParallelMixin.shard`: padded at the end to the layout's multiple, labels shifted over
   the *global* row, `hf.shard_batch`); the model runs on its shard [B, L], and TRL's head scores
   the shard's own positions.
2. A forward hook gathers each per-position output over the row, in global order, and cuts it to
   the S - 1 positions TRL reads: floats by `gather_sequence` (backward: reduce-scatter, so each
   position's gradient returns to the rank that owns it, summed over the CP ranks), bools by
   `gather_metadata`.

TRL's own loss then runs unchanged on every CP rank, over whole rows (every loss type, every
option, every metric), with the trainer's accelerator seen as the dp-only run's (`ReplicaView`:
its gathers over the dp replicas, one CP rank each). Each CP rank computes its replica's loss;
the gather's backward sums the CP ranks' equal gradients of a position, which DDP's average over
dp x cp undoes, as for RewardTrainer. The hooks act only inside `as_replicas` (the mixin's loss,
GRPO's and RLOO's generation and scoring, torch_impl.hf.rl, and DPO's and KTO's precomputed
reference log-probs, their loader's rows sharded over the replicas): elsewhere a fused-head call
runs as one process.

Bytes: each output gathered is B x S x itemsize a rank receives per forward (a 128k-token row:
512 KB of float32 log-probs), against the megabytes per layer that attention moves.
"""

import contextlib

from torch_impl.hf.batch import LAYOUT
from torch_impl.metadata import gather_metadata
from torch_impl.sequence import gather_sequence

TRAINERS = ("DPOTrainer", "KTOTrainer", "GRPOTrainer", "RLOOTrainer")
GATHERED = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits")  # floats: gather_sequence
MASKS = ("is_top1", "label_mask")  # bools: gather_metadata


def hook(t, model):
    """Make `model`'s fused-head calls with whole rows inside `as_replicas(t)` CP over t.cp_group
    (t: the trainer); returns the two hooks' handles."""
    lengths = []  # per call in flight: the rows' length S where this call was sharded, else None

    def shard(module, args, kwargs):
        lengths.append(None)  # `gather` pops it, also where the forward raises
        if not (t.cp_whole_rows and kwargs.get("fused_lm_head") and LAYOUT not in kwargs):
            return None
        given = all(kwargs.get(key) is not None for key in ("input_ids", "labels"))
        if args or not given or "shift_labels" in kwargs:
            raise ValueError(
                "torch_impl.hf: a fused LM head call under CP takes keyword `input_ids` and unshifted "
                f"`labels` [B, S], as TRL's trainers pass them; got {len(args)} positional arguments and "
                f"keywords {sorted(kwargs)}"
            )
        lengths[-1] = kwargs["input_ids"].shape[1]
        local = t.shard({key: value for key, value in kwargs.items() if key != "fused_lm_head"})
        del local["labels"]  # the head reads shift_labels: [B, L], shifted over the global row
        return args, {**local, "fused_lm_head": True}

    def gather(module, args, kwargs, output):
        S = lengths.pop()
        if S is None or output is None:  # passed through, or the forward raised
            return None
        return gathered(output, S - 1, t.cp_group, t.cp_layout)

    return (
        model.register_forward_pre_hook(shard, with_kwargs=True),
        model.register_forward_hook(gather, with_kwargs=True, always_call=True),
    )


def gathered(output, positions, group, layout):
    """TRL's FusedCausalLMOutput of this rank's shard ([B, L] per field) as one process returns it
    for the whole rows: each field [B, positions] in global order (the gathered [B, n L], entry
    t scoring token t + 1, cut to its first `positions`); `loss` the rows' mean negative log-prob
    over their labels (TRL's trainers pass no `num_items_in_batch` to this call)."""
    fields = {}
    for name in GATHERED:
        value = getattr(output, name)
        if value is not None:
            fields[name] = gather_sequence(value, group, layout=layout)[:, :positions]  # [B, S - 1]
    for name in MASKS:
        value = getattr(output, name)
        if value is not None:
            fields[name] = gather_metadata(value, group, layout=layout)[:, :positions]  # [B, S - 1]
    count = fields["label_mask"].sum().clamp(min=1)
    fields["loss"] = -fields["log_probs"].sum() / count
    return type(output)(**{**output, **fields})


class ReplicaView:
    """The trainer's accelerator as the dp-only run's process for this replica sees it: its
    gathers over the dp replicas (one CP rank each), its process index and count the replica's;
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
        return self._t._gather_replicas(tensor, cut=False)

    def reduce(self, tensor, reduction="sum", scale=1.0):
        total = self._t._gather_replicas(tensor[None], cut=False).sum(0)  # over the replicas
        return scale * (total / self._t.dp_size if reduction == "mean" else total)

    def gather_for_metrics(self, tensor, use_gather_object=False):
        if isinstance(tensor, (tuple, list)) and not use_gather_object:  # TRL's reference log-probs
            return type(tensor)(self.gather_for_metrics(t) for t in tensor)
        if use_gather_object or not hasattr(tensor, "shape"):
            raise ValueError(
                "torch_impl.hf: gather_for_metrics of objects is not seen over the dp replicas; "
                f"got {type(tensor).__name__}"
            )
        return self._t._gather_replicas(tensor)

    def prepare(self, *objects):
        """The accelerator's prepare, a data loader's rows sharded over the dp replicas (a
        replica's CP ranks read the same rows), as the dp-only run's process reads its share."""
        prepared = self.world.prepare(*objects)
        if len(objects) == 1:
            return self._t._by_replica(prepared) if hasattr(prepared, "batch_sampler") else prepared
        return tuple(self._t._by_replica(p) if hasattr(p, "batch_sampler") else p for p in prepared)


@contextlib.contextmanager
def as_replicas(t):
    """Within: `t.accelerator` is a ReplicaView and the hooked models' fused-head calls with whole
    rows are CP. Re-entrant: a nested use keeps the view it finds, and each restores what it found."""
    before = t.accelerator, t.cp_whole_rows
    if not isinstance(t.accelerator, ReplicaView):
        t.accelerator = ReplicaView(t)
    t.cp_whole_rows = True
    try:
        yield
    finally:
        t.accelerator, t.cp_whole_rows = before


def refusal(t):
    """Why TRL's DPOTrainer or KTOTrainer `t`, as its arguments configure it, is not exact under
    CP; None where it is."""
    if getattr(t, "_is_vision_dataset", False):
        return "a vision dataset: this trainer's images are not split across CP ranks (hf.shard_batch's are)"
    if t.args.use_liger_kernel:
        return "`use_liger_kernel`: Liger's loss reads the model's hidden states, not its fused LM head"
    return prompt_learning(t.model)


def prompt_learning(model):
    """Why a PEFT model that prepends virtual tokens (prompt learning) is not exact under CP (each
    rank's shard would get them), or None."""
    config = getattr(model, "active_peft_config", None)
    if getattr(config, "is_prompt_learning", False):
        kind = type(config).__name__
        return f"a prompt-learning PEFT model ({kind}): its virtual tokens would prefix every shard"
    return None
