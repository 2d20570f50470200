"""Heads that read one position of a row under CP: *ForSequenceClassification (reward models)
pooled at the row's last real token as one process pools, on every rank; other heads refused."""

import re

import pytest
import torch

from parity_tests.hf import hf_cases

EPS = 2.0**-52


@pytest.mark.parametrize(
    "family,layout,left,grouping",
    [
        ("llama", "contiguous", False, ("block", 2)),
        ("llama", "head_tail", True, ("block", 2)),
        ("mistral", "contiguous", True, ("block", 4)),
        ("mistral", "head_tail", False, ("block", 4)),
    ],
)
def test_sequence_classification_pools_as_one_process(pool, family, layout, left, grouping):
    """Rows padded right or left (row 2's last real token on the first of 2 or 4 ranks under
    contiguous; the model's rule: the last token that is not its pad token): every rank's pooled
    logits are one process's, the ranks' losses and gradients add up to one process's. float64;
    the bound: the attention and the layers summed in another order, a few hundred roundings of
    the largest value involved."""
    for group_results in pool.run(grouping, hf_cases.sequence_classification, family, layout, left):
        for logits, want, loss, want_loss, grads in group_results:
            assert logits.shape == want.shape == (3, 2) and logits.dtype == torch.float64
            check(logits, want, loss, want_loss, grads)


@pytest.mark.parametrize("rows", ["all padding", "no pad token"])
@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
def test_sequence_classification_pools_edge_rows_as_one_process(pool, rows, layout):
    """A row that is all pad tokens (one process pools its position 0, on the first rank) and a
    model without a pad token at batch 1 (one process pools the row's last position, on the last
    rank under contiguous, the first under head_tail), on 2 ranks, to the bounds above."""
    for group_results in pool.run(
        ("block", 2), hf_cases.sequence_classification, "llama", layout, False, rows
    ):
        for logits, want, loss, want_loss, grads in group_results:
            assert logits.shape == want.shape and logits.dtype == torch.float64
            check(logits, want, loss, want_loss, grads)


def check(logits, want, loss, want_loss, grads):
    """The pooled logits, the summed loss and every gradient within the bounds above."""
    assert (logits - want).abs().max() <= 1000 * EPS * want.abs().max(), (logits, want)
    assert abs(loss - want_loss) <= 1000 * EPS * abs(want_loss)
    for key, (got, expected) in grads.items():
        assert (got - expected).abs().max() <= 1e4 * EPS * max(expected.abs().max(), 1e-6), key


@pytest.mark.parametrize("head", ["ForTokenClassification", "ForQuestionAnswering"])
def test_other_heads_are_refused_at_parallelize(pool, head):
    for group_results in pool.run(("block", 2), hf_cases.refused_head, head):
        for message in group_results:
            assert message is not None and "has a head that is not a causal LM's" in message, message
            assert f"Llama{head}" in message


@pytest.mark.parametrize(
    "name", ["DistillationTrainer", "trl.experimental.orpo.ORPOTrainer", "trl.experimental.kto.KTOTrainer"]
)
def test_trl_trainers_not_made_exact_are_refused_in_init(name, monkeypatch):
    """ContextParallelMixin refuses them before the trainer sets anything up, naming the trainer
    (a subclass of one too; trl.experimental's by its module, its KTOTrainer included, which is not
    trl's); SFTTrainer, RewardTrainer, DPOTrainer, KTOTrainer, GRPOTrainer, RLOOTrainer and
    transformers' Trainer pass."""
    import importlib

    import transformers
    import trl

    from torch_impl import hf
    from torch_impl.hf.trainer_checks import check_trainer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    module, _, cls = name.rpartition(".")
    base = getattr(importlib.import_module(module or "trl"), cls)
    said = f"TRL's {base.__module__}.{cls}" if module else f"TRL's {cls}"
    mixed = type("CPTrainer", (hf.ContextParallelMixin, base), {})
    with pytest.raises(ValueError, match=f"{re.escape(said)} is not supported: the mixin was not made exact"):
        mixed(model=None, cp_size=2)
    with pytest.raises(ValueError, match=f"{re.escape(said)} is not supported"):
        check_trainer(type("Mine", (mixed,), {}))
    trainers = (
        trl.SFTTrainer,
        trl.RewardTrainer,
        trl.DPOTrainer,
        trl.KTOTrainer,
        trl.GRPOTrainer,
        trl.RLOOTrainer,
    )
    for cls in (*trainers, transformers.Trainer):
        check_trainer(type("CPTrainer", (hf.ContextParallelMixin, cls), {}))
