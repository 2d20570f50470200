"""What each gloo rank runs for the hf tests: a tiny transformers model made CP by torch_impl.hf."""

from contextlib import nullcontext

import torch
import torch.distributed as dist
from transformers import DynamicCache

from cp_support.traffic import PayloadCounter, tag_layers
from parity_tests.hf import hf_models, zoo_cases
from parity_tests.hf.hf_reference import float64_steps
import torch_impl
from torch_impl import hf
from torch_impl.attention import plan as tile_plan
from torch_impl.hf import attention as hf_attention
from torch_impl.hf.indexed import BlockedIndexer
from torch_impl.layout import ShardPlan


def cp_step(
    group,
    name,
    dtype,
    state,
    batch,
    mode="eval",
    layout="contiguous",
    query_block=None,
    dense=False,
    **more,
):
    """One forward and backward of the CP model on this rank's shard.

    mode: "eval"; "train" (model.train()); "train_ac" (train + transformers' activation
    checkpointing); "train_ac_saved" (train, checkpointing with hf.checkpoint_kwargs());
    "train_ac_compiled" (that, and every decoder layer compiled by inductor with fullgraph=True).
    layout: the sequence layout given to parallelize and shard_batch. query_block: the indexer's
    query rows a block (DeepSeek Sparse Attention; default BlockedIndexer's). dense: parallelize's
    option (every attention layer on the model's own math); more: parallelize's other options.
    Returns logits, loss, every parameter's grad (this rank's partial sum), which math each
    attention layer took (`paths`: None for torch_impl.attention, else why it kept the dense mask)
    and how many calls reached torch_impl.attention (and how many times the CPU tiles scanned
    document ids for their starts: `id_scans`), and in eval mode the bytes received per
    (direction, layer) and dtype, counted at the c10d calls, and the calls per (direction, layer).
    """
    model = hf_models.build(name, getattr(torch, dtype))
    model.load_state_dict(state)
    model.train(mode != "eval")
    if mode == "train_ac":
        checkpointing = _steps(model, {"use_reentrant": False})
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing)
    hf.parallelize(model, group, layout=layout, dense=dense, **more)
    for module in model.modules():
        if query_block is not None and isinstance(module, BlockedIndexer):
            module.query_block = query_block
    if mode in ("train_ac_saved", "train_ac_compiled"):
        checkpointing = _steps(model, hf.checkpoint_kwargs())
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing)
    if mode == "train_ac_compiled":
        for layer in model.model.layers:
            layer.compile(fullgraph=True)
    local = hf.shard_batch(batch, group, layout=layout)
    counter = PayloadCounter()  # eval only: torch.compile refuses to run under a dispatch mode
    if mode == "eval":
        tag_layers(counter, model.model.layers)
        counter.tag = ("forward", "inputs")  # before the first layer: the model's inputs (positions)
    fused = CallCounter(hf_attention, "causal_attention")  # eager only: a compiled graph cannot count calls
    scans = CallCounter(tile_plan, "document_starts")
    with (
        float64_steps(model),
        fused if mode != "train_ac_compiled" else nullcontext(),
        scans,
        counter if mode == "eval" else nullcontext(),
    ):
        out = model(**local)
        out.loss.backward()
    received, calls = {}, {}
    for call in counter.log:
        calls[call.tag] = (
            calls.get(call.tag, 0) + 1
        )  # padding masks travel as bool (halos) or as their bytes (gathers)
        dtype = "mask" if call.dtype in (torch.bool, torch.uint8) else str(call.dtype).removeprefix("torch.")
        key = (*call.tag, dtype)
        received[key] = received.get(key, 0) + call.received
    grads = {key: p.grad for key, p in model.named_parameters()}
    paths = [m.context_parallel.fallback for m in model.modules() if hasattr(m, "context_parallel")]
    return {
        "logits": out.logits.detach(),
        "loss": out.loss.detach(),
        "grads": grads,
        "received": received,
        "calls": calls,
        "paths": paths,
        "fused_calls": fused.calls,
        "id_scans": scans.calls,
    }


def _steps(model, kwargs):
    """Checkpointing kwargs whose recomputation runs under float64_steps(model) as the forward does
    (a function mode is not active in backward)."""
    return kwargs if isinstance(float64_steps(model), nullcontext) else zoo_cases.float64_recompute(kwargs)


def exchange_calls(group, L, layout):
    """{reach: {"forward": c10d calls, "backward": c10d calls}} of one [2, L, 8] float64 tensor's
    exchange on this rank: gather_sequence (reach None) and gather_halo of hf_models' windows."""
    out = {}
    for reach in (None, 9, 13):
        x = torch.zeros(2, L, 8, dtype=torch.float64, requires_grad=True)
        counter = PayloadCounter()
        with counter:
            counter.tag = "forward"
            y = torch_impl.gather_sequence(x, group, layout=layout) if reach is None else None
            y = torch_impl.gather_halo(x, group, reach, layout=layout) if y is None else y
            counter.tag = "backward"
            y.sum().backward()
        out[reach] = {d: sum(call.tag == d for call in counter.log) for d in ("forward", "backward")}
    return out


def dropout_calls(group, batch):
    """Mistral with attention dropout 0.1: the calls that reach torch_impl.attention in eval mode
    and in train mode (where the dense fallback applies the dropout), and the printed plan."""
    model = hf_models.build("mistral")
    model.config.attention_dropout = 0.1
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.1
    hf.parallelize(model, group, verbose=False)
    calls = []
    for train in (False, True):
        model.train(train)
        with CallCounter(hf_attention, "causal_attention") as fused:
            model(**hf.shard_batch(batch, group)).loss.backward()
        calls.append(fused.calls)
    return model.cp_transport_paths, calls


class CallCounter:
    """with CallCounter(module, name): counts the calls of module.name (restored afterwards)."""

    def __init__(self, module, name):
        self.module, self.name, self.calls = module, name, 0

    def __enter__(self):
        original = getattr(self.module, self.name)

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        self.original = original
        setattr(self.module, self.name, counted)
        return self

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.original)


def refuse(group, name):
    """parallelize on a model the adapter cannot make exact: the message, the c10d calls it made
    (none), and a gather afterwards that shows no rank was left waiting."""
    model = hf_models.build(name)
    with PayloadCounter() as counter:
        try:
            hf.parallelize(model, group)
            message = None
        except ValueError as e:
            message = str(e)
    after = torch_impl.gather_sequence(torch.full((1, 1), float(dist.get_rank(group))), group)
    return message, counter.calls, after.flatten().tolist()


def isolated(group, name, state, batch, isolate):
    """cp_step (eval) with parallelize(isolate_documents=isolate)."""
    return cp_step(group, name, "float64", state, batch, isolate_documents=isolate)


def unlisted_packed(group, name, state, batch):
    """Packed rows given to a model whose base model's class torch_impl.hf.documents.ISOLATES does
    not list (renamed, as a family newer than the table): the first call's message."""
    base = type(hf_models.build(name).base_model)
    model = hf_models.build(name)
    model.load_state_dict(state)
    model.base_model.__class__ = type("UnlistedModel", (base,), {"__module__": "transformers.unlisted"})
    hf.parallelize(model, group, verbose=False)
    try:
        model(**hf.shard_batch(batch, group))
    except ValueError as e:
        return str(e)
    return None


def unsupported_call(group, name, state, batch, call):
    """A model that parallelize accepted, called in a way CP cannot make exact: the ValueError."""
    model = hf_models.build(name)
    model.load_state_dict(state)
    hf.parallelize(model, group, layout="head_tail" if call == "layout_only_in_parallelize" else "contiguous")
    local = hf.shard_batch(
        batch, group, layout="head_tail" if call == "layout_only_in_shard_batch" else "contiguous"
    )
    kwargs, mark = local, {key: local[key] for key in ("cp_layout",)}  # shard_batch's mark of a shard
    if call == "kv_cache":  # a decode step after a prefill: the cache holds this rank's keys only
        prefill = model(**(local | {"use_cache": True}))
        position = (dist.get_rank(group) + 1) * local["input_ids"].shape[1]
        kwargs = mark | {"input_ids": local["input_ids"][:, -1:], "position_ids": torch.tensor([[position]])}
        kwargs |= {"past_key_values": prefill.past_key_values, "use_cache": True}
    elif call == "cache_on_rank_1":  # only rank 1 passes a cache that holds tokens
        kwargs = mark | {"input_ids": local["input_ids"]}
        if dist.get_rank(group) == 1:
            cache = DynamicCache(config=model.config)
            cache.update(
                torch.zeros(2, 2, 3, 8, dtype=torch.float64), torch.zeros(2, 2, 3, 8, dtype=torch.float64), 0
            )
            kwargs["past_key_values"] = cache
    elif call == "4d_mask":
        L = local["input_ids"].shape[1]
        kwargs = mark | {
            "input_ids": local["input_ids"],
            "attention_mask": torch.ones(2, 1, L, L, dtype=torch.bool),
        }
    try:  # parallelize's cross-rank check is on by default: ranks whose own inputs look right raise too
        model(**kwargs)
        return None
    except ValueError as e:
        return str(e)


def mismatched_inputs(group, name, state, batch, case):
    """Rank 0 and rank 1 given inconsistent inputs (without the check, the first mismatched
    collective hangs, aborts the process in gloo, or returns garbage): the ValueError on each rank.
    Each case makes rank 0 differ in one field of the check's signature (inputs_embeds also in its
    embedding width, which is 0 without it)."""
    model = hf_models.build(name)
    model.load_state_dict(state)
    hf.parallelize(model, group)
    first = dist.get_rank(group) == 0
    local = hf.shard_batch(batch, group)
    if first and case == "longer_on_rank_0":  # rank 0 shards a 48-token batch, rank 1 the 24-token one
        local = hf.shard_batch({key: torch.cat([value, value], dim=1) for key, value in batch.items()}, group)
    elif first and case == "fewer_rows_on_rank_0":
        local = hf.shard_batch({key: value[:1] for key, value in batch.items()}, group)
    elif not first and case == "mask_on_rank_0_only":
        local = hf.shard_batch({k: v for k, v in batch.items() if k != "attention_mask"}, group)
    elif first and case == "positions_on_rank_0_only":  # its own global positions, 0 .. L-1
        local["position_ids"] = torch.arange(local["input_ids"].shape[1]).expand_as(local["input_ids"])
    elif first and case in ("embeds_on_rank_0_only", "wider_embeds_on_rank_0"):
        ids = local.pop("input_ids")
        local["inputs_embeds"] = model.get_input_embeddings()(ids).detach()
        if case == "wider_embeds_on_rank_0":  # both ranks pass embeddings; rank 0's are wider
            local["inputs_embeds"] = torch.nn.functional.pad(local["inputs_embeds"], (0, 1))
    elif not first and case == "wider_embeds_on_rank_0":
        local["inputs_embeds"] = model.get_input_embeddings()(local.pop("input_ids")).detach()
    elif first and case == "cache_on_rank_0_only":  # an empty cache: rank 0's own check passes
        local["past_key_values"] = DynamicCache(config=model.config)
    elif first and case == "use_cache_on_rank_0_only":
        local["use_cache"] = True
    try:
        model(**local)
        return None
    except ValueError as e:
        return str(e)


def inputs_check_traffic(group, name, state, batch, validate):
    """The c10d calls made before the first decoder layer (the inputs' cross-rank check), and the
    logits, with parallelize(validate=...)."""
    model = hf_models.build(name)
    model.load_state_dict(state)
    model.eval()
    hf.parallelize(model, group, validate=validate, verbose=False)
    counter = PayloadCounter()
    tag_layers(counter, model.model.layers)
    with counter:
        logits = model(**hf.shard_batch(batch, group)).logits
    before = [
        (call.op, str(call.dtype).removeprefix("torch."), call.received)
        for call in counter.log
        if call.tag is None
    ]
    return before, logits.detach(), model.cp_transport_paths


def without_cp(group, name, state, batch):
    """A group of size 1: parallelize returns the model untouched; shard_batch's kwargs, whole."""
    model = hf_models.build(name)
    model.load_state_dict(state)
    same = hf.parallelize(model, group) is model and model.config._attn_implementation == "sdpa"
    local = hf.shard_batch(batch, group)
    out = model(**local)
    out.loss.backward()
    return (
        same,
        local,
        out.logits.detach(),
        out.loss.detach(),
        {k: p.grad for k, p in model.named_parameters()},
    )


def indexer_scores(group, name, state, batch, query_block):
    """The largest ReLU output in a forward of a DeepSeek Sparse Attention model: the indexer's
    float32 scores [B, queries, heads, keys] (the model's MLPs use SiLU), with the indexer's query
    blocks of `query_block` rows."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if func is torch.ops.aten.relu.default:
                    Largest.numel = max(Largest.numel, t.numel())
            return out

    model = hf_models.build(name)
    model.load_state_dict(state)
    hf.parallelize(model, group)
    BlockedIndexer.query_block = query_block
    try:
        with Largest():
            model(**hf.shard_batch(batch, group))
    finally:
        BlockedIndexer.query_block = 256
    return Largest.numel


def local_keys(group, batch):
    return sorted(hf.shard_batch(batch, group))


def shard_bad_length(group):
    try:
        hf.shard_batch({"input_ids": torch.zeros(2, 22, dtype=torch.long)}, group)
        return None
    except ValueError as e:
        return str(e)


def other_model_unaffected(group, name, state, batch):
    """Logits of an untouched model before and after another one in the process is made CP, and
    its attention implementation afterwards."""
    other = hf_models.build(name)
    other.load_state_dict(state)
    before = other(**batch).logits.detach()
    model = hf_models.build(name)
    model.load_state_dict(state)
    hf.parallelize(model, group)
    model(**hf.shard_batch(batch, group))
    return before, other(**batch).logits.detach(), other.config._attn_implementation


def compiled_layers(group, name, state, batch, backend, checkpointing=False):
    """The CP model eager, then with every decoder layer compiled (fullgraph=True), both with
    activation checkpointing (hf.checkpoint_kwargs()) when asked, in train mode: both runs'
    logits and parameter grads, to compare on the host."""
    import torch._dynamo

    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        model = hf_models.build(name)
        model.load_state_dict(state)
        hf.parallelize(model, group)
        if checkpointing:
            model.train()
            checkpointing = _steps(model, hf.checkpoint_kwargs())
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing)
        if compiled:  # GPT-OSS's eager experts route by data (no full graph): its attention alone
            for layer in model.model.layers:
                (layer.self_attn if name == "gpt_oss" else layer).compile(backend=backend, fullgraph=True)
        out = model(**hf.shard_batch(batch, group))
        out.loss.backward()
        runs.append((out.logits.detach(), {k: p.grad for k, p in model.named_parameters()}))
    return runs


def data_parallel_grads(group, name, state, batch, dp, wrap, global_num_items):
    """DP x CP over the group's ranks (a (dp, cp) DeviceMesh, cp = size / dp): DP replica d takes row
    d of the batch, its CP ranks split it; `wrap` ("ddp" or "fsdp2") by hf.apply_ddp / apply_fsdp.
    global_num_items: each rank's loss is its share of the mean over every row (the valid labels of
    the whole batch), else of its own row's mean. Returns every parameter's reduced gradient."""
    from torch.distributed.device_mesh import DeviceMesh

    n = dist.get_world_size(group)
    ranks = torch.tensor(dist.get_process_group_ranks(group)).view(dp, n // dp)
    mesh = DeviceMesh("cpu", ranks, mesh_dim_names=("dp", "cp"))
    model = hf_models.build(name)
    model.load_state_dict(state)
    model.eval()
    hf.parallelize(model, mesh["cp"], verbose=False)
    apply = hf.apply_ddp if wrap == "ddp" else hf.apply_fsdp
    wrapped = apply(model, mesh, global_num_items=global_num_items)
    d = mesh["dp"].get_local_rank()
    local = hf.shard_batch({key: value[d : d + 1] for key, value in batch.items()}, mesh["cp"])
    if global_num_items:
        local["num_items_in_batch"] = hf.shard_batch(batch, None)["num_items_in_batch"]
    wrapped(**local).loss.backward()
    grads = {}
    for key, p in model.named_parameters():
        grads[key] = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
    return grads


def host_reads(group, name, state, batch, validate, layout="contiguous"):
    """Where one forward and backward of the CP model (train mode) read tensor values on the host
    (cp_support.syncs.HostReads): the library's reads (file:line each) and how many the model made."""
    from cp_support.syncs import HostReads

    model = hf_models.build(name)
    model.load_state_dict(state)
    model.train()
    hf.parallelize(model, group, layout=layout, validate=validate, verbose=False)
    local = hf.shard_batch(batch, group, layout=layout)
    with HostReads() as reads:
        model(**local).loss.backward()
    return reads.library, reads.others


def mask_function_calls(group, name, state, batch):
    """The c10d calls made inside the adapter's mask function during one forward and backward (the
    registered function wrapped for the case, restored after)."""
    from transformers import AttentionMaskInterface

    original = AttentionMaskInterface._global_mapping[hf_attention.IMPLEMENTATION]
    counter = PayloadCounter()

    def counted(*args, **kwargs):
        with counter:
            return original(*args, **kwargs)

    AttentionMaskInterface.register(hf_attention.IMPLEMENTATION, counted)
    try:
        model = hf_models.build(name)
        model.load_state_dict(state)
        hf.parallelize(model, group, verbose=False)
        model(**hf.shard_batch(batch, group)).loss.backward()
    finally:
        AttentionMaskInterface.register(hf_attention.IMPLEMENTATION, original)
    return counter.calls


def saved_and_reloaded(group, name, directory):
    """The model made CP, trained one SGD step on this rank's shard (gradients summed over the
    ranks), saved by rank 0 with save_pretrained, and reloaded as the plain class: the reloaded
    state dict's keys, and whether each tensor equals the CP model's."""
    model = hf.parallelize(hf_models.build(name), group, verbose=False)
    model(**hf.shard_batch(hf_models.make_batch(), group)).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
            p -= 0.1 * p.grad
    if dist.get_rank(group) == 0:
        model.save_pretrained(directory)
    dist.barrier(group=group)
    reloaded = type(model).from_pretrained(directory, dtype=torch.float64).state_dict()
    trained = model.state_dict()
    return sorted(reloaded), sorted(trained), all(torch.equal(reloaded[k], trained[k]) for k in trained)


def unsharded_calls(group, name, layout):
    """A parallelized model called with what shard_batch did not make (the whole batch on every
    rank) against the same model without CP: a forward in training mode under no_grad, a forward
    with loss and backward in eval mode, greedy generation with and without a KV cache; then the
    shard called in training mode without its mark, and the sharded step. Returns the largest
    differences, the tokens generated by both, the c10d calls the unsharded calls made, the
    sharded step's largest logit difference from the plain model's with the largest logit, and
    the unmarked shard's ValueError (None if it ran)."""
    plain, model = hf_models.build(name), hf_models.build(name)
    hf.parallelize(model, group, layout=layout, verbose=False)
    batch = hf_models.make_batch()
    differences, tokens = {}, {}
    with PayloadCounter() as counter:
        with torch.no_grad():  # in training mode without grad (as the trainers' own calls): one process
            quiet = [m(**batch).logits for m in (plain, model)]
        differences["no grad"] = (quiet[0] - quiet[1]).abs().max().item()
        for m in (plain, model):
            m.eval()  # with grad in eval mode: one process
        outs = [m(**batch) for m in (plain, model)]
        for out in outs:
            out.loss.backward()
        differences["logits"] = (outs[0].logits - outs[1].logits).abs().max().item()
        differences["loss"] = (outs[0].loss - outs[1].loss).abs().item()
        differences["grads"] = max(
            0.0 if p.grad is None and q.grad is None else (p.grad - q.grad).abs().max().item()
            for p, q in zip(plain.parameters(), model.parameters(), strict=True)
        )  # (an indexer's: no gradient in either)
        prompt = {key: batch[key][:, :10] for key in ("input_ids", "attention_mask")}
        for use_cache in (True, False):
            for tag, m in (("plain", plain), ("cp", model)):
                m.eval()
                tokens[tag, use_cache] = m.generate(
                    **prompt, max_new_tokens=6, do_sample=False, use_cache=use_cache, pad_token_id=0
                ).tolist()
    model.train()  # a shard without its mark, in training with grad (a loop that dropped it): refused
    local = hf.shard_batch(batch, group, layout=layout)
    try:
        model(input_ids=local["input_ids"], labels=local["labels"])
        refused = None
    except ValueError as e:
        refused = str(e)
    with float64_steps(model), float64_steps(plain):
        logits = model(**local).logits  # [B, L, V]
        whole = plain(**batch).logits  # [B, S, V]
    n, r = dist.get_world_size(group), dist.get_rank(group)
    rows = ShardPlan.of(layout, n, r, logits.shape[1]).rows()
    sharded = ((logits - whole[:, rows]).abs().max().item(), whole.abs().max().item())
    return differences, tokens, counter.calls, sharded, refused


def sequence_classification(group, family, layout, left, rows="padded"):
    """A *ForSequenceClassification model under CP against the same model in one process: the
    pooled logits on this rank, the loss summed over the ranks, every parameter's gradient summed
    over the ranks, and both runs' values. `rows`: "padded" (pad token 0, rows padded `left` or
    right), "all padding" (the same, row 2 every position the pad token: pooled at position 0),
    "no pad token" (a model without one, batch 1: row 1 pooled at its last position, padding or
    not)."""
    pad = None if rows == "no pad token" else 0
    plain = hf_models.build_head("ForSequenceClassification", family, pad_token_id=pad)
    model = hf_models.build_head("ForSequenceClassification", family, pad_token_id=pad)
    hf.parallelize(model, group, layout=layout, verbose=False)
    batch = hf_models.make_classification_batch(left=left)
    if rows == "all padding":
        batch["input_ids"][2] = 0
        for m in (plain, model):  # the pad token's embedding (zeros: padding_idx) made not zero, so that
            with torch.no_grad():  # a row of pad tokens has logits, which depend on where it is pooled
                m.get_input_embeddings().weight[0] = torch.linspace(-1.0, 1.0, m.config.hidden_size)
    elif rows == "no pad token":
        batch = {key: value[1:2] for key, value in batch.items()}
    out = plain(**batch)
    out.loss.backward()
    local = model(**hf.shard_batch(batch, group, layout=layout))
    local.loss.backward()
    loss = local.loss.detach().clone()
    dist.all_reduce(loss, group=group)
    grads = {}
    for (key, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        dist.all_reduce(p.grad, group=group)
        grads[key] = (p.grad, q.grad)
    return local.logits.detach(), out.logits.detach(), loss, out.loss.detach(), grads


def refused_head(group, head):
    """parallelize's ValueError for a model with the named head class (None if accepted)."""
    try:
        hf.parallelize(hf_models.build_head(head), group, verbose=False)
    except ValueError as e:
        return str(e)
    return None
