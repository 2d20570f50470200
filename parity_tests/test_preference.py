"""TRL's DPO and KTO losses as ContextParallelMixin computes them (torch_impl.hf.preference:
each row's log-prob through `sum_sequence`, TRL's formulas restated) equal TRL's own
`_compute_loss` in one process (cp_size 1), for every loss type and f-divergence the mixin accepts:
the loss, its gradient and every metric logged. The trainers over CP ranks against the runs
without CP: test_trainer.py. What is not exact is refused in `__init__`.

The bound: TRL's fused LM head computes each token's log-prob in float32 in both paths, from a
float64 model whose norms transformers rounds through float32 and whose attention the mixin's path
sums in another order; a float32 sum over a row's ~40 tokens (and a batch's ~300) rounds in
another order: every value within 64 u32 of the largest magnitude it is built from.
"""

import pytest
import torch
from trl import DPOTrainer, KTOTrainer

from examples.recipes import trainer_data
from parity_tests import bounds, hf_models, trainer_jobs
from torch_impl import hf
from torch_impl.hf.preference import DPO_LOSSES, KTO_LOSSES

U32 = bounds.u(torch.float32)
R = 64 * U32


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


def _both(t, trl_class, batch):
    """(loss, grads, metrics) from TRL's own _compute_loss and from the mixin's, on one batch."""
    results = []
    for compute in (
        lambda: trl_class._compute_loss(t, t.model, batch, False),
        lambda: t.compute_loss(t.model, batch),
    ):
        t.model.zero_grad()
        t._metrics["train"].clear()
        t._total_train_tokens = 0
        loss = compute()
        loss.backward()
        grads = {k: p.grad.clone() for k, p in t.model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads, {k: list(v) for k, v in t._metrics["train"].items()}))
    return results


def _check(got, want, what):
    (loss, grads, metrics), (want_loss, want_grads, want_metrics) = got, want
    bounds.check(abs(loss - want_loss), R * max(abs(want_loss), 1.0), f"{what} loss")
    assert grads.keys() == want_grads.keys(), what
    scale = max(g.abs().max() for g in want_grads.values())
    for key, g in want_grads.items():
        bounds.check((grads[key] - g).abs().max(), R * scale, f"{what} grad {key}")
    assert metrics.keys() == want_metrics.keys(), (what, metrics.keys() ^ want_metrics.keys())
    logps = max(abs(v) for k, vs in want_metrics.items() if k.startswith("logps/") for v in vs)
    for key, values in want_metrics.items():
        for g, w in zip(metrics[key], values, strict=True):
            scale = logps if key.startswith(("rewards/", "kl")) else max(abs(w), 1.0)
            bounds.check(abs(g - w), R * scale, f"{what} {key}")


DPO_VARIANTS = (
    [{"loss_type": [kind]} for kind in DPO_LOSSES]
    + [{"loss_type": ["sigmoid"], "f_divergence_type": kind} for kind in ("forward_kl", "js_divergence")]
    + [{"loss_type": ["sigmoid", "sft", "ipo"], "loss_weights": [1.0, 0.3, 0.5]}]
)


def test_dpo_loss_is_trls_for_every_loss_type(tmp_path):
    t = _trainer("dpo", tmp_path, label_smoothing=0.1)  # exo_pair needs it; robust, aot use it
    t.model.train()
    batch = next(iter(t.get_train_dataloader()))
    for variant in DPO_VARIANTS:
        t.loss_types = variant["loss_type"]
        t.loss_weights = variant.get("loss_weights", [1.0] * len(t.loss_types))
        t.f_divergence_type = variant.get("f_divergence_type", "reverse_kl")
        want, got = _both(t, DPOTrainer, batch)
        _check(got, want, str(variant))


@pytest.mark.parametrize("loss_type", KTO_LOSSES)
def test_kto_loss_is_trls(tmp_path, loss_type):
    t = _trainer("kto", tmp_path, loss_type=loss_type)
    t.model.train()
    want, got = _both(t, KTOTrainer, next(iter(t.get_train_dataloader())))
    _check(got, want, loss_type)


@pytest.mark.parametrize(
    "kind,option,says",
    [
        ("dpo", {"use_weighting": True}, "`use_weighting`"),
        ("dpo", {"ld_alpha": 0.5}, "`ld_alpha`"),
        ("dpo", {"use_liger_kernel": True}, "`use_liger_kernel`"),
    ],
)
def test_what_is_not_exact_is_refused_in_init(tmp_path, kind, option, says):
    with pytest.raises(ValueError, match=f"TRL's DPOTrainer with {says}"):
        _trainer(kind, tmp_path, **option)
