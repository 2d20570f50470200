"""torch_impl.hf: transformers' own models, made CP, against the same model in one process.

Every model is tiny, random and built from a config (parity_tests.hf_models); the batch is 2 rows of
S = 24 tokens, row 1 right-padded by 5 tokens (labels -100 there). On n ranks, rank r holds the
tokens [r*L, (r+1)*L), L = 24/n, and must give the single-process logits of those rows at every
non-padding position; the ranks' losses add up to the single-process loss and their parameter
gradients add up to its gradients. Every group of the grouping is checked, every rank of each.

Bounds (parity_tests.bounds: c rounding steps of unit roundoff u at a scale): the CP ranks and one
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
padding goes far past them (parity_tests/mutations.py).
"""

import subprocess
import sys
from typing import NamedTuple

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cp_support.minima import indexed_layer_bytes
from parity_tests import bounds, expected, hf_cases, hf_models
from torch_impl import hf


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


def run_reference(model, batch, **kwargs):
    """The model in one process on the whole batch, eval mode (a Reference)."""
    model.eval()
    with Float32Steps() as counted:
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
    forward), or the dense-mask fallback for what it does not compute (hf_models.DENSE says why)."""
    config = hf_models.build(name).config
    kinds = getattr(config, "layer_types", None) or ["attention"] * config.num_hidden_layers
    attentions = sum(kind != "conv" for kind in kinds)
    fused = (
        0 if name in hf_models.DENSE or name in hf_models.INDEXED else attentions * chunks
    )  # indexed: sparse_mla_attention (tested in test_attention)
    for res in results:
        assert res["paths"] == [hf_models.DENSE.get(name)] * attentions, res["paths"]
        assert res["fused_calls"] == fused


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", hf_models.SUPPORTED)
def test_cp_model_equals_one_process_float64(pool, name, n):
    """Row 1 padded on the left, so that every query of it follows padding keys (right padding only
    ever follows a row's queries). Gemma 2 keeps it on the right: its eager attention gives a query
    that sees only padding NaN in one process, which the next layer carries to every row."""
    ref = reference(name, "float64", left=name != "gemma2")
    for group_results in pool.run(("block", n), hf_cases.cp_step, name, "float64", ref[0], ref[1]):
        assert_matches_reference(group_results, ref)
        assert_path(group_results, name)


@pytest.mark.parametrize("name", ["gemma3", "lfm2"])
def test_cp_model_equals_one_process_float32(pool, name):
    ref = reference(name, "float32")
    for group_results in pool.run(("strided", 4), hf_cases.cp_step, name, "float32", ref[0], ref[1]):
        assert_matches_reference(group_results, ref)


@pytest.mark.parametrize("mode", ["train", "train_ac"])
@pytest.mark.parametrize("name", ["gemma3", "lfm2"])
def test_train_mode_and_activation_checkpointing_give_the_same_grads(pool, name, mode):
    ref = reference(name, "float64")
    (group_results,) = pool.run(("first", 4), hf_cases.cp_step, name, "float64", ref[0], ref[1], mode)
    assert_matches_reference(group_results, ref)


def test_compiled_layers_with_activation_checkpointing(pool):
    """inductor + activation checkpointing with hf.checkpoint_kwargs(): the same grads. (With
    transformers' default checkpointing, the compiled recomputation drops rank 0's empty halo
    exchange and its peers wait in theirs: this case would hang until its timeout.)"""
    ref = reference("gemma3", "float64")
    (group_results,) = pool.run(
        ("first", 2), hf_cases.cp_step, "gemma3", "float64", ref[0], ref[1], "train_ac_compiled", timeout=300
    )
    assert_matches_reference(group_results, ref)  # inductor: see below


@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
def test_the_dense_option_keeps_the_models_own_math(pool, layout):
    """parallelize(dense=True): every attention layer on the model's own sdpa over a dense mask (the
    fallback path, for comparison), equal to one process too."""
    ref = reference("mistral", "float64", left=True)
    args = ("mistral", "float64", ref.state, ref.batch, "eval", layout, None, True)
    for group_results in pool.run(("first", 2), hf_cases.cp_step, *args):
        assert_matches_reference(group_results, ref, layout=layout)
        for res in group_results:
            assert res["paths"] == ["parallelize(dense=True)"] * 2 and res["fused_calls"] == 0


# --- DeepSeek Sparse Attention ---------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", hf_models.INDEXED)
def test_indexed_attention_equals_one_process_float64(pool, name, n):
    """DeepSeek V3.2 and GLM-5 (layer 1 reusing layer 0's top-k): the indexer picks 5 of up to 24
    keys, batch 2 with a right-padded row; the CP ranks' logits, loss and gradients equal one
    process's (the indexer's parameters get none in either). One group of ranks (every group of
    the grouping runs in the tests above)."""
    ref = reference(name, "float64")
    config = hf_models.build(name).config
    L, B = hf_models.SEQ_LEN // n, 2
    for group_results in pool.run(("first", n), hf_cases.cp_step, name, "float64", ref[0], ref[1]):
        assert_matches_reference(group_results, ref)
        for r, res in enumerate(group_results):  # bytes: the causal prefix, counted at the c10d calls
            wanted = {("forward", "inputs", "mask"): B * (n - 1) * L}  # the padding mask, once
            wanted[("forward", "inputs", "int64")] = check_bytes(n)
            for i, kind in enumerate(getattr(config, "indexer_types", None) or ["full"] * 2):
                per_row = indexed_layer_bytes(config, n, L, r, 8, indexer=kind == "full")
                for direction in ("forward", "backward"):
                    wanted[(direction, i, "float64")] = B * per_row[("torch_impl", direction)]
            assert {k: v for k, v in res["received"].items() if v} == {k: v for k, v in wanted.items() if v}


@pytest.mark.parametrize("name", hf_models.INDEXED)
def test_indexed_attention_with_left_padding(pool, name):
    """Row 1 padded on the left: every query of it follows the padding, so a query that saw (or
    picked) a padding key would differ from one process, which sees none. (Right padding only
    ever follows a row's queries and cannot tell.)"""
    ref = reference(name, "float64", left=True)
    for group_results in pool.run(("first", 2), hf_cases.cp_step, name, "float64", ref[0], ref[1]):
        assert_matches_reference(group_results, ref)


@pytest.mark.parametrize("mode", ["train_ac", "train_ac_saved"])
@pytest.mark.parametrize("name", hf_models.INDEXED)
def test_indexed_attention_under_activation_checkpointing(pool, name, mode):
    """transformers' checkpointed decoder layers are called without a cache: the latents reach the
    attention as its key and value (torch_impl.hf.indexed.AbsorbedMLA), so recomputation needs
    nothing else; with transformers' checkpointing and with hf.checkpoint_kwargs()."""
    ref = reference(name, "float64")
    for group_results in pool.run(("first", 2), hf_cases.cp_step, name, "float64", ref[0], ref[1], mode):
        assert_matches_reference(group_results, ref)


def test_the_indexer_scores_one_query_block_at_a_time(pool):
    """With blocks of 2 queries, the indexer's float32 scores hold 2 x 16 heads x (r+1)*L keys per
    row (rank 1 of 2: 24 keys), not L = 12 queries' worth."""
    state, batch, *_ = reference("deepseek_v32", "float64")
    (results,) = pool.run(("first", 2), hf_cases.indexer_scores, "deepseek_v32", state, batch, 2)
    assert results == [2 * 2 * 16 * 12, 2 * 2 * 16 * 24]


@pytest.mark.parametrize("layout,n", [("contiguous", 2), ("head_tail", 4)])
def test_the_indexer_in_several_query_blocks_equals_one_process(pool, layout, n):
    """Blocks of 5 query rows (12 or 6 local queries: whole blocks and a partial one), the left-
    padded row: each block's mask, top-k and the attention over it are one process's."""
    ref = reference("deepseek_v32", "float64", left=True)
    args = ("deepseek_v32", "float64", ref.state, ref.batch, "eval", layout, 5)
    for group_results in pool.run(("first", n), hf_cases.cp_step, *args):
        assert_matches_reference(group_results, ref, layout=layout)


# --- the head_tail layout --------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", hf_models.SUPPORTED + hf_models.INDEXED)
def test_head_tail_layout_equals_one_process(pool, name, n):
    """layout="head_tail" in parallelize and shard_batch: rank r holds chunks r and 2n-1-r (C = 6
    or 3 tokens). A left-padded row (every query after padding; Gemma 2: right-padded); Gemma 3's
    window (10) and Mistral's (14) span two to four chunks. Each rank's logits equal one process's
    at its global rows, the losses add up, the summed gradients are one process's."""
    # Gemma 2's eager attention gives its padding queries NaN (every key masked) in one process,
    # which the next layer's values carry to every row: its padding goes on the right
    ref = reference(name, "float64", left=name != "gemma2")
    for group_results in pool.run(
        ("first", n), hf_cases.cp_step, name, "float64", ref[0], ref[1], "eval", "head_tail"
    ):
        assert_matches_reference(group_results, ref, layout="head_tail")
        assert_path(group_results, name, chunks=2)


@pytest.mark.parametrize("name", ["gemma3", "mistral", "lfm2", "deepseek_v32"])
def test_head_tail_packed_sequences_equal_one_process(pool, name):
    """Packed documents under head_tail, 4 ranks: the positions are gathered in global order and
    numbered into documents as one process numbers them."""
    ref = packed_reference(name)
    for group_results in pool.run(
        ("first", 4), hf_cases.cp_step, name, "float64", ref[0], ref[1], "train_ac_saved", "head_tail"
    ):
        assert_matches_reference(group_results, ref, layout="head_tail")


def test_layout_arguments_are_checked_before_any_communication():
    """An unknown layout, or a sequence that head_tail cannot cut into 2n chunks: ValueError."""
    model = hf_models.build("llama")
    with pytest.raises(ValueError, match="`layout` must be one of"):
        hf.parallelize(model, None, layout="zigzag")
    with pytest.raises(ValueError, match="`layout` must be one of"):
        hf.shard_batch(hf_models.make_batch(), None, layout="zigzag")
    with pytest.raises(ValueError, match=r"S=25 must be divisible by 2n = 2 under layout='head_tail'"):
        hf.shard_batch(hf_models.make_batch(seq_len=25), None, layout="head_tail")


# --- packed sequences ------------------------------------------------------------------------


def packed_reference(name, with_mask=False):
    """One process given packed rows (a Reference): position_ids restart at every document (no
    attention_mask: transformers isolates the documents; with one: it does not)."""
    return run_reference(hf_models.build(name), hf_models.make_packed_batch(with_mask), use_cache=False)


@pytest.mark.parametrize(
    "name,n,with_mask",
    [(name, n, False) for name in ("gemma3", "mistral", "llama", "lfm2") for n in (2, 4)]
    + [("gemma2", 2, False), ("deepseek_v32", 2, False), ("llama", 2, True)],
)
def test_packed_sequences_equal_one_process(pool, name, n, with_mask):
    """hf_models.make_packed_batch's documents start mid-shard, on a shard boundary and span shards;
    Mistral's window (14) and Gemma 3's (10) reach across document starts, which must cut them.
    The documents reach the attention as ids made once per forward from the gathered positions
    (Gemma 2: through its dense-mask fallback; DeepSeek V3.2: its indexer and selected attention).
    LFM2's convolutions mix across documents, as in one process. With an attention_mask,
    transformers keeps the whole row causal: so does CP."""
    ref = packed_reference(name, with_mask)
    gathered = 0 if with_mask else 2 * (n - 1) * (hf_models.SEQ_LEN // n) * 8  # B rows of int64 positions
    gathered += check_bytes(n)
    for group_results in pool.run(("first", n), hf_cases.cp_step, name, "float64", ref[0], ref[1]):
        assert_matches_reference(group_results, ref)
        assert_path(group_results, name)
        for res in group_results:  # once per forward, before the layers
            assert res["received"].get(("forward", "inputs", "int64"), 0) == gathered


def test_packed_documents_are_isolated():
    """The packed reference really differs from the same tokens unpacked (the test above is not
    vacuous), and with an attention_mask transformers does not isolate the documents."""
    _, batch, packed, *_ = packed_reference("llama")
    _, _, masked, *_ = packed_reference("llama", with_mask=True)
    model = hf_models.build("llama")
    model.eval()
    plain = model(
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        attention_mask=torch.ones_like(batch["input_ids"]),
    ).logits
    assert torch.equal(masked, plain.detach())
    assert (packed - masked).abs().max() > 1e-3


# --- torch.compile ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,n,backend",
    [
        *[(name, n, "aot_eager") for name in ("gemma3", "lfm2") for n in (2, 4)],
        ("lfm2", 2, "inductor"),  # inductor once (slow compiles); Gemma 3's: with checkpointing, above
    ],
)
def test_compiled_decoder_layers_match_eager(pool, name, n, backend):
    """Every decoder layer (Gemma 3: sliding and full attention; LFM2: short convs and attention)
    compiled with fullgraph=True under CP. aot_eager runs the same kernels: logits to the bit,
    gradients to the float64 rounding of adding a parameter's contributions (at most one per token
    and head) in another order, 2 B*S*H u64. inductor generates its own kernels for the model's
    float32 steps (the RMS norms, the loss): each may round one ulp apart, as between CP and one
    process (hf_bounds)."""
    ref = reference(name, "float64")
    (group_results,) = pool.run(
        ("first", n), hf_cases.compiled_layers, name, ref.state, ref.batch, backend, timeout=300
    )
    B, S = ref.batch["input_ids"].shape
    logits_bound, _, grads_bound = hf_bounds(ref, n)
    if backend == "aot_eager":
        logits_bound, grads_bound = 0.0, 2 * B * S * ref.heads * bounds.u("float64")
    for (eager_logits, eager_grads), (logits, grads) in group_results:
        bounds.check((logits - eager_logits).abs().max(), logits_bound, "logits")
        for key, g in eager_grads.items():
            bounds.check((grads[key] - g).abs().max(), grads_bound * g.abs().max(), f"grad of {key}")


# --- bytes on the wire ------------------------------------------------------------------------


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


def halo_tokens(dst, halo_size, L):
    """The global tokens of rank dst's halo: [dst*L - h, dst*L), h = min(dst*L, halo_size)."""
    return range(dst * L - min(dst * L, halo_size), dst * L)


def minimum_bytes(kind, size, r, n, L, B, config, item):
    """{(direction, dtype): bytes} rank r must receive for one layer: the analytic minimum.

    Attention: K and V, each over (n-1)*L tokens (full) or its halo of min(r*L, W-1) tokens
    (sliding); forward also the padding mask over the same tokens (1 byte each). Conv: its
    input over its halo of min(r*L, K-1) tokens, and forward its padding mask. Backward a rank
    receives the gradients of what it sent: (n-1)*L tokens (full) or its own tokens in later
    ranks' halos.
    """
    if kind == "conv":
        per_token = config.hidden_size * item
    else:
        per_token = 2 * config.num_key_value_heads * config.head_dim * item
    if kind == "full":
        received = sent = (n - 1) * L
    else:
        received = len(halo_tokens(r, size - 1, L))
        sent = sum(r * L <= t < (r + 1) * L for dst in range(r + 1, n) for t in halo_tokens(dst, size - 1, L))
    dtype = "float64" if item == 8 else "float32"
    wanted = {
        ("forward", dtype): B * received * per_token,
        ("forward", "mask"): B * received,
        ("backward", dtype): B * sent * per_token,
    }
    return {key: value for key, value in wanted.items() if value}


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", ["gemma3", "mistral", "lfm2", "llama"])
def test_bytes_per_layer_are_the_analytic_minimum(pool, name, n):
    """Counted at the c10d calls, per decoder layer and rank, forward and backward."""
    state, batch, *_ = reference(name, "float64")
    config = hf_models.build(name).config
    L = hf_models.SEQ_LEN // n
    for group_results in pool.run(("block", n), hf_cases.cp_step, name, "float64", state, batch):
        for r, res in enumerate(group_results):
            for index, (kind, size) in enumerate(layer_kinds(config)):
                got = {(d, dtype): v for (d, i, dtype), v in res["received"].items() if i == index and v}
                assert got == minimum_bytes(kind, size, r, n, L, 2, config, 8), (index, kind, r)


# --- data parallelism -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dp,wrap,global_num_items", [(4, "ddp", False), (2, "ddp", True), (4, "fsdp2", False), (2, "fsdp2", True)]
)
def test_data_parallel_gradients_are_one_process(pool, dp, wrap, global_num_items):
    """8 ranks as dp x cp = 4 x 2 or 2 x 4 (dp != cp, so a DP size read from the CP dimension shows),
    row d of a 4-row batch (row 1 padded: the rows' label counts differ) on replica d; hf.apply_ddp /
    apply_fsdp reduce the gradients to one process's: the mean of the rows' own losses' gradients,
    or with global_num_items the gradient of the whole batch's token mean."""
    batch = hf_models.make_batch(batch=dp)
    ref = run_reference(hf_models.build("llama"), batch)
    if not global_num_items:  # the mean over the rows of each row's own mean
        rows = [
            run_reference(hf_models.build("llama"), {k: v[d : d + 1] for k, v in batch.items()})
            for d in range(dp)
        ]
        ref = ref._replace(grads={key: sum(r.grads[key] for r in rows) / dp for key in ref.grads})
    _, _, grads_bound = hf_bounds(ref, 8)
    (group_results,) = pool.run(
        ("block", 8), hf_cases.data_parallel_grads, "llama", ref.state, batch, dp, wrap, global_num_items
    )
    for r, grads in enumerate(group_results):
        for key, g in ref.grads.items():
            bounds.check(
                (grads[key] - g).abs().max(), grads_bound * g.abs().max(), f"rank {r}'s grad of {key}"
            )


# --- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(hf_models.REFUSED))
def test_unsupported_model_raises_at_parallelize_on_every_rank(pool, name):
    for group_results in pool.run(("block", 2), hf_cases.refuse, name):
        for message, calls, after in group_results:
            assert message is not None and message.startswith("torch_impl.hf.parallelize: "), message
            assert hf_models.REFUSED[name] in message, message
            assert calls == 0 and after == [0.0, 1.0]  # no communication; every rank still in step


@pytest.mark.parametrize(
    "call,says",
    [
        ("kv_cache", ["KV cache"] * 2),
        ("cache_on_rank_1", ["CP ranks [1] rejected their inputs", "KV cache holding tokens"]),
        ("4d_mask", ["4-D masks"] * 2),
        (
            "layout_only_in_shard_batch",
            ["sharded with layout='head_tail' but the model was parallelized"] * 2,
        ),
        (
            "layout_only_in_parallelize",
            ["sharded with layout='contiguous' but the model was parallelized"] * 2,
        ),
    ],
)
def test_calls_that_cannot_be_exact_raise_on_every_rank(pool, call, says):
    """With validation on, a rank whose own inputs pass raises too, naming the rank that failed."""
    state, batch, *_ = reference("llama", "float64")
    for group_results in pool.run(("block", 2), hf_cases.unsupported_call, "llama", state, batch, call):
        for message, want in zip(group_results, says, strict=True):
            assert message is not None and want in message, message


def signature(**fields):
    """The check's description of a rank given the test batch on 2 ranks, with `fields` changed."""
    base = {"batch": 2, "local tokens": 12, "inputs_embeds": 0, "embedding width": 0, "attention_mask": 1}
    base |= {"position_ids": 0, "past_key_values": 0, "use_cache": 0}
    return ", ".join(f"{key}={value}" for key, value in (base | fields).items())


@pytest.mark.parametrize(
    "case,rank_0",
    [
        ("longer_on_rank_0", signature(**{"local tokens": 24})),
        ("fewer_rows_on_rank_0", signature(batch=1)),
        ("mask_on_rank_0_only", signature()),  # rank 1: attention_mask=0
        ("embeds_on_rank_0_only", signature(inputs_embeds=1, **{"embedding width": 32})),
        ("wider_embeds_on_rank_0", signature(inputs_embeds=1, **{"embedding width": 33})),
        ("positions_on_rank_0_only", signature(position_ids=1)),
        ("cache_on_rank_0_only", signature(past_key_values=1)),
        ("use_cache_on_rank_0_only", signature(use_cache=1)),
    ],
)
def test_ranks_given_different_inputs_raise_on_every_rank(pool, case, rank_0):
    """On by default (no environment variable): one all-gather of each rank's input signature at
    the model's first hook turns a hang, a gloo abort or inconsistent shards into a ValueError on
    both ranks, naming what differs: each of its 8 fields alone (a field the check did not compare
    would let the ranks run on, into a hang or wrong logits)."""
    state, batch, *_ = reference("llama", "float64")
    for group_results in pool.run(("block", 2), hf_cases.mismatched_inputs, "llama", state, batch, case):
        for message in group_results:
            assert message is not None and "CP ranks were given different inputs" in message, message
            assert f"rank 0: {rank_0};" in message or message.endswith(f"rank 0: {rank_0}"), message


def test_the_inputs_check_is_one_small_collective_and_can_be_turned_off(pool):
    """validate=True (the default): one all-gather of 9 int64s before the first layer, and the same
    logits as validate=False, which makes no collective there. The paths are kept on the model."""
    state, batch, *_ = reference("gemma3", "float64")
    n = 2
    runs = {
        v: pool.run(("block", n), hf_cases.inputs_check_traffic, "gemma3", state, batch, v)
        for v in (True, False)
    }
    for checked, unchecked in zip(runs[True], runs[False], strict=True):
        for (before, logits, paths), (before_off, logits_off, _) in zip(checked, unchecked, strict=True):
            assert before == [("_allgather_base_", check_bytes(n))] and before_off == []
            assert torch.equal(logits, logits_off)
            assert paths == {
                "sliding_attention": "torch_impl.attention",
                "full_attention": "torch_impl.attention",
            }


def test_shard_batch_requires_divisible_length(pool):
    (results,) = pool.run(("first", 4), hf_cases.shard_bad_length)
    for message in results:
        assert message == "the sequence length S=22 must be divisible by the CP size n=4", message


# --- without CP, and other models in the process ----------------------------------------------


def test_without_cp_the_model_is_bit_for_bit_unchanged(pool):
    """parallelize leaves the model untouched at n = 1, and shard_batch gives the same keys as on
    n ranks, whole: the same logits, loss and gradients, bit for bit, as the model given them."""
    state, batch, *_ = reference("gemma3", "float64")
    model, local = hf_models.build("gemma3"), hf.shard_batch(batch, None)
    assert hf.parallelize(model, None) is model and model.config._attn_implementation == "sdpa"
    assert local.keys() == batch.keys() | {"use_cache", "shift_labels", "num_items_in_batch"}
    assert all(torch.equal(local[k], batch[k]) for k in batch)
    model.load_state_dict(state)
    model.eval()
    out = model(**local)
    out.loss.backward()
    assert abs(out.loss - reference("gemma3", "float64")[3]) <= 1e-12  # shift_labels: the same targets
    for ((same, got_local, logits, loss, grads),) in pool.run(
        ("block", 1), hf_cases.without_cp, "gemma3", state, batch
    ):
        assert same and got_local.keys() == local.keys()
        assert torch.equal(logits, out.logits) and torch.equal(loss, out.loss)
        assert all(torch.equal(grads[k], p.grad) for k, p in model.named_parameters())
    for group_results in pool.run(("block", 2), hf_cases.local_keys, batch):
        assert group_results == [sorted(local)] * 2


def test_another_model_in_the_process_is_unaffected(pool):
    """Each rank parallelizes one Gemma 3 and runs a second, untouched one: bit for bit as before."""
    state, batch, logits, *_ = reference("gemma3", "float64")
    for group_results in pool.run(("block", 2), hf_cases.other_model_unaffected, "gemma3", state, batch):
        for before, after, implementation in group_results:
            assert torch.equal(before, logits) and torch.equal(after, logits) and implementation == "sdpa"


def test_the_core_imports_without_the_optional_extras():
    """`import torch_impl` needs torch only: transformers and jax stay unimported (and may be absent)."""
    code = (
        "import sys\n"
        "class Absent:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('transformers', 'jax'):\n"
        "            raise ImportError(f'{name} is not installed')\n"
        "sys.meta_path.insert(0, Absent())\n"
        "import torch_impl, torch_impl.attention, torch_impl.layout\n"
        "torch_impl.gather_sequence\n"
        "try:\n"
        "    import torch_impl.hf\n"
        "except ImportError as e:\n"
        "    print('hf:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "hf: transformers is not installed", out.stdout
