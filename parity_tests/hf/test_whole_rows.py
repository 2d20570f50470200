"""TRL's DPO and KTO under ContextParallelMixin (torch_impl.hf.whole_rows): a fused LM head call
with whole rows is sharded, and its per-token outputs are gathered back over the row, so that
TRL's own loss runs on every CP rank. Here the gather on integer-valued outputs, both layouts, 2
and 4 ranks, and what is refused in `__init__`; the trainers over CP ranks against their runs
without CP: test_trainer.py.

Rank r of n holds positions [r L, (r+1) L) of a row of S = n L (head_tail: chunks r and 2n-1-r
of L/2). Each output value names its row and global position, so a misrouted position cannot
pass; every rank backpropagates the same cotangent through the gathered row, so each position's
gradient is n times it, on the rank that owns the position, and 0 at the last position (cut).
"""

import types

import pytest
import torch
from trl import DPOTrainer, KTOTrainer
from trl.trainer.utils import FusedCausalLMOutput

from examples.recipes import trainer_data
from parity_tests.hf import hf_models
from parity_tests.trainer import trainer_jobs
from torch_impl import hf
from torch_impl.hf import rl, whole_rows
from torch_impl.layout import ShardPlan

B, L = 2, 4


def gathered_rows(group, layout):
    """On each rank: a shard of every output, gathered to [B, S - 1], checked exactly, forward and
    backward."""
    n, r = group.size(), group.rank()
    S = n * L
    rows = ShardPlan.of(layout, n, r, L).rows(torch.device("cpu"))  # [L]: this rank's positions
    named = rows[None] + 1000 * torch.arange(B)[:, None]  # [B, L]: row b, position p -> 1000 b + p
    log_probs = named.double().requires_grad_()
    mask = named % 3 != 0
    shard = FusedCausalLMOutput(log_probs=log_probs, mean_logits=2.0 * named.double(), label_mask=mask)
    out = whole_rows.gathered(shard, S - 1, group, layout)
    whole = torch.arange(S - 1)[None] + 1000 * torch.arange(B)[:, None]  # [B, S - 1]
    assert torch.equal(out.log_probs, whole.double()), out.log_probs
    assert torch.equal(out.mean_logits, 2.0 * whole.double()), out.mean_logits
    assert torch.equal(out.label_mask, whole % 3 != 0), out.label_mask
    assert out.entropy is None and out.is_top1 is None
    assert out.log_probs.dtype == torch.float64 and out.label_mask.dtype == torch.bool
    assert out.loss.item() == -whole.sum().item() / (whole % 3 != 0).sum().item()  # as TRL's head
    cotangent = torch.arange(1, S)[None].double() * torch.tensor([[1.0], [-2.0]])  # [B, S - 1], every rank
    (out.log_probs * cotangent).sum().backward()
    full = torch.cat([cotangent, torch.zeros(B, 1, dtype=torch.float64)], dim=1)  # [B, S]: last position cut
    assert torch.equal(log_probs.grad, n * full[:, rows]), (log_probs.grad, rows)
    return True


@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
@pytest.mark.parametrize("n", [2, 4])
def test_outputs_gather_in_global_order_and_gradients_return_to_their_owners(pool, n, layout):
    results = pool.run(("block", n), gathered_rows, layout)
    assert all(all(group) for group in results)


def _trainer(kind, tmp_path, **overrides):
    config = {"dpo": trainer_jobs.DPOConfig, "kto": trainer_jobs.KTOConfig}[kind]
    args = config(
        str(tmp_path), **trainer_jobs.trainer.TRAINING | {"bf16": False, "dataset_num_proc": None} | overrides
    )
    cp = type("CP", (hf.ContextParallelMixin, {"dpo": DPOTrainer, "kto": KTOTrainer}[kind]), {})
    return cp(
        model=hf_models.build("llama"),
        ref_model=hf_models.build("llama", seed=1),
        args=args,
        processing_class=trainer_data.tokenizer(),
        train_dataset=trainer_jobs.preference_rows(kind, 8, 0),
        cp_size=1,
    )


@pytest.mark.parametrize("kind,name", [("dpo", "DPOTrainer"), ("kto", "KTOTrainer")])
def test_liger_is_refused_in_init(tmp_path, kind, name):
    with pytest.raises(ValueError, match=f"TRL's {name} with `use_liger_kernel`"):
        _trainer(kind, tmp_path, use_liger_kernel=True)


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_precomputed_reference_log_probs_at_cp_1(tmp_path, kind):
    """cp_size 1: TRL's __init__ runs its reference pass itself (nothing deferred), every row's
    log-probs added to the dataset, as without the mixin."""
    t = _trainer(kind, tmp_path, precompute_ref_log_probs=True)
    assert t.cp_deferred is None
    assert {"ref_chosen_logps", "ref_rejected_logps"} <= set(t.train_dataset.column_names) or (
        "ref_logps" in t.train_dataset.column_names
    ), t.train_dataset.column_names


def test_an_override_below_the_mixin_is_refused(tmp_path):
    """GRPO's methods that gather run as TRL's code with the replicas' gathers: an override in a
    class between the mixin and TRL's would not run, so it is refused, naming it."""
    from trl import GRPOTrainer

    class Mine(GRPOTrainer):
        def _calculate_rewards(self, *args, **kwargs):
            return super()._calculate_rewards(*args, **kwargs)

    t = object.__new__(type("CP", (hf.ContextParallelMixin, Mine), {}))  # (only its class is read)
    t.cp_size, t._gather_replicas = 2, lambda x, cut: x
    with pytest.raises(ValueError, match=r"Mine._calculate_rewards overrides TRL's GRPOTrainer"):
        rl.rebound(t, GRPOTrainer)


def test_prompt_learning_is_refused_in_init(tmp_path):
    """Prompt tuning prepends virtual tokens to the rows the model is given: each rank's shard."""
    from peft import PromptTuningConfig

    args = trainer_jobs.DPOConfig(
        str(tmp_path), **trainer_jobs.trainer.TRAINING | {"bf16": False, "dataset_num_proc": None}
    )
    cp = type("CP", (hf.ContextParallelMixin, DPOTrainer), {})
    with pytest.raises(ValueError, match="TRL's DPOTrainer with a prompt-learning PEFT model"):
        cp(
            model=hf_models.build("llama"),
            args=args,
            processing_class=trainer_data.tokenizer(),
            train_dataset=trainer_jobs.preference_rows("dpo", 8, 0),
            peft_config=PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
            cp_size=1,
        )


def test_as_replicas_nests_and_restores_what_it_found():
    """A nested use keeps the outer view; each restores the accelerator and the switch it found,
    also when the body raises."""
    t = types.SimpleNamespace(accelerator=object(), cp_whole_rows=False)
    own = t.accelerator
    with pytest.raises(RuntimeError, match="in the loss"):
        with whole_rows.as_replicas(t):
            view = t.accelerator
            assert isinstance(view, whole_rows.ReplicaView) and t.cp_whole_rows
            with whole_rows.as_replicas(t):
                assert t.accelerator is view and t.cp_whole_rows
            assert t.accelerator is view and t.cp_whole_rows
            raise RuntimeError("in the loss")
    assert t.accelerator is own and t.cp_whole_rows is False


def test_the_replica_view_reduces_over_the_replicas():
    """ReplicaView at dp 2 x cp 2: its gathers take one CP rank per replica, `reduce` sums them or,
    with reduction="mean", divides that sum by the replicas (TRL 1.16 reduces with "sum" only)."""
    gathered = torch.tensor([[1.0, 10.0], [1.0, 10.0], [3.0, 30.0], [3.0, 30.0]])  # by rank: replica 0, 1

    def replicas(tensor, cut=True):  # the mixin's _gather_replicas over 4 processes, cp 2
        return gathered.unflatten(0, (4, -1))[::2].flatten(0, 1)

    t = types.SimpleNamespace(accelerator=None, dp_index=1, dp_size=2, _gather_replicas=replicas)
    view = whole_rows.ReplicaView(t)
    assert (view.process_index, view.num_processes) == (1, 2)
    assert torch.equal(view.gather(torch.zeros(2)), torch.tensor([[1.0, 10.0], [3.0, 30.0]]))
    assert torch.equal(view.reduce(torch.zeros(2)), torch.tensor([4.0, 40.0]))
    assert torch.equal(view.reduce(torch.zeros(2), reduction="mean"), torch.tensor([2.0, 20.0]))
    assert torch.equal(view.reduce(torch.zeros(2), reduction="mean", scale=0.5), torch.tensor([1.0, 10.0]))


@pytest.mark.parametrize("layout, multiple", [("contiguous", 2), ("head_tail", 4)])
def test_the_mixin_pads_rows_to_the_least_multiple(layout, multiple):
    """ContextParallelMixin.shard pads a batch of S tokens at its end to the least multiple of what
    the layout needs (cp, 2 cp for head_tail) at or above S: labels -100, attention 0, input ids
    the pad token, positions 0; never more (padding is work and memory on every rank)."""
    t = types.SimpleNamespace(cp_size=2, cp_layout=layout, cp_group=None, _pad_id=lambda: 7)
    for S in range(5, 14):
        ids = torch.arange(1, S + 1).expand(2, S)
        batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
        local = hf.ContextParallelMixin.shard(t, batch)
        padded = -(-S // multiple) * multiple
        assert local["input_ids"].shape == (2, padded), (S, local["input_ids"].shape)
        assert torch.equal(local["input_ids"][:, :S], ids) and (local["input_ids"][:, S:] == 7).all()
        assert (local["attention_mask"][:, S:] == 0).all() and (
            local["shift_labels"][:, S - 1 :] == -100
        ).all()
