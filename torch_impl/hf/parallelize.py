"""`parallelize`: every token-mixing module of a model checked and planned before anything changes
(torch_impl.hf.kinds), then each kind made CP: the model's attention switched to the registered
implementation, layers' classes mixed, hooks added."""

import inspect
import logging

import torch
import torch.distributed as dist
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from transformers import PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from torch_impl import _group
from torch_impl.hf._common import IMPLEMENTATION, INDEXED, RUNNING, SLIDING, in_context
from torch_impl.hf.attention import CrossAttention
from torch_impl.hf.attention_kinds import attention_kind, layer_type
from torch_impl.hf.block_sparse import BLOCK_SPARSE
from torch_impl.hf.compressed import COMPRESSED
from torch_impl.hf.documents import OneRankDocuments, isolates_documents
from torch_impl.hf.heads import apply_head, check_head
from torch_impl.hf.inputs import MaskCountPositions, ModelInputs, PaddingIndexPositions, Positions
from torch_impl.hf.kinds import HYBRID, SHORT_CONVS, refuse, token_conv_of, walk
from torch_impl.hf.recurrent import apply_recurrent, is_known, is_short_conv, recurrence_of
from torch_impl.layout import check as check_layout

# model types whose position_ids default to a count of real tokens (their learned position embeddings)
MASK_COUNT_POSITIONS = ("opt",)
log = logging.getLogger("torch_impl.hf")


def apply_attention(decoder, attentions):
    """Every attention module gets its setup; the language model switches to the registered
    implementation (its own config: its encoders keep theirs). Returns which math each layer kind
    takes."""
    paths = {}
    for module, setup in attentions:
        module.context_parallel = setup
        kind = layer_type(module) or type(module).__name__
        if isinstance(setup, CrossAttention):
            paths[kind] = "the rank's queries over the images' states, held whole: the model's attention"
            continue
        fallback = setup.fallback
        paths[kind] = "torch_impl.attention" if fallback is None else f"dense [L, T] mask ({fallback})"
        dropout = getattr(module.config, "attention_dropout", 0.0)
        if fallback is None and dropout > 0:  # the fused math applies no dropout
            paths[kind] += f"; in train mode a dense [L, T] mask (attention dropout {dropout})"
        special = attention_kind(module)
        if special is not None:
            paths[kind] = special.path
            special.apply(module)
    decoder.set_attn_implementation({"": IMPLEMENTATION})
    return paths


def _decoder(model):
    """The language model: the innermost module around the input embeddings whose forward takes an
    attention_mask and position_ids (a multimodal model's text model; OPT's decoder, which its
    causal LM calls directly; Llama 4's text model); ValueError where it is no PreTrainedModel."""
    try:
        embeddings = model.get_input_embeddings()
    except NotImplementedError:  # PP-FormulaNet's
        raise refuse("", model, "does not say which module embeds its input tokens") from None
    name = next((name for name, module in model.named_modules() if module is embeddings), None)
    if name is None:
        raise refuse("", model, "does not say which module embeds its input tokens")
    parts = name.split(".")[:-1]
    for depth in range(len(parts), -1, -1):
        module = model.get_submodule(".".join(parts[:depth]))
        if {"attention_mask", "position_ids"} <= set(inspect.signature(module.forward).parameters):
            break
    if not isinstance(module, PreTrainedModel):
        raise refuse("", model, "has no language model taking an attention_mask and position_ids")
    return module


def _positions(model, decoder):
    """The model's own default position_ids, as a torch_impl.hf.inputs.Positions."""
    embeddings = next((m for m in decoder.modules() if model.get_input_embeddings() in m.children()), None)
    if callable(getattr(embeddings, "create_position_ids_from_input_ids", None)):  # the RoBERTa family
        return PaddingIndexPositions(embeddings)
    if decoder.config.model_type in MASK_COUNT_POSITIONS:
        return MaskCountPositions()
    return Positions()


def _hooked(model, decoder, attention=True):
    """The modules whose pre-hook prepares the model's inputs, outer first: its base model and its
    decoder (OPT's causal LM calls the decoder directly); ValueError for one without position_ids
    where the model has attention (Mamba alone needs no positions)."""
    hooked = list(dict.fromkeys([model.base_model, decoder]))
    for module in hooked:
        if attention and "position_ids" not in inspect.signature(module.forward).parameters:
            raise refuse("", module, "takes no position_ids, so it cannot be given its global positions")
    return hooked


def apply_inputs(model, decoder, hooked, group, validate, layout="contiguous", isolates=None):
    """The model's inputs (global positions, documents, attention chunks, indexed_attention's
    context, the refusal of a filled KV cache or of non-text inputs, and (validate) the cross-rank
    check), prepared by a pre-hook on each hooked module (the first to run in a forward does it)."""
    indexed = INDEXED in (getattr(decoder.config, "layer_types", None) or ())
    chunk = getattr(decoder.config, "attention_chunk_size", None)
    positions = _positions(model, decoder)
    isolates = isolates_documents(hooked) if isolates is None else isolates
    types = getattr(decoder.config, "layer_types", None)
    # a mask of another kind reaches no layer (a hybrid layer's attention: any kind)
    kinds = None if not types or HYBRID in types else frozenset(types)
    if kinds is not None and kinds & set(COMPRESSED):  # their masks are the sliding window's
        kinds |= {SLIDING}
    if kinds is not None and BLOCK_SPARSE in kinds:  # its mask is the full layers'
        kinds |= {"full_attention"}
    own_mask = ALL_MASK_ATTENTION_FUNCTIONS.get(decoder.config._attn_implementation)  # before the switch
    for module in hooked:
        hook = ModelInputs(
            module,
            owner=id(model),
            group=group,
            layout=layout,
            validate=validate,
            positions=positions,
            isolates=isolates,
            kinds=kinds,
            make_mask=own_mask,
            indexed=indexed,
            chunk=chunk,
        )
        module.register_forward_pre_hook(hook, with_kwargs=True)
        module.register_forward_hook(hook.done, with_kwargs=True, always_call=True)


def apply_token_conv(convs, group, layout="contiguous"):
    """Every token-dependent conv made CP as its kind in torch_impl.hf.kinds.TOKEN_CONVS says
    (Inkling2's over a halo of kernel - 1 inputs, Qwen4's PLE over the rows its dilated conv reads,
    given the ids its n-grams read). Returns which path they take."""
    paths = {}
    for module in convs:
        kind = token_conv_of(module)
        kind.apply(module, group, layout)
        paths[type(module).__name__] = kind.path
    return paths


def apply_recurrences(modules, group, layout="contiguous"):
    """Every recurrent layer and short convolution made CP as its kind in
    torch_impl.hf.recurrent.RECURRENCES says. Returns which path they take."""
    paths = {}
    for module in modules:
        kind = apply_recurrent(module, group, layout)
        paths[type(module).__name__] = f"{kind.name}: {kind.path}"
    return paths


def parallelize(
    model: PreTrainedModel,
    group: _group.Group,
    *,
    layout: str = "contiguous",
    validate: bool = True,
    verbose: bool = True,
    dense: bool = False,
    isolate_documents: bool | None = None,
) -> PreTrainedModel:
    """Make a transformers causal LM context-parallel over `group`, in place; returns the model.

    Every check runs before anything changes and before any communication, identically on every
    rank: a layer that cannot be made exact raises `ValueError` naming it and why. Without CP
    (`group` None or of size 1) the model is returned untouched, but for the linear-attention
    layers of a model that isolates packed documents: they then keep each document apart, as under
    CP (transformers' torch kernels carry the state across documents).

    layout: "contiguous" (rank r holds tokens [r*L, (r+1)*L)) or "head_tail" (chunks r and 2n-1-r:
        balanced causal work; torch_impl.layout); `shard_batch` must be given the same.
    validate: at every forward, before any other communication, the CP ranks compare their inputs
        (the shard's shape, which arguments were passed) in one all-gather of a few integers, and
        raise `ValueError` on every rank where they differ or some rank's were refused. False
        skips that collective (it is skipped inside torch.compile either way).
    verbose: print on global rank 0 one line saying which path each layer kind takes. Either way it is
        logged (`torch_impl.hf`, INFO) and kept as `model.cp_transport_paths` ({layer kind: path}).
    dense: True keeps every full and sliding attention layer on the model's own attention function
        over a dense [L, T] mask (the fallback path, exact but O(L * T) memory), for comparison.
    isolate_documents: whether this model, in one process, keeps the documents of packed rows
        (position_ids restarting, no attention_mask) from attending to each other, as CP then must;
        None looks its class up in torch_impl.hf.documents.ISOLATES (transformers' families; packed
        rows are refused for a class it does not list). Give it for a model of your own.
    """
    group = _group.resolve_group(group)
    check_layout(layout)
    if not (isolate_documents is None or isinstance(isolate_documents, bool)):
        raise ValueError(f"`isolate_documents` must be None, True or False, got {isolate_documents!r}")
    if _group.world_size(group) == 1:
        return _one_rank(model, isolate_documents)
    decoder = _decoder(model)
    if decoder.config._attn_implementation == IMPLEMENTATION:
        raise refuse("", model, "is already context-parallel")
    head = check_head(model)
    if head is not None:
        raise refuse("", model, head)
    attentions, convs, token_convs, linear = walk(model, decoder, group, layout, dense)
    hooked = _hooked(model, decoder, attention=bool(attentions))
    apply_inputs(model, decoder, hooked, group, validate, layout, isolate_documents)
    paths = (
        apply_attention(decoder, attentions)
        | apply_recurrences(convs, group, layout)
        | apply_token_conv(token_convs, group, layout)
        | apply_recurrences(linear, group, layout)
        | apply_head(model, group, layout)
    )
    model.cp_transport_paths = paths
    summary = (
        f"torch_impl.hf.parallelize: {type(model).__name__} over {_group.world_size(group)} CP ranks; "
        + "; ".join(f"{kind}: {path}" for kind, path in paths.items())
        + f"; layout: {layout}; inputs checked across ranks: {'yes' if validate else 'no'}"
    )
    log.info(summary)
    if verbose and dist.get_rank() == 0:
        print(summary, flush=True)
    return model


def _one_rank(model, isolates):
    """Without CP: the model untouched, but for linear-attention layers and convs in a model that
    isolates packed documents, which then keep each document's state apart as under CP (documents.
    OneRankDocuments); transformers' torch kernels would carry it across documents."""
    decoder = _decoder(model)
    linear = [
        module
        for module in decoder.modules()
        if is_known(module) or type(module).__name__ in SHORT_CONVS and is_short_conv(module)
    ]
    token_convs = [module for module in decoder.modules() if token_conv_of(module) is not None]
    hooked = list(dict.fromkeys([model.base_model, decoder]))
    if not (linear or token_convs) or not (isolates_documents(hooked) if isolates is None else isolates):
        return model
    if getattr(model, "cp_transport_paths", None) is not None:
        raise refuse("", model, "is already parallelized")
    for module in linear:
        why = recurrence_of(module).why(module)
        if why:
            raise refuse("", module, why)
    for module in hooked:
        hook = OneRankDocuments(module, id(model))
        module.register_forward_pre_hook(hook, with_kwargs=True)
        module.register_forward_hook(hook.done, with_kwargs=True, always_call=True)
    model.cp_transport_paths = {
        type(module).__name__: f"{apply_recurrent(module, None, 'contiguous').name}: each packed document "
        "from zero, as under CP"
        for module in linear
    } | {name: f"{path}, each document alone" for name, path in apply_token_conv(token_convs, None).items()}
    return model


def _save_collectives_and_attention(ctx, op, *args, **kwargs):
    if op.namespace in ("_c10d_functional", "torch_impl"):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_kwargs() -> dict:
    """Activation checkpointing that keeps the outputs of the transport's collectives and of the
    CPU attention op (`torch_impl::tiled_attention`: its output and log-sum-exp, [B, H, L, D] and
    [B, H, L] a layer) instead of recomputing them: `model.activation_checkpointing_enable(
    activation_checkpointing_kwargs=hf.checkpoint_kwargs())` (older transformers:
    `gradient_checkpointing_enable`). The attention then runs once forward and once backward, not
    twice forward. Required with torch.compile: recomputed inside a compiled backward, a collective
    whose output a rank does not need (rank 0's empty halo) is dropped by the compiler on that rank
    only, and its peers wait forever. (Eager recomputation runs every collective on every rank
    again, in order.) The recomputation runs in the forward's Context (RUNNING), which holds what
    its recurrent layers read of packed documents."""
    return {"use_reentrant": False, "context_fn": _checkpoint_contexts}


def _checkpoint_contexts():
    """checkpoint's context_fn, called as a checkpointed layer's forward starts: the selective
    policy's two contexts, the recomputation's also restoring that forward's Context."""
    forward, recompute = create_selective_checkpoint_contexts(_save_collectives_and_attention)
    if torch.compiler.is_compiling():  # compiled, the recomputation is traced with the forward
        return forward, recompute
    return forward, in_context(RUNNING.context, recompute)
