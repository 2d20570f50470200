"""torch_impl.hf: transformers' own models, made CP, against the same model in one process.

Every model is tiny, random and built from a config (parity_tests.hf.hf_models); the batch is 2 rows of
S = 24 tokens, row 1 padded by 5 tokens (labels -100 there). On n ranks, rank r holds the tokens
[r*L, (r+1)*L), L = 24/n (head_tail: chunks r and 2n-1-r), and must give the single-process logits
of those rows at every non-padding position; the ranks' losses add up to the single-process loss
and their parameter gradients add up to its gradients, to the bounds of parity_tests.hf.hf_reference.
Every group of the grouping is checked, every rank of each.
"""

import pytest
import torch

from parity_tests.harness import bounds, expected
from parity_tests.hf import hf_cases, hf_models
from parity_tests.hf.hf_reference import (
    assert_matches_reference,
    assert_path,
    check_bytes,
    hf_bounds,
    layer_kinds,
    packed_reference,
    reference,
)
from torch_impl import hf


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
@pytest.mark.parametrize("name", ["gemma3", "lfm2", "qwen3_5"])
def test_train_mode_and_activation_checkpointing_give_the_same_grads(pool, name, mode):
    ref = reference(name, "float64")
    (group_results,) = pool.run(("first", 4), hf_cases.cp_step, name, "float64", ref[0], ref[1], mode)
    assert_matches_reference(group_results, ref)


@pytest.mark.slow  # inductor compiles the layers (about 80 s): `make test-all`
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


def test_attention_dropout_falls_back_in_train_mode_only(pool):
    """A layer with attention dropout runs torch_impl.attention in eval mode and the model's own
    math on a dense mask in train mode (the fused math applies no dropout); the plan says so."""
    batch = hf_models.make_batch()
    for paths, (eval_calls, train_calls) in pool.run(("first", 2), hf_cases.dropout_calls, batch)[0]:
        assert eval_calls == 2 and train_calls == 0, (eval_calls, train_calls)
        assert "in train mode a dense [L, T] mask (attention dropout 0.1)" in str(paths), paths


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


@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
@pytest.mark.parametrize("name", hf_models.SUPPORTED + hf_models.INDEXED)
def test_packed_sequences_equal_one_process(pool, name, layout):
    """Every family on packed rows (hf_models.DOCUMENTS: documents starting mid-shard and on a
    shard edge, one spanning three shards, one-token ones), 4 ranks, training with activation
    checkpointing (hf.checkpoint_kwargs()). Each layer fetches only its chunks' documents' reach
    (full layers too); Mistral's window (14) and Gemma 3's (10) reach across document starts,
    which must cut them. The documents reach the attention as ids made once per forward from the
    gathered positions (Gemma 2, GPT-OSS: through the dense-mask fallback; DeepSeek V3.2, GLM-5:
    the indexer and the selected attention). Recurrent layers and LFM2's convolutions keep each
    document apart: against each document alone."""
    ref = packed_reference(name)
    for group_results in pool.run(
        ("first", 4), hf_cases.cp_step, name, "float64", ref.state, ref.batch, "train_ac_saved", layout
    ):
        assert_matches_reference(group_results, ref, layout=layout)


@pytest.mark.parametrize("name,with_mask", [("gemma3", False), ("deepseek_v32", False), ("llama", True)])
def test_packed_sequences_on_two_ranks(pool, name, with_mask):
    """Two ranks, eval: the positions travel once per forward, before the layers, and the documents'
    starts are found once per forward too (the CPU tiles plan from them and scan no ids). With an
    attention_mask transformers keeps the whole row causal: so does CP."""
    n = 2
    ref = packed_reference(name, with_mask)
    gathered = 0 if with_mask else 2 * (n - 1) * (hf_models.SEQ_LEN // n) * 8  # B rows of int64 positions
    gathered += check_bytes(n)
    for group_results in pool.run(("first", n), hf_cases.cp_step, name, "float64", ref[0], ref[1]):
        assert_matches_reference(group_results, ref)
        assert_path(group_results, name)
        for res in group_results:
            assert res["received"].get(("forward", "inputs", "int64"), 0) == gathered
            assert res["id_scans"] == 0, res["id_scans"]


def document_reach(start):
    """How far back from global row `start` the document holding it began, the most over the packed
    batch's rows: brute force over hf_models.DOCUMENTS."""
    reach = 0
    for lengths in hf_models.DOCUMENTS:
        ends = [sum(lengths[: i + 1]) for i in range(len(lengths))]
        first = max([0] + [e for e in ends if e <= start])
        reach = max(reach, start - first)
    return reach


@pytest.mark.parametrize(
    "name,layout", [("gemma3", "contiguous"), ("gemma3", "head_tail"), ("lfm2", "contiguous")]
)
def test_packed_rows_move_only_their_documents_reach(pool, name, layout):
    """On packed rows each attention layer's chunk receives, forward, the K and V of its window back
    to the start of the document holding its first token (full layers too: no gather), and,
    backward, the gradients of what it lent; LFM2's convolutions their K - 1 tokens. Counted at the
    c10d calls, per layer and rank, against the documents' brute-force minimum."""
    n, B = 4, len(hf_models.DOCUMENTS)
    ref = packed_reference(name)
    config, L = hf_models.build(name).config, hf_models.SEQ_LEN // n
    C = L if layout == "contiguous" else L // 2
    owner = {t: r for r in range(n) for t in expected.local_tokens(n, L, r, layout)}
    for group_results in pool.run(
        ("block", n), hf_cases.cp_step, name, "float64", ref.state, ref.batch, "eval", layout
    ):
        for index, (kind, size) in enumerate(layer_kinds(config)):
            if kind == "conv":
                per_token, reach = config.hidden_size * 8, lambda s, K=size: min(s, K - 1)
            else:
                per_token = 2 * config.num_key_value_heads * config.head_dim * 8
                reach = lambda s, W=size: min(document_reach(s), s if W is None else W - 1)  # noqa: E731
            windows = [  # per rank, per chunk: the global rows of its window
                [range(s - reach(s), s) for s in expected.local_tokens(n, L, r, layout)[::C]]
                for r in range(n)
            ]
            for r, res in enumerate(group_results):
                got = {(d, dtype): v for (d, i, dtype), v in res["received"].items() if i == index and v}
                received = sum(owner[t] != r for w in windows[r] for t in w)
                lent = sum(owner[t] == r for q in range(n) if q != r for w in windows[q] for t in w)
                want = {
                    ("forward", "float64"): B * received * per_token,  # a conv: its inputs only
                    ("backward", "float64"): B * lent * per_token,
                }
                assert got == {k: v for k, v in want.items() if v}, (index, kind, r, got, want)


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


@pytest.mark.parametrize("name", ["qwen3_5", "bamba", "qwen4_ple"])
def test_one_rank_keeps_packed_documents_apart_in_recurrent_layers(name):
    """Without CP (`parallelize` with no group), a model with recurrent layers is given only the
    documents' isolation: on packed rows, training with activation checkpointing
    (hf.checkpoint_kwargs()), it equals each document alone (logits, loss, every gradient), which
    one process through transformers' torch kernels does not; padded rows and generation are
    the model's own, to the bit. Bounds: the sweep's float64 ones (zoo_cases), both sides
    keeping the model's float32 steps in float64."""
    import copy

    from parity_tests.hf.zoo_cases import Float64Steps, each_document_alone, float64_recompute

    model = hf_models.build(name)
    alone, plain = copy.deepcopy(model), copy.deepcopy(model)
    hf.parallelize(model, None, verbose=False)
    assert "each packed document from zero" in str(model.cp_transport_paths)
    model.train()
    kwargs = float64_recompute(hf.checkpoint_kwargs())  # recomputed as the forward ran
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    batch = hf_models.make_packed_batch()
    with Float64Steps():
        ref_logits, ref_loss = each_document_alone(alone, batch)
        ref_loss.backward()
        out = model(**hf.shard_batch(batch, None))
        out.loss.backward()
        packed = plain(**batch, use_cache=False).logits
    (B, S), config, u = batch["input_ids"].shape, model.config, bounds.u("float64")
    scale = ref_logits.abs().max()
    bounds.check(
        (out.logits - ref_logits).abs().max(),
        2 * config.num_hidden_layers * (S + config.hidden_size) * u * scale,
        "logits",
    )
    assert (packed - ref_logits).abs().max() > 1e-3 * scale  # transformers' kernels mix the documents
    bounds.check(abs(out.loss - ref_loss), 2 * (B * S + 1) * u * abs(ref_loss), "loss")
    grads = {key: p.grad for key, p in alone.named_parameters()}
    largest = max(g.abs().max() for g in grads.values() if g is not None)
    bound = 2 * (B * S * config.num_attention_heads + config.num_hidden_layers * S) * u * largest
    for key, p in model.named_parameters():
        if grads[key] is not None:
            bounds.check((p.grad - grads[key]).abs().max(), bound, f"grad of {key}")
    padded = hf_models.make_batch()
    # padded rows under transformers' own checkpointing (no hf.checkpoint_kwargs()): recomputed as
    # the forward ran, the model's own kernels, with the untouched model's gradients
    model.zero_grad()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    plain.train()
    plain.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    fresh = hf.parallelize(copy.deepcopy(plain), None, verbose=False)  # no packed forward before
    fresh.zero_grad()
    for each in (fresh, plain):
        each(**padded).loss.backward()
    for (key, p), q in zip(fresh.named_parameters(), plain.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), key  # (an expert no token chose: None)
        assert p.grad is None or torch.equal(p.grad, q.grad), key
    model.eval()
    plain.eval()
    with torch.no_grad():
        assert torch.equal(model(**padded).logits, plain(**padded).logits)
        prompt = padded["input_ids"][:1, :8]
        generated = model.generate(prompt, max_new_tokens=3, do_sample=False)
        assert torch.equal(generated, plain.generate(prompt, max_new_tokens=3, do_sample=False))


def test_packed_documents_recomputed_without_their_context_raise():
    """Activation checkpointing without hf.checkpoint_kwargs() recomputes a layer after the
    forward's documents are gone: a recurrent layer that saw them raises, naming the kwargs, rather
    than mix the documents in backward."""
    model = hf.parallelize(hf_models.build("qwen3_5"), None, verbose=False)
    model.train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    out = model(**hf.shard_batch(hf_models.make_packed_batch(), None))
    with pytest.raises(ValueError, match=r"without hf.checkpoint_kwargs\(\)"):
        out.loss.backward()


# --- torch.compile ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,n,backend",
    [
        ("gemma3", 4, "aot_eager"),  # windows reaching two shards back: halos from two peers
        ("lfm2", 2, "aot_eager"),
        pytest.param("lfm2", 2, "inductor", marks=pytest.mark.slow),  # Gemma 3's: with checkpointing, above
        ("lfm2", 2, "aot_eager_packed_ac"),  # packed rows, checkpointing (the conv hooks keep no state)
        ("gemma2", 2, "aot_eager"),  # soft-capped tiles
        ("gpt_oss", 2, "aot_eager"),  # sinks, a parameter through the attention's autograd.Function
        # Mamba2: the module's own forward over the CP functions (Qwen3.5's Gated DeltaNet fails
        # under aot_eager in one process too, a view in its compiled backward: test_train compiles
        # it with inductor; Jamba's MoE routing has no full graph in one process either)
        ("bamba", 2, "aot_eager"),
    ],
)
def test_compiled_decoder_layers_match_eager(pool, name, n, backend):
    """Every decoder layer (Gemma 3: sliding and full attention; LFM2: short convs and attention)
    compiled with fullgraph=True under CP. aot_eager runs the same kernels: logits to the bit,
    gradients to the float64 rounding of adding a parameter's contributions (at most one per token
    and head) in another order, 2 B*S*H u64. inductor generates its own kernels for the model's
    float32 steps (the RMS norms, the loss): each may round one ulp apart, as between CP and one
    process (hf_bounds)."""
    packed = backend == "aot_eager_packed_ac"  # inside torch.compile layers take their whole window
    ref = packed_reference(name) if packed else reference(name, "float64")
    backend = "aot_eager" if packed else backend
    (group_results,) = pool.run(
        ("first", n), hf_cases.compiled_layers, name, ref.state, ref.batch, backend, packed, timeout=300
    )
    B, S = ref.batch["input_ids"].shape
    logits_bound, _, grads_bound = hf_bounds(ref, n)
    if backend == "aot_eager":
        logits_bound, grads_bound = 0.0, 2 * B * S * ref.heads * bounds.u("float64")
    for (eager_logits, eager_grads), (logits, grads) in group_results:
        bounds.check((logits - eager_logits).abs().max(), logits_bound, "logits")
        for key, g in eager_grads.items():
            bounds.check((grads[key] - g).abs().max(), grads_bound * g.abs().max(), f"grad of {key}")


@pytest.mark.parametrize("name", ["qwen3_5", "bamba", "jamba"])
def test_a_checkpoint_saved_under_cp_loads_as_the_plain_model(pool, name, tmp_path):
    """A recurrent layer made CP keeps its parameters (its forward is its class's own, over CP
    functions): save_pretrained after a step writes the plain model's keys, and from_pretrained
    of the plain class gives back every tensor."""
    for reloaded, trained, equal in pool.run(("first", 2), hf_cases.saved_and_reloaded, name, str(tmp_path))[
        0
    ]:
        assert reloaded == trained and equal
