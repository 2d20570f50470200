"""torch_impl.hf around the layers: bytes per layer against the analytic minimum, data parallelism,
refusals before any communication, the cross-rank inputs check, and what happens without CP."""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from parity_tests.harness import bounds
from parity_tests.hf import hf_cases, hf_models, zoo
from parity_tests.hf.hf_reference import (
    assert_matches_reference,
    check_bytes,
    hf_bounds,
    layer_kinds,
    packed_reference,
    reference,
    run_reference,
)
from torch_impl import hf
from torch_impl.hf.documents import isolates_documents
from torch_impl.hf.input_checks import check_text

# --- bytes on the wire ------------------------------------------------------------------------


def halo_tokens(dst, halo_size, L):
    """The global tokens of rank dst's halo: [dst*L - h, dst*L), h = min(dst*L, halo_size)."""
    return range(dst * L - min(dst * L, halo_size), dst * L)


def received_tokens(kind, size, r, n, L):
    """How many earlier tokens rank r's layer of this kind reads from its peers."""
    return (n - 1) * L if kind == "full" else len(halo_tokens(r, size - 1, L))


def minimum_bytes(kind, size, r, n, L, B, config, item):
    """{(direction, dtype): bytes} rank r must receive for one layer: the analytic minimum.

    Attention: K and V, over (n-1)*L tokens (full) or its halo of min(r*L, W-1) tokens (sliding);
    their padding mask arrives once per forward for every layer (`mask_bytes`). Conv:
    its input over its halo of min(r*L, K-1) tokens (masked by its sender: no mask travels).
    Backward a rank
    receives the gradients of what it sent: (n-1)*L tokens (full) or its own tokens in later
    ranks' halos.
    """
    if kind == "conv":
        per_token = config.hidden_size * item
    else:
        per_token = 2 * config.num_key_value_heads * config.head_dim * item
    received = received_tokens(kind, size, r, n, L)
    if kind == "full":
        sent = (n - 1) * L
    else:
        sent = sum(r * L <= t < (r + 1) * L for dst in range(r + 1, n) for t in halo_tokens(dst, size - 1, L))
    dtype = "float64" if item == 8 else "float32"
    wanted = {
        ("forward", dtype): B * received * per_token,
        ("backward", dtype): B * sent * per_token,
    }
    return {key: value for key, value in wanted.items() if value}


def mask_bytes(config, r, n, L, B):
    """The padding mask's bytes rank r receives before the first layer: the whole mask (a bool a
    token) once per forward, gathered by the pre-hook for every kind of attention layer."""
    return B * (n - 1) * L if any(kind != "conv" for kind, _ in layer_kinds(config)) else 0


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
            got = res["received"].get(("forward", "inputs", "mask"), 0)
            assert got == mask_bytes(config, r, n, L, 2), (r, got)


@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
def test_k_and_v_travel_in_one_exchange(pool, layout):
    """Gemma 3 on 4 ranks (sliding layers reaching two ranks back, a full one): each attention
    layer makes, forward and backward, the c10d calls of one tensor's exchange of its reach
    (gather_sequence or gather_halo, counted alone on the same ranks), not two; its padding
    mask made no call in the layer."""
    n = 4
    state, batch, *_ = reference("gemma3", "float64")
    config = hf_models.build("gemma3").config
    args = ("gemma3", "float64", state, batch, "eval", layout)
    (group_results,) = pool.run(("first", n), hf_cases.cp_step, *args)
    (alone,) = pool.run(("first", n), hf_cases.exchange_calls, hf_models.SEQ_LEN // n, layout)
    for r, res in enumerate(group_results):
        for index, (kind, size) in enumerate(layer_kinds(config)):
            one = alone[r][None if kind == "full" else size - 1]
            for direction in ("forward", "backward"):
                assert res["calls"].get((direction, index), 0) == one[direction], (r, index, direction)


@pytest.mark.parametrize("name", ["gemma3", "mistral", "llama"])
def test_mask_functions_communicate_nothing(pool, name):
    """The padding travels once, in the pre-hook; the mask functions make no c10d call: some
    models make their masks in an order that differs between processes (Beam and LFM3 iterate over
    a set of layer types), which would pair one rank's gather with another's halo."""
    state, batch, *_ = reference(name, "float64")
    (calls,) = pool.run(("first", 2), hf_cases.mask_function_calls, name, state, batch)
    assert calls == [0, 0]


def test_documents_are_isolated_where_the_model_isolates_them():
    """torch_impl.hf.documents.ISOLATES: GPT-OSS does not isolate packed documents (one process
    attends across them), the other families do; a subclass of a listed class (a user's own) takes
    its entry, a class outside transformers' listed ones none. (`make models` checks every entry
    against one process.)"""
    for name in hf_models.SUPPORTED + hf_models.INDEXED:
        assert isolates_documents([hf_models.build(name).base_model]) is (name != "gpt_oss"), name
    model = hf_models.build("llama")
    mine = type("MyModel", (type(model.base_model),), {})
    model.base_model.__class__ = mine
    assert isolates_documents([model.base_model]) is True
    assert isolates_documents([torch.nn.Linear(1, 1)]) is None


def test_packed_rows_of_an_unlisted_model_are_refused_or_follow_the_override(pool):
    """An unlisted class: packed rows raise on every rank, naming the override; with
    isolate_documents=False, Llama's packed rows attend across documents, as one process does given
    an attention_mask (the packed reference with a mask), and with True they are isolated."""
    n = 2
    across, isolated = packed_reference("llama", with_mask=True), packed_reference("llama")
    (messages,) = pool.run(("first", n), hf_cases.unlisted_packed, "llama", isolated.state, isolated.batch)
    for message in messages:
        assert "isolate_documents=" in message and "UnlistedModel" in message, message
    for ref, isolate in ((across, False), (isolated, True)):
        batch = {k: v for k, v in ref.batch.items() if k != "attention_mask"}
        (group_results,) = pool.run(("first", n), hf_cases.isolated, "llama", ref.state, batch, isolate)
        assert_matches_reference(group_results, ref._replace(batch=batch))


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
            assert message is not None and message.startswith("torch_impl.hf: "), message
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


def test_a_setting_from_the_text_config_is_taken_unless_it_adds_each_ranks_aux_loss():
    """Qwen3-Omni's thinker passes its text config's `output_router_logits` to its model: a setting,
    not an input; but where it is True with a router_aux_loss_coef, each rank would add its own
    shard's load-balancing loss: refused, saying how to turn it off."""
    config = zoo.tiny_config("qwen3_omni_moe_thinker")
    config.text_config.output_router_logits = True
    module = SimpleNamespace(config=config)
    given = {"output_router_logits": True}.get
    config.text_config.router_aux_loss_coef = 0.0
    assert check_text(module, given, ["output_router_logits"]) is None
    config.text_config.router_aux_loss_coef = 0.001
    message = check_text(module, given, ["output_router_logits"])
    assert message and "router_aux_loss_coef=0.0" in message and "each CP rank's own" in message, message


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
    logits as validate=False, which makes no int64 collective there (the padding mask travels
    there either way, once per kind of layer, as bool). The paths are kept on the model."""
    state, batch, *_ = reference("gemma3", "float64")
    n = 2
    runs = {
        v: pool.run(("block", n), hf_cases.inputs_check_traffic, "gemma3", state, batch, v)
        for v in (True, False)
    }
    for checked, unchecked in zip(runs[True], runs[False], strict=True):
        for (before, logits, paths), (before_off, logits_off, _) in zip(checked, unchecked, strict=True):
            checks = [call for call in before if call[1] == "int64"]
            assert checks == [("_allgather_base_", "int64", check_bytes(n))], before
            assert [call for call in before if call[1] != "int64"] == before_off, (before, before_off)
            assert torch.equal(logits, logits_off)
            assert paths == {
                "sliding_attention": "torch_impl.attention",
                "full_attention": "torch_impl.attention",
            }


def test_shard_batch_requires_divisible_length(pool):
    (results,) = pool.run(("first", 4), hf_cases.shard_bad_length)
    for message in results:
        assert message == "the sequence length S=22 must be divisible by the CP size n=4", message


def test_shard_batch_takes_text_token_types_and_refuses_images():
    """A vision-language processor's token types of a text-only batch (all 0) are checked and
    dropped: the shards are the batch's without them. One marking an image or video token, or of
    another shape than input_ids, is refused naming the key."""
    batch = {"input_ids": torch.arange(8).reshape(2, 4), "attention_mask": torch.ones(2, 4, dtype=torch.long)}
    for key in ("token_type_ids", "mm_token_type_ids"):
        local = hf.shard_batch(batch | {key: torch.zeros(2, 4, dtype=torch.long)}, None)
        assert local.keys() == hf.shard_batch(batch, None).keys() and key not in local
        images = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0]])
        with pytest.raises(ValueError, match=rf"`batch\['{key}'\]` marks image or video tokens"):
            hf.shard_batch(batch | {key: images}, None)
        with pytest.raises(ValueError, match=rf"`batch\['{key}'\]` must be \[B, S\]"):
            hf.shard_batch(batch | {key: torch.zeros(2, 3, dtype=torch.long)}, None)


# --- without CP, and other models in the process ----------------------------------------------


def test_without_cp_the_model_is_bit_for_bit_unchanged(pool):
    """parallelize leaves the model untouched at n = 1, and shard_batch gives the same keys as on
    n ranks (but the mark of a shard), whole: the same logits, loss and gradients, bit for bit, as
    the model given them."""
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
        assert group_results == [sorted([*local, "cp_layout"])] * 2  # and the mark of a shard


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


@pytest.mark.parametrize(
    "name,packed,validate,sites",
    [
        ("llama", False, False, []),
        ("llama", False, True, ["torch_impl/validation.py"]),  # the inputs check's all-gather
        ("gemma3", True, False, ["torch_impl/hf/inputs.py"]),  # the documents' reach
        ("gemma3", True, True, ["torch_impl/validation.py", "torch_impl/hf/inputs.py"]),
    ],
)
def test_host_reads_per_forward(pool, name, packed, validate, sites):
    """One forward and backward (train mode, both layouts' worth of chunks: head_tail) reads tensor
    values on the host only where the inputs check or packed documents need it, once each, before
    the first layer; no layer reads any (on a GPU each read would wait for the stream)."""
    ref = packed_reference(name) if packed else reference(name, "float64")
    args = (name, ref.state, ref.batch, validate, "head_tail")
    for library, _ in pool.run(("first", 2), hf_cases.host_reads, *args)[0]:
        assert [site.split(":")[0] for site in library] == sites, library


@pytest.mark.parametrize(
    "name,layout",
    [
        ("llama", "contiguous"),
        ("gemma3", "head_tail"),
        ("qwen3_5", "contiguous"),
        ("lfm2", "head_tail"),
        ("bamba", "contiguous"),
        ("minimax", "head_tail"),
        ("minimax_m3", "head_tail"),
        ("inkling", "contiguous"),
    ],
)
def test_unsharded_calls_run_as_one_process(pool, name, layout):
    """A call that shard_batch did not make (the whole batch on every rank: a forward under
    no_grad in training mode, one with its backward in eval mode, generate with and without a KV
    cache) runs as one process does, to the bit, communicating nothing; a shard called in training
    mode with grad but without its mark (`cp_layout`, as a loop filtering kwargs by the forward's
    signature drops it) is refused on every rank, saying what to pass; a sharded step after it is
    CP again (its logits one process's at its rows)."""
    for group_results in pool.run(("block", 2), hf_cases.unsharded_calls, name, layout):
        for differences, tokens, calls, (sharded, largest), refused in group_results:
            assert differences == {"no grad": 0.0, "logits": 0.0, "loss": 0.0, "grads": 0.0}, differences
            assert refused and "without the mark of a shard (`cp_layout`)" in refused, refused
            assert (
                tokens["cp", True] == tokens["plain", True] and tokens["cp", False] == tokens["plain", False]
            )
            assert tokens["plain", True] == tokens["plain", False]  # the cache changes nothing
            assert calls == 0
            # float64, summed in another order; Inkling scales its queries in float32 (its own
            # code), past log_scaling_n_floor on a rank rounded once more under CP: 4 u32
            relative = 4 * bounds.u(torch.float32) if name == "inkling" else 1e-12
            assert sharded <= relative * largest, (sharded, largest)


def test_the_forward_context_is_built_on_its_own():
    """ModelInputs' context and refusal, called directly on one rank (no process group): packed
    rows give their documents and keep their positions; padded rows their mask by global row and
    the global positions; a shard of another layout is refused, naming both."""
    from functools import partial

    from torch_impl.hf._common import Arguments
    from torch_impl.hf.inputs import ModelInputs, Positions

    model = hf_models.build("llama")
    hook = ModelInputs(
        model.model, owner=0, group=None, layout="contiguous", validate=False, positions=Positions(),
        isolates=True, kinds=None, make_mask=None, indexed=False, chunk=None,
    )  # fmt: skip
    get = Arguments(model.model.forward).get

    packed = hf.shard_batch(hf_models.make_packed_batch(), None)  # (use_cache=False: no cache made)
    context, positions, changes = hook.context(model.model, partial(get, (), packed))
    assert torch.equal(positions, packed["position_ids"]) and changes == {}
    assert context.documents is not None and context.padding is None
    starts = (packed["position_ids"] == 0).cumsum(dim=1) - 1  # each token's document, numbered per row
    assert torch.equal(context.documents.ids - context.documents.ids[:, :1], starts)

    padded = hf.shard_batch(hf_models.make_batch(), None)
    context, positions, _ = hook.context(model.model, partial(get, (), padded))
    assert context.documents is None and torch.equal(context.padding, padded["attention_mask"].bool())
    assert torch.equal(positions, torch.arange(padded["input_ids"].shape[1])[None])

    assert hook.refusal(model.model, partial(get, (), padded), "contiguous") is None
    error = hook.refusal(model.model, partial(get, (), padded), "head_tail")
    assert "layout='head_tail'" in error and "layout='contiguous'" in error
