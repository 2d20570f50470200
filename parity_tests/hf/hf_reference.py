"""One process's run of a tiny transformers model, what the CP ranks are compared with, and the
bounds of that comparison (the hf tests: test_hf, test_hf_indexed, test_hf_inputs).

Bounds (parity_tests.harness.bounds: c rounding steps of unit roundoff u at a scale): the CP ranks and one
process compute the same function in another order, so they differ only where a rounding step sees
different bits. transformers rounds float64 models through float32 in places (its RMS norms cast to
float32; DeepSeek's router and indexer, and the loss, compute in float32): a float32 step whose input
differs in its last float64 bits, or that sums in another order (a float32 matmul blocked for B*L rows
instead of B*S), may give a value one float32 ulp apart. `float32_steps` counts those steps in the
model's own forward (its float64 -> float32 casts); each may move the logits by up to 2 u32 of their
largest entry, and each layer's float64 attention sums up to S keys in another order: logits to
2 (steps u32 + layers S u64) max|logits|. float32 models: every step rounds in float32. The loss is
a float32 sum of B*S token terms (each rank sums its own, the host adds the ranks' shares): within
2 (B*S + n) u32 of itself, plus twice the logits' bound (a token's loss moves at most twice as far as
its logits). Gradients pass back through the same float32 steps, and some weight gradients are float32
sums over every token and head (Gemma's norms scale in float32, per head for q/k; DeepSeek's router
per token): to 2 (steps + B*S*H) u32 of each parameter's largest entry (float32 models: plus the
attention's reordered sums). Measured (CP_TEST_MARGINS=1): every hf comparison at 0.09 of its bound
or less, most below 0.02; a misrouted token, a window or document boundary moved by one, or dropped
padding goes far past them (tools/mutations.py).
"""

from contextlib import nullcontext
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parity_tests.harness import bounds, expected
from parity_tests.hf import hf_models
from parity_tests.hf.zoo_cases import Float64Steps, document_spans, each_document_alone, isolates_recurrences


def check_bytes(n):
    """What the model's cross-rank input check receives: 9 int64s (a verdict and 8 fields) a peer."""
    return (n - 1) * 9 * 8


class Reference(NamedTuple):
    """One process's run of a model: what the CP ranks are compared with, and what bounds them."""

    state: dict
    batch: dict
    logits: torch.Tensor
    loss: torch.Tensor
    grads: dict
    float32_steps: int  # the float64 -> float32 casts in its forward (0 for a float32 model)
    layers: int
    heads: int


class Float32Steps(TorchDispatchMode):
    """Counts the float64 -> float32 casts of a forward: the steps where a float64 model rounds
    to float32 (RMS norms, rotary tables, a router, an indexer, the loss)."""

    steps = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and args[0].dtype == torch.float64:
            self.steps += kwargs.get("dtype") == torch.float32
        return func(*args, **kwargs)


def float64_steps(model):
    """Where a float64 model has linear-attention layers, zoo_cases.Float64Steps: their chunked
    kernels compute in float32, and a float32 recurrence rounded in another order is within no
    bound relative to a gradient that sums to near zero (dt_bias'); both runs keep those steps in
    float64, as the model sweep does (float32 recurrences: test_recurrent's bound). Else nothing."""
    types = getattr(model.config, "layer_types", None) or ()
    recurrent = model.dtype == torch.float64 and "linear_attention" in types
    return Float64Steps() if recurrent else nullcontext()


def run_reference(model, batch, **kwargs):
    """The model in one process on the whole batch, eval mode (a Reference)."""
    model.eval()
    with float64_steps(model), Float32Steps() as counted:
        out = model(**batch, **kwargs)
        out.loss.backward()
    grads = {key: p.grad for key, p in model.named_parameters()}
    config = model.config
    return Reference(
        model.state_dict(),
        batch,
        out.logits.detach(),
        out.loss.detach(),
        grads,
        counted.steps,
        config.num_hidden_layers,
        config.num_attention_heads,
    )


def reference(name, dtype, **batch_options):
    return run_reference(hf_models.build(name, getattr(torch, dtype)), hf_models.make_batch(**batch_options))


def hf_bounds(ref, n):
    """(logits abs, loss abs, grads relative to each parameter's largest entry): the module
    docstring's bounds."""
    float64 = ref.logits.dtype == torch.float64
    B, S = ref.batch["input_ids"].shape
    steps = ref.float32_steps
    reorder = ref.layers * S  # each layer's attention sums up to S keys in another order
    if float64:
        logits = 2 * (steps * bounds.u("float32") + reorder * bounds.u("float64"))
    else:
        logits = 2 * (steps + reorder) * bounds.u("float32")
    logits *= ref.logits.abs().max().item()
    loss = 2 * (B * S + n) * bounds.u("float32") * abs(ref.loss.item()) + 2 * logits
    heads = ref.heads  # a float32 weight gradient sums over every token and head
    grads = 2 * (steps + (0 if float64 else reorder) + B * S * heads) * bounds.u("float32")
    return logits, loss, grads


def assert_matches_reference(results, ref, layout="contiguous"):
    batch, logits, loss, grads = ref.batch, ref.logits, ref.loss, ref.grads
    n = len(results)
    logits_bound, loss_bound, grads_bound = hf_bounds(ref, n)
    L = logits.shape[1] // n
    valid = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
    for r, res in enumerate(results):
        assert res["logits"].shape == (2, L, hf_models.VOCAB) and res["logits"].dtype == logits.dtype
        shard = expected.local_tokens(n, L, r, layout)  # the global rows of rank r's
        diff = (res["logits"] - logits[:, shard]).abs()[valid[:, shard]]
        bounds.check(diff.max(), logits_bound, f"rank {r}'s logits")
    total = sum(res["loss"] for res in results)
    bounds.check(abs(total - loss), loss_bound, "the ranks' losses added")
    for key, g in grads.items():
        if g is None:  # not trained (DeepSeek Sparse Attention's indexer)
            assert all(res["grads"][key] is None for res in results), key
            continue
        summed = sum(res["grads"][key] for res in results)
        bounds.check((summed - g).abs().max(), grads_bound * g.abs().max(), f"grad of {key}")


def assert_path(results, name, chunks=1):
    """Which math ran: torch_impl.attention in every attention layer (one call per local chunk,
    forward; DeepSeek Sparse Attention's sparse_mla_attention, tested in test_sparse_mla), none on
    the dense-mask fallback."""
    config = hf_models.build(name).config
    kinds = getattr(config, "layer_types", None) or ["attention"] * config.num_hidden_layers
    attentions = sum(kind not in ("conv", "linear_attention") for kind in kinds)
    fused = 0 if name in hf_models.INDEXED else attentions * chunks
    for res in results:
        assert res["paths"] == [None] * attentions, res["paths"]
        assert res["fused_calls"] == fused


def packed_reference(name, with_mask=False):
    """One process given packed rows (a Reference): position_ids restart at every document (no
    attention_mask: transformers isolates the documents; with one: it does not). A model with
    recurrent layers runs each document alone (zoo_cases.each_document_alone): CP starts each
    document's state from zero, where transformers' torch kernels carry it across."""
    model, batch = hf_models.build(name), hf_models.make_packed_batch(with_mask)
    if with_mask or not isolates_recurrences(model):
        return run_reference(model, batch, use_cache=False)
    model.eval()
    with float64_steps(model), Float32Steps() as counted:
        logits, loss = each_document_alone(model, batch)
        loss.backward()
    grads = {key: p.grad for key, p in model.named_parameters()}
    forwards = sum(len(spans) for spans in document_spans(batch["position_ids"]))
    config = model.config
    return Reference(
        model.state_dict(),
        batch,
        logits.detach(),
        loss.detach(),
        grads,
        -(-counted.steps // forwards),  # a token's logits pass through one forward's float32 steps
        config.num_hidden_layers,
        config.num_attention_heads,
    )


def layer_kinds(config):
    """Per decoder layer: ("full", None), ("sliding", W) or ("conv", K)."""
    kinds = []
    for i in range(config.num_hidden_layers):
        kind = config.layer_types[i] if getattr(config, "layer_types", None) else None
        if kind == "conv":
            kinds.append(("conv", config.conv_L_cache))
        elif kind == "sliding_attention" or (kind is None and getattr(config, "sliding_window", None)):
            kinds.append(("sliding", config.sliding_window))
        else:
            kinds.append(("full", None))
    return kinds
