"""`ContextParallelMixin`: transformers' `Trainer` and TRL's trainers made context-parallel.

    class CPTrainer(hf.ContextParallelMixin, transformers.Trainer): ...
    trainer = CPTrainer(model=model, args=args, train_dataset=..., cp_size=2)

The world (torchrun's processes) is dp x cp: ranks dp_index * cp .. dp_index * cp + cp - 1 are one
data-parallel replica's CP ranks. Through the trainers' public methods only:

1. `__init__` refuses what cannot be exact (on every rank, before any step:
   torch_impl.hf.trainer_checks), builds the (dp, cp) DeviceMesh and makes the model CP over
   mesh["cp"] (`hf.parallelize`; a PEFT model's base model) before the trainer wraps it (DDP, or
   accelerate's FSDP2 sharding over every process, dp x cp flattened, as torchtitan shards over dp
   and cp).
2. `get_train_dataloader` / `get_eval_dataloader`: the trainer's own loader, sharded by accelerate
   over dp replicas instead of over every process: a replica's CP ranks get the same rows.
3. `get_cp_size`: every CP rank counts its replica's whole batch; the trainer sums its count over
   all processes and divides by this, so `num_items_in_batch` is the dp-only run's.
4. `compute_loss`: the global batch padded to what the layout needs (labels -100, masked, after
   every real token: no real token sees it) and sharded (`hf.shard_batch`) before the trainer's own
   loss. Each rank's loss is then its share of the token mean; the trainer multiplies it by the
   number of processes and its DDP (FSDP2's reduce-scatter) averages over all of them, so the
   gradients, `loss` and `grad_norm` are the dp-only run's. Where the trainer gives no count (TRL's
   evaluation: each process's loss its own mean), the replica's token mean is formed over its CP
   ranks; a model that takes no loss kwargs (the dp-only run: each micro-batch its own mean) is given
   the micro-batch's count and its loss multiplied by cp (`_micro_batch_mean`). TRL's
   RewardTrainer: the model's pooled rewards are whole on every CP rank
   (torch_impl.hf.heads), so each computes the replica's loss; DDP's average over dp x cp undoes
   the CP size by which select_position's backward sums the ranks' gradients. TRL's DPOTrainer
   and KTOTrainer: their own loss on every CP rank, over whole rows, the model's fused LM head
   sharding them and gathering its per-token outputs (torch_impl.hf.whole_rows). TRL's
   GRPOTrainer and RLOOTrainer: a replica's CP ranks generate as the dp-only run's process and
   agree on CP rank 0's completions, then score and train on their shards (torch_impl.hf.rl).
"""

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
import torch.nn.functional as F

from torch_impl.hf import media, rl, whole_rows
from torch_impl.hf.batch import BATCH_KEYS, IGNORE_INDEX, TYPE_KEYS, shard_batch
from torch_impl.hf.parallelize import checkpoint_kwargs, parallelize
from torch_impl.hf.trainer_checks import (
    ROLLOUTS,
    ROW_LOSSES,
    WHOLE_ROWS,
    check_trainer,
    refuse_inexact,
    rollout_config,
    trl_trainer,
)
from torch_impl.layout import check as check_layout

# keys TRL's padding-free collator adds for flash-attention kernels: position_ids carry the same
DROPPED_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _keep_collectives_in_checkpoints(model):
    """Make `model`'s activation checkpointing, when the trainer turns it on (TrainingArguments'
    `activation_checkpointing`, on by default in TRL's SFTConfig), keep what hf.checkpoint_kwargs()
    keeps (the transport's outputs, the attention op's), unless the caller gave its own
    `context_fn` or reentrant checkpointing. The model instance's method is wrapped, as TRL's
    selective checkpointing does: the callable stays out of the (serialised) arguments."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is None:  # not a transformers model: the trainer turns nothing on through it
        return

    def activation_checkpointing_enable(activation_checkpointing_kwargs=None, **kwargs):
        given = dict(activation_checkpointing_kwargs or {})
        if "context_fn" not in given and not given.get("use_reentrant", False):
            given = checkpoint_kwargs() | given
        return enable(activation_checkpointing_kwargs=given, **kwargs)

    model.activation_checkpointing_enable = activation_checkpointing_enable


class ShardSums:
    """The trainer's accelerator where each CP rank's values are its shard's part of a sum over the
    replica's tokens (TRL's SFTTrainer's token counts and its entropy and accuracy sums):
    `gather_for_metrics` sums them over the CP group, then gathers over the dp replicas (the last
    batch cut as accelerate cuts it over dp processes), as the dp-only run's process gathers its
    whole rows' sums; all else the accelerator's own (`world`)."""

    def __init__(self, t):
        self.world, self._t = t.accelerator, t

    def __getattr__(self, name):
        return getattr(self.world, name)

    def gather_for_metrics(self, tensor, use_gather_object=False):
        if use_gather_object or not hasattr(tensor, "shape"):
            raise ValueError(
                "torch_impl.hf: gather_for_metrics of objects is not summed over a replica's CP "
                f"ranks; got {type(tensor).__name__}"
            )
        summed = tensor.detach().clone()
        dist.all_reduce(summed, group=self._t.cp_group)  # the replica's sum
        return self._t._gather_replicas(summed)


class ContextParallelMixin:
    """Context parallelism for a `transformers.Trainer` subclass (TRL's `SFTTrainer` included).

    Put it first: `class CPTrainer(ContextParallelMixin, transformers.Trainer)`. Takes the base
    class's arguments plus `cp_size` (CP ranks per data-parallel replica; it must divide the world
    size) and `cp_layout` ("contiguous" or "head_tail", as `hf.parallelize`). A run over dp x cp
    processes then equals the same trainer over dp processes without CP: logged `loss` and
    `grad_norm`, `evaluate()`'s `eval_loss`, every other metric logged (`num_input_tokens_seen`
    counted once per replica; SFTTrainer's `num_tokens` without the mixin's padding, its entropy
    and token accuracy summed over the CP ranks: ShardSums), the parameters after every step (gradient
    accumulation, padded rows of any length, packed rows, TRL's defaults: bf16 autocast and
    activation checkpointing, which then keeps the transport's and the attention's outputs as
    `hf.checkpoint_kwargs()` does; rows streamed from an IterableDataset with
    `accelerator_config={"dispatch_batches": False}`); TRL's RewardTrainer, DPOTrainer,
    KTOTrainer, GRPOTrainer and RLOOTrainer likewise, every metric they log. Refused with
    ValueError (every rank, before the first step): TRL's other trainers (check_trainer), the
    options that torch_impl.hf.whole_rows.refusal and torch_impl.hf.rl.refusal name, GRPO's and
    RLOO's batches that hold no whole prompt group over the dp replicas (rl.batch_refusal), a sequence
    classification model outside RewardTrainer, accelerate's own CP/SP/TP, FSDP1 and DeepSpeed,
    label smoothing, a `compute_loss_func`, `compute_metrics` and `preprocess_logits_for_metrics`
    (they would see each rank's slice of the logits), a MoE router's auxiliary loss (TRL switches
    it on for MoE models: `router_aux_loss_coef=0.0` turns it off), a model whose forward takes
    no `**kwargs` (a class that takes no loss kwargs is exact: _micro_batch_mean), an
    IterableDataset dispatched from rank 0 (accelerate's default), and `predict()`.
    """

    def __init__(self, *args, cp_size, cp_layout="contiguous", **kwargs):
        if not isinstance(cp_size, int) or cp_size < 1:
            raise ValueError(f"`cp_size` must be a positive int (CP ranks per replica), got {cp_size!r}")
        check_layout(cp_layout)
        check_trainer(type(self))  # before the trainer sets anything up
        trl = trl_trainer(type(self))
        rollouts = trl is not None and trl.__name__ in ROLLOUTS
        if rollouts:
            args, kwargs = rollout_config(trl.__name__, cp_size, args, kwargs)
        # DPO's and KTO's reference log-probs, which TRL's __init__ precomputes: after the model is
        # made CP (_precompute_ref_logps)
        self.cp_deferred = [] if cp_size > 1 else None
        super().__init__(*args, **kwargs)
        world = self.accelerator.num_processes
        if world % cp_size:
            raise ValueError(
                f"`cp_size` ({cp_size}) must divide the number of processes ({world}): the world is dp x cp"
            )
        refuse_inexact(self)
        self.cp_size, self.cp_layout = cp_size, cp_layout
        self.cp_row_loss = trl is not None and trl.__name__ in ROW_LOSSES
        self.cp_whole_row_loss = trl is not None and trl.__name__ in WHOLE_ROWS
        self.cp_whole_rows = False  # whole_rows.as_replicas sets it for the loss
        self.cp_counts_rows = trl is not None and trl.__name__ == "SFTTrainer"  # metrics: ShardSums
        self.cp_rollouts = rollouts
        self.dp_size, self.dp_index = world // cp_size, self.accelerator.process_index // cp_size
        self.cp_rebound = {}  # GRPO's and RLOO's methods that gather, rebound over the replicas
        if rollouts:  # TRL seeds process p with seed + p: a replica's CP ranks as the dp-only process
            from accelerate.utils import set_seed

            set_seed(self.args.seed + self.dp_index)
            self.cp_rebound = rl.rebound(self, trl)
        self.cp_group = None
        if cp_size > 1:
            device = "cuda" if self.args.device.type == "cuda" else "cpu"
            mesh = init_device_mesh(device, (self.dp_size, cp_size), mesh_dim_names=("dp", "cp"))
            self.cp_group = mesh["cp"].get_group()
        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model  # PEFT
        parallelize(model, self.cp_group, layout=cp_layout)
        self.cp_hooks = []  # the handles of whole_rows' hooks on the model and the reference
        if self.cp_whole_row_loss and cp_size > 1:
            self.cp_hooks += whole_rows.hook(self, self.accelerator.unwrap_model(self.model))
        if getattr(self, "ref_model", None) is not None:  # DPO's and KTO's separate reference model
            self._make_cp(self.ref_model)
        _keep_collectives_in_checkpoints(self.model)
        self._precompute_deferred()

    def _make_cp(self, reference):
        """DPO's and KTO's reference model made CP as the policy is, its fused-head calls hooked."""
        parallelize(self.accelerator.unwrap_model(reference), self.cp_group, layout=self.cp_layout)
        if self.cp_whole_row_loss and self.cp_size > 1:
            self.cp_hooks += whole_rows.hook(self, self.accelerator.unwrap_model(reference))

    # --- DPO's and KTO's reference log-probs, precomputed as the training step scores -----------

    def _precompute_ref_logps(self, dataset, name, batch_size):
        """TRL's pass of the reference model over a dataset (`precompute_ref_log_probs`). Called in
        TRL's __init__, before the model is made CP: deferred (the dataset returned as it is, run
        by _precompute_deferred). Under CP: TRL's own pass with the accelerator seen over the dp
        replicas (its loader's rows sharded over them, its gathers over them), the reference's
        fused-head calls sharded over the CP ranks (whole_rows.hook), so that a rank holds one
        shard's activations, as in a training step, not a whole row's."""
        if getattr(self, "cp_deferred", None) is not None:
            self.cp_deferred.append((dataset, name, batch_size))
            return dataset
        if getattr(self, "cp_size", 1) == 1:  # (TRL's __init__ at cp 1: the mixin's part not set yet)
            return super()._precompute_ref_logps(dataset, name, batch_size)
        with whole_rows.as_replicas(self):
            return super()._precompute_ref_logps(dataset, name, batch_size)

    def _precompute_deferred(self):
        """The reference passes TRL's __init__ asked for, each dataset replaced where TRL put it.
        They use the reference as TRL leaves it (`self.ref_model`, or the policy where it is None):
        under FSDP2 without a reference model TRL loaded a copy of the policy from its path for its
        pass and dropped it; the policy, made CP, stands for it (the same weights where the policy
        is that checkpoint's)."""
        deferred, self.cp_deferred = self.cp_deferred, None
        for dataset, name, batch_size in deferred or ():
            done = self._precompute_ref_logps(dataset, name, batch_size)
            if self.train_dataset is dataset:
                self.train_dataset = done
            if isinstance(self.eval_dataset, dict):
                self.eval_dataset = {k: done if v is dataset else v for k, v in self.eval_dataset.items()}
            elif self.eval_dataset is dataset:
                self.eval_dataset = done

    # --- rows: every CP rank of a replica the same ----------------------------------------------

    def get_train_dataloader(self):
        return self._by_replica(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        return self._by_replica(super().get_eval_dataloader(eval_dataset))

    def _by_replica(self, loader):
        """accelerate shards `loader` over every process; make it shard over the dp replicas."""
        if self.cp_size == 1:
            return loader
        sharded = loader.batch_sampler if hasattr(loader.batch_sampler, "process_index") else loader.dataset
        if not hasattr(sharded, "process_index"):
            dispatched = type(loader).__name__ == "DataLoaderDispatcher"
            raise ValueError(
                "torch_impl.hf: the dataloader is not sharded by accelerate's BatchSamplerShard "
                f"or IterableDatasetShard (got {type(loader).__name__}); the CP ranks of a replica could "
                "not be given the same rows"
                + (
                    ": an IterableDataset is read by rank 0 and dispatched to every process by default; "
                    "pass accelerator_config={'dispatch_batches': False}"
                    if dispatched
                    else ""
                )
            )
        sharded.num_processes, sharded.process_index = self.dp_size, self.dp_index
        if self.dp_size == 1:  # as one process, where accelerate does not shard: no batch completed
            sharded.even_batches = False
        return loader

    def get_cp_size(self):
        return self.cp_size

    # --- the loss -----------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.cp_whole_row_loss:  # TRL's DPO, KTO, GRPO, RLOO: the replica's loss on every CP rank
            with whole_rows.as_replicas(self) if self.cp_size > 1 else contextlib.nullcontext():
                whole = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            return whole
        local = self.shard(inputs)
        if self.cp_size == 1 or self.cp_row_loss:  # the replica's loss on every CP rank
            return super().compute_loss(model, local, return_outputs, num_items_in_batch)
        with self._shard_sums() if self.cp_counts_rows else contextlib.nullcontext():
            return self._shard_loss(model, inputs, local, return_outputs, num_items_in_batch)

    def _shard_loss(self, model, inputs, local, return_outputs, num_items_in_batch):
        """compute_loss on this rank's shard `local` of `inputs`: its share of the replica's loss."""
        if model.training:
            if self.model_accepts_loss_kwargs:
                if num_items_in_batch is None:  # each rank's loss would be its own slice's mean
                    raise ValueError(
                        "torch_impl.hf: a training loss without `num_items_in_batch` cannot be made the "
                        "replica's token mean"
                    )
                result = super().compute_loss(model, local, return_outputs, num_items_in_batch)
            else:
                result = self._micro_batch_mean(model, inputs, local, return_outputs)
            if self.cp_counts_rows and "attention_mask" not in inputs and "position_ids" in inputs:
                self._uncount_padding(inputs["position_ids"].shape[1], local["position_ids"].shape[1])
            return result
        # evaluation: every CP rank gives the loss a dp-only run's rank gives for its replica's batch
        result = super().compute_loss(model, local, return_outputs, num_items_in_batch)
        loss, outputs = result if return_outputs else (result, None)
        if num_items_in_batch is None:  # TRL's evaluation: this slice's own mean -> the replica's
            count = (local["shift_labels"] != IGNORE_INDEX).sum()
            both = torch.stack([torch.where(count > 0, loss.detach() * count, 0.0), count.to(loss.dtype)])
            dist.all_reduce(both, group=self.cp_group)  # [the replica's loss sum, its valid labels]
            loss = both[0] / both[1].clamp(min=1)
        else:  # the trainer's: processes x this slice's share -> dp x the replica's share
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=self.cp_group)
            loss = loss / self.cp_size
        return (loss, outputs) if return_outputs else loss

    def _micro_batch_mean(self, model, inputs, local, return_outputs):
        """The loss of a model that takes no loss kwargs (its class sets `accepts_loss_kwargs =
        False`, as Gemma 4's, GLM-4.xV's and Qwen3-VL's do): the trainer gives no count, and the
        dp-only run's loss is each micro-batch's own token mean (divided by the accumulation steps,
        averaged over dp by DDP). On a CP rank: cp x its shard's sum over the micro-batch's count
        of shifted labels (from the replica's whole batch: the same on every CP rank), so that
        DDP's average over dp x cp gives the dp-only run's. The count goes where the loss is
        made: TRL's SFTTrainer's own loss takes it as `num_items_in_batch` (times the processes
        where `average_tokens_across_devices`, which is taken back out); under transformers'
        Trainer, which leaves the loss to the model, the mixin adds the count to the model's
        inputs, and the model's forward must pass its `**kwargs` on to its loss function (every
        such class of the pinned transformers does; a forward without `**kwargs` is refused)."""
        count = (inputs["labels"][:, 1:] != IGNORE_INDEX).sum()  # as shard_batch's shifted labels
        if self.cp_counts_rows:  # SFTTrainer: its own loss from the count
            result = super().compute_loss(model, local, return_outputs, count)
            processes = self.accelerator.num_processes // self.get_tp_size()  # (TRL's factor)
            scale = processes if self.args.average_tokens_across_devices else 1
        else:
            result = super().compute_loss(model, local | {"num_items_in_batch": count}, return_outputs)
            scale = 1
        loss, outputs = result if return_outputs else (result, None)
        loss = loss * (self.cp_size / scale)
        return (loss, outputs) if return_outputs else loss

    @contextlib.contextmanager
    def _shard_sums(self):
        """Within: the trainer's accelerator a ShardSums (TRL's SFTTrainer's metrics: sums over a
        shard's tokens)."""
        before, self.accelerator = self.accelerator, ShardSums(self)
        try:
            yield
        finally:
            self.accelerator = before

    def _uncount_padding(self, S, L):
        """TRL's SFTTrainer counts a padding-free batch's tokens (`num_tokens`) as its processes'
        position_ids lengths: under CP a replica's ranks' L add up to its row padded by the mixin
        (cp L >= S), so the padding is taken back out, summed over the replicas."""
        added = torch.tensor([self.cp_size * L - S], device=self.args.device)
        added = self._gather_replicas(added)  # cut at the last batch as TRL's count is (ShardSums)
        self._total_train_tokens -= int(added.sum()) // self._tp_size
        self._metrics["train"]["num_tokens"] = [self._total_train_tokens]

    def _track_num_input_tokens(self, inputs):
        """The trainer's `num_input_tokens_seen`: the whole batch's tokens, which every CP rank of a
        replica holds, counted once per replica (its gather over the replicas)."""
        with whole_rows.as_replicas(self) if self.cp_size > 1 else contextlib.nullcontext():
            return super()._track_num_input_tokens(inputs)

    def evaluation_loop(self, *args, **kwargs):
        if self.cp_size > 1:
            self.gather_function = self._gather_replicas  # the trainer resets it when the loop ends
        return super().evaluation_loop(*args, **kwargs)

    def _gather_replicas(self, data, cut=True):
        """The trainer's gather of per-batch values [n, ...], over the dp replicas (a replica's CP
        ranks hold the same): one CP rank's values per replica, [dp * n, ...], and where `cut`,
        the last batch cut to the dataset's remainder as accelerate's gather_for_metrics does over
        dp processes."""
        accelerator = self.accelerator
        while isinstance(accelerator, (whole_rows.ReplicaView, ShardSums)):  # the trainer's own
            accelerator = accelerator.world
        gathered = accelerator.gather(data)  # [processes * n, ...], by rank
        replicas = gathered.unflatten(0, (accelerator.num_processes, -1))[:: self.cp_size].flatten(0, 1)
        state = accelerator.gradient_state
        if cut and state.end_of_dataloader and state.remainder > 0:
            replicas = replicas[: state.remainder]
        return replicas

    # --- TRL's GRPO and RLOO: generation as the dp-only run's, scoring on the shards (torch_impl.hf.rl) -----

    def _generate_single_turn(self, *args, **kwargs):
        generated = super()._generate_single_turn(*args, **kwargs)
        if not self.cp_rollouts or self.cp_size == 1:
            return generated
        if isinstance(generated, tuple):  # GRPO's (completion ids, vLLM's log-probs or None)
            return rl.agree(self, generated[0]), generated[1]
        return rl.agree(self, generated)  # the replica's CP ranks: CP rank 0's rows

    def _generate_and_score_completions(self, inputs):
        if not self.cp_rollouts:
            return super()._generate_and_score_completions(inputs)
        with whole_rows.as_replicas(self):
            return self.cp_rebound["_generate_and_score_completions"](inputs)

    def _calculate_rewards(self, *args, **kwargs):
        if not self.cp_rollouts:
            return super()._calculate_rewards(*args, **kwargs)
        return self.cp_rebound["_calculate_rewards"](*args, **kwargs)  # gathered over the replicas

    def shard(self, inputs):
        """This rank's model inputs from the trainer's global batch: TRL's flash-attention keys
        dropped (position_ids carry the documents), the sequence padded at its end to a multiple
        of cp (2 cp for head_tail), then `hf.shard_batch` without its count (the trainer's own,
        over all replicas, is passed). A vision-language collator's images and videos go to
        `hf.shard_batch` as they are (every rank's, torch_impl.hf.media)."""
        inputs = {key: value for key, value in inputs.items() if key not in DROPPED_KEYS}
        batch = {key: inputs.pop(key) for key in BATCH_KEYS + TYPE_KEYS + media.ROW_KEYS if key in inputs}
        whole = {key: inputs.pop(key) for key in media.MEDIA_KEYS if key in inputs}  # images, videos
        S = batch["input_ids"].shape[1]
        multiple = self.cp_size * (2 if self.cp_layout == "head_tail" else 1)
        pad = -S % multiple
        if pad:
            fill = {
                "labels": IGNORE_INDEX,
                "input_ids": self._pad_id(),
                "attention_mask": 0,
                "position_ids": 0,
                **dict.fromkeys(TYPE_KEYS, 0),
            }
            fill |= dict.fromkeys(media.ROW_KEYS, 0)  # [B, S, ...]: padded along S
            batch = {
                key: F.pad(value, (0, 0) * (value.dim() - 2) + (0, pad), value=fill[key])
                for key, value in batch.items()
            }
        local = shard_batch(batch | whole, self.cp_group, layout=self.cp_layout)
        local.pop("num_items_in_batch", None)
        return {**inputs, **local}

    def _pad_id(self):
        pad = getattr(self.processing_class, "pad_token_id", None)
        return 0 if pad is None else pad

    def predict(self, *args, **kwargs):
        raise ValueError(
            "torch_impl.hf: predict() returns logits, which each CP rank holds only a slice of; "
            "use evaluate() for the loss"
        )
