"""`parallelize`: every token-mixing module of a model checked and planned before anything changes,
then the model's attention switched to the registered implementation and hooks added."""

from contextlib import contextmanager
import inspect
import logging
import re
import sys

import torch
from torch import nn
import torch.distributed as dist
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from torch_impl import _group
from torch_impl.hf._common import IMPLEMENTATION, INDEXED, LINEAR, RUNNING, SLIDING, mix
from torch_impl.hf.attention import AttentionSetup, temperature_scale
from torch_impl.hf.block_sparse import BLOCK_SPARSE, BlockIndexer, is_block_sparse
from torch_impl.hf.cca import is_cca
from torch_impl.hf.compressed import COMPRESSED, CompressedEntries, is_compressor
from torch_impl.hf.documents import OneRankDocuments, Packed, isolates_documents
from torch_impl.hf.heads import apply_head, check_head
from torch_impl.hf.indexed import AbsorbedMLA, BlockedIndexer, QSAIndexer
from torch_impl.hf.inkling import RelativeTable, TokenConvHalo, is_relative, is_token_conv
from torch_impl.hf.inputs import MaskCountPositions, ModelInputs, PaddingIndexPositions, Positions
from torch_impl.hf.mlstm import check_mlstm, is_mlstm
from torch_impl.hf.ple import PLEHalo, is_ple
from torch_impl.hf.recurrent import CONV, KERNELS, apply_recurrent, is_known, is_lightning, is_short_conv
from torch_impl.layout import check as check_layout

SUPPORTED_LAYER_TYPES = (
    "full_attention",
    "sliding_attention",
    "chunked_attention",
    "conv",
    INDEXED,
    LINEAR,  # Gated DeltaNet, KDA, Mamba2, Mamba, MiniMax's lightning (torch_impl.hf.recurrent)
    "mlp",  # Nemotron-H's layers without a token mixer
    "moe",
    *COMPRESSED,  # DeepSeek V4's CSA and HCA (torch_impl.hf.compressed)
    BLOCK_SPARSE,  # MiniMax-M3's (torch_impl.hf.block_sparse)
)
# a layer of both attention and a recurrence (Falcon-H1's parallel ones, Zamba2's shared attention
# blocks beside its Mamba2): allowed where the walk recognised the recurrences
HYBRID = "hybrid"
# causal depthwise convs: of in_proj's gated output (LFM2's), of a layer's or its keys' and values'
# inputs (Inkling's)
SHORT_CONVS = (
    "Lfm2ShortConv",
    "Lfm2MoeShortConv",
    "Lfm3ShortConv",
    "InklingShortConvolution",
    "Inkling2ShortConvolution",
)
# Inkling's layer types: full and sliding attention with relative logits (torch_impl.hf.inkling)
RELATIVE_LAYER_TYPES = ("hybrid", "hybrid_sliding")
RECURRENT = re.compile(
    r"Mamba|Mixer|GatedDeltaNet|DeltaAttention|LinearAttention|Rwkv|RWKV|Recurrent|Retention|xLSTM|Ssm|SSM"
)
# attention modules whose own code does what CP cannot split, by class: why
REFUSED_ATTENTION = {
    "DogeAttention": "computes its mask itself, a top-k over every key of the 4-D attention mask",
}
RECURRENT_LAYER_TYPES = ("mamba", "mamba2", "recurrent")
RECURRENCE = "carries recurrent state along the sequence, which CP cannot split exactly"
# model types whose position_ids default to a count of real tokens (their learned position embeddings)
MASK_COUNT_POSITIONS = ("opt",)
TOWERS = re.compile(r"vision|audio|image|video|speech|visual|vq")  # sub-configs of non-text encoders
log = logging.getLogger("torch_impl.hf")


def _unsupported(layer_types):
    """Why layers of these types are refused: the recurrence named where they are one."""
    if any(t in RECURRENT_LAYER_TYPES for t in layer_types):
        return f"{RECURRENCE} ({layer_types} layers)"
    return f"has {layer_types} layers, a kind the adapter does not know (supported: {SUPPORTED_LAYER_TYPES})"


def _refuse(name, module, why):
    return ValueError(f"torch_impl.hf.parallelize: {name or 'the model'} ({type(module).__name__}) {why}")


def _check_configs(model, towers, allowed=()):
    """Model-wide refusals, from the model's config and its sub-models' but its non-text encoders'
    (a catch-all after the walk; `allowed`: the layer types of the modules it recognised beyond
    SUPPORTED_LAYER_TYPES)."""
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if not isinstance(config, PreTrainedConfig) or id(config) in towers:
            continue
        if getattr(config, "is_encoder_decoder", False):
            raise _refuse(name, module, "is an encoder-decoder model: cross attention is not supported")
        if getattr(config, "attention_chunk_size", None) and getattr(config, "sliding_window", None):
            raise _refuse(
                name,
                module,
                "has both chunked and sliding-window attention, which its masks cannot tell apart",
            )
        layer_types = set(getattr(config, "layer_types", None) or ())
        unsupported = sorted(layer_types - set(SUPPORTED_LAYER_TYPES) - set(allowed))
        if unsupported:
            raise _refuse(name, module, _unsupported(unsupported))
        if INDEXED in layer_types and not layer_types <= {INDEXED, LINEAR, SLIDING}:  # Qwen4's, dots3's
            others = sorted(layer_types - {INDEXED, LINEAR, SLIDING})
            raise _refuse(name, module, f"mixes {INDEXED!r} layers with {others}")


def _layer_type(module):
    """The config's type for a module that knows its layer index (e.g. 'sliding_attention'), else None."""
    types, index = (
        getattr(getattr(module, "config", None), "layer_types", None),
        getattr(module, "layer_idx", None),
    )
    return types[index] if types and isinstance(index, int) and 0 <= index < len(types) else None


def _kind(name, module, family=""):
    """'attention', 'short_conv', 'recurrent', or None for a module that mixes no tokens itself;
    ValueError for a module that mixes them in a way CP cannot reproduce exactly. `family`: a
    class-name prefix that names no recurrence (RecurrentGemma's, whose MLP, norm and rotary
    embedding are RecurrentGemma*)."""
    layer_type = _layer_type(module)
    known = (*SUPPORTED_LAYER_TYPES, HYBRID, *(RELATIVE_LAYER_TYPES if is_relative(module) else ()))
    if layer_type is not None and layer_type not in known:
        raise _refuse(name, module, _unsupported([layer_type]))
    if type(module).__name__ in REFUSED_ATTENTION:
        raise _refuse(name, module, REFUSED_ATTENTION[type(module).__name__])
    if hasattr(module, "is_causal") and hasattr(module, "config"):  # transformers' attention modules
        if not module.is_causal or getattr(module, "is_cross_attention", False):
            raise _refuse(
                name, module, "is bidirectional or cross attention; only causal attention is supported"
            )
        return "attention"
    if type(module).__name__ in SHORT_CONVS:
        if not is_short_conv(module):
            raise _refuse(name, module, f"does not call `{CONV}` over its own depthwise `conv`")
        return "short_conv"
    if is_token_conv(module) or is_ple(module):
        return "token_conv"
    if is_mlstm(module) and check_mlstm(module):
        raise _refuse(name, module, check_mlstm(module))
    if is_known(module):
        return "recurrent"
    name_ = type(module).__name__
    if (
        RECURRENT.search(name_.removeprefix(family))
        and not name_.endswith("Norm")
        and not any(map(is_known, module.modules()))
    ):
        raise _refuse(name, module, RECURRENCE)  # (a layer holding a linear attention it knows is not)
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        raise _refuse(name, module, "is a convolution over the sequence that the adapter does not know")
    return None


def is_qsa(module):
    """Qwen4's QSA layer: no MLA, an indexer that pools the keys a query sees into blocks of
    `compress_ratio` and keeps the `token_budget // compress_ratio` best blocks and the incomplete
    last one, with the forward QSAIndexer calls."""
    indexer = getattr(module, "indexer", None)
    if callable(getattr(module, "expand_kv", None)) or indexer is None:
        return False
    names = list(inspect.signature(indexer.forward).parameters)
    wanted = ["hidden_states", "position_embeddings", "attention_mask", "past_key_values"]
    return names == wanted and hasattr(indexer, "compress_ratio") and hasattr(indexer, "token_budget")


def _check_indexed(name, module):
    """An indexed_attention layer is DeepSeek V3.2's / GLM-5's: MLA latents expanded by `expand_kv`
    through a `kv_b_proj` without bias (absorbed exactly), an indexer (or, GLM-5's shared layers,
    the previous layer's indices) with the forward the adapter calls, no attention dropout; or
    Qwen4's QSA (`is_qsa`)."""
    if is_qsa(module):
        return
    if not callable(getattr(module, "expand_kv", None)) or not hasattr(module, "indexer"):
        raise _refuse(
            name, module, f"is an {INDEXED!r} layer without MLA's expand_kv and an indexer, nor Qwen4's QSA"
        )
    projection = getattr(module, "kv_b_proj", None)
    nope_dim = getattr(module, "qk_nope_head_dim", None)
    if not isinstance(projection, nn.Linear) or projection.bias is not None or nope_dim is None:
        raise _refuse(
            name,
            module,
            f"is an {INDEXED!r} layer whose latents are not expanded by a `kv_b_proj` Linear without bias "
            "(with `qk_nope_head_dim`): the absorbed attention could not reproduce it",
        )
    if module.indexer is not None:
        names = list(inspect.signature(module.indexer.forward).parameters)[:6]
        expected = ["hidden_states", "q_resid", "position_embeddings", "attention_mask", "position_ids"]
        if names[:5] != expected or "past_key_values" not in names:
            raise _refuse(name, module, f"has an indexer whose forward takes {names}, not {expected}")
    if getattr(module.config, "attention_dropout", 0.0) > 0:
        raise _refuse(name, module, f"is an {INDEXED!r} layer with attention dropout, which is not supported")


def _attention_setup(name, module, group, layout, dense=False):
    if _layer_type(module) == INDEXED:
        _check_indexed(name, module)
    if _layer_type(module) in COMPRESSED and not is_compressor(getattr(module, "compressor", None)):
        raise _refuse(
            name,
            module,
            f"is a {_layer_type(module)!r} layer without DeepSeek V4's compressor (its forward and "
            "cache calls)",
        )
    if _layer_type(module) == BLOCK_SPARSE:
        if not is_block_sparse(module):
            raise _refuse(name, module, f"is a {BLOCK_SPARSE!r} layer without MiniMax-M3's indexer")
        if module.indexer.local_blocks > module.indexer.topk_blocks:  # ties among its kept blocks
            raise _refuse(
                name,
                module,
                "keeps more local blocks than its top-k: they tie (+inf), and top-k's choice among them "
                "depends on how many keys it scores",
            )
    implementation = module.config._attn_implementation
    if implementation == "sdpa":
        attend = ALL_ATTENTION_FUNCTIONS["sdpa"]
    elif implementation == "eager":
        attend = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if attend is None:
            raise _refuse(name, module, "uses eager attention but its module has no eager_attention_forward")
    else:
        raise _refuse(
            name,
            module,
            f"uses attention {implementation!r}; only 'sdpa' and 'eager' take the global query and key "
            "offsets of a CP rank (flash kernels align causal masks bottom-right)",
        )
    reason = "parallelize(dense=True)" if dense and _layer_type(module) != INDEXED else None
    make_mask = ALL_MASK_ATTENTION_FUNCTIONS[implementation]
    return AttentionSetup(group, attend, make_mask, reason, layout, temperature_scale(module))


def _towers(model):
    """The ids of the configs of the model's non-text encoders (vision, audio, ...): their modules
    are left alone, and `ModelInputs` refuses the inputs that would reach them."""
    found, configs = set(), [model.config]
    while configs:
        config = configs.pop()
        for key in getattr(config, "sub_configs", None) or {}:
            sub = getattr(config, key, None)
            if isinstance(sub, PreTrainedConfig) and TOWERS.search(key):
                found.add(id(sub))
            elif isinstance(sub, PreTrainedConfig):
                configs.append(sub)
    return found


def _layers(model, decoder, group, layout, dense=False):
    """(attention modules with their setups, short convs, token-dependent convs, linear-attention
    modules): every token-mixing module, or ValueError."""
    if not type(model)._can_set_attn_implementation():
        raise _refuse("", model, "does not route its attention through transformers' AttentionInterface")
    attentions, skipped, towers = [], [], _towers(model)
    whole = {"short_conv": {}, "recurrent": {}, "token_conv": {}}
    # a model holding recurrences made CP here: its family's class-name prefix names none
    family = (
        re.sub(r"(For[A-Z]\w*|Model)$", "", type(model).__name__)
        if any(map(is_known, model.modules()))
        else ""
    )
    for name, module in model.named_modules():
        handled = [*whole["short_conv"], *whole["recurrent"], *whole["token_conv"], *skipped]
        if any(name.startswith(f"{outer}.") for outer in handled):
            continue  # inside a short conv or linear attention, handled whole, or a non-text encoder
        if id(getattr(module, "config", None)) in towers:
            skipped.append(name)
            continue
        kind = _kind(name, module, family)
        if kind == "attention" and module.config is not decoder.config:  # the one parallelize switches
            raise _refuse(name, module, "reads an attention config other than its language model's")
        if kind == "attention":
            attentions.append((module, _attention_setup(name, module, group, layout, dense)))
        elif kind is not None:
            whole[kind][name] = module
    relative = any(is_relative(module) for module, _ in attentions)
    allowed = ((HYBRID,) if whole["recurrent"] else ()) + (RELATIVE_LAYER_TYPES if relative else ())
    _check_configs(model, towers, allowed)
    linear = list(getattr(decoder.config, "layer_types", None) or ()).count("linear_attention")
    if linear > len(whole["recurrent"]):  # a linear attention the walk did not recognise
        raise _refuse(
            "",
            model,
            f"{RECURRENCE}: {linear} 'linear_attention' layers, of which {len(whole['recurrent'])} are "
            f"Gated DeltaNet, KDA, Mamba2 or Mamba modules calling the kernels {sorted(KERNELS)} or "
            "MiniMax's lightning attention",
        )
    convs = [*whole["short_conv"].values()], [*whole["token_conv"].values()]
    return attentions, *convs, list(whole["recurrent"].values())


def apply_attention(decoder, attentions):
    """Every attention module gets its setup; the language model switches to the registered
    implementation (its own config: its encoders keep theirs). Returns which math each layer kind
    takes."""
    paths = {}
    for module, setup in attentions:
        module.context_parallel = setup
        kind = _layer_type(module) or type(module).__name__
        fallback = setup.fallback
        paths[kind] = "torch_impl.attention" if fallback is None else f"dense [L, T] mask ({fallback})"
        dropout = getattr(module.config, "attention_dropout", 0.0)
        if fallback is None and dropout > 0:  # the fused math applies no dropout
            paths[kind] += f"; in train mode a dense [L, T] mask (attention dropout {dropout})"
        if is_relative(module):
            paths[kind] = "relative logits by global distance; the model's attention per block of queries "
            paths[kind] += "on a dense [block, T] mask"
            mix(module.rel_logits_proj, RelativeTable)
        elif kind == BLOCK_SPARSE:
            paths[kind] = "its indexer per chunk over every rank's index keys; the model's block mask, "
            paths[kind] += "dense [L, T] per head"
            mix(module.indexer, BlockIndexer)
        elif kind in COMPRESSED:
            paths[kind] = "each rank's windows compressed, the entries gathered; the sliding window's keys "
            paths[kind] += "and the entries on a dense [L, T] mask"
            mix(module.compressor, CompressedEntries)
        elif kind == INDEXED and is_qsa(module):
            paths[kind] = "QSA indexer per chunk over the causal prefix's keys; its picks a dense [L, T] mask"
            mix(module.indexer, QSAIndexer)
        elif kind == INDEXED:
            paths[kind] = "blocked indexer, absorbed sparse attention over the causal prefix's latents"
            mix(module, AbsorbedMLA)
            if module.indexer is not None:
                mix(module.indexer, BlockedIndexer)
    decoder.set_attn_implementation({"": IMPLEMENTATION})
    return paths


def _decoder(model):
    """The language model: the innermost module around the input embeddings whose forward takes an
    attention_mask and position_ids (a multimodal model's text model; OPT's decoder, which its
    causal LM calls directly; Llama 4's text model); ValueError where it is no PreTrainedModel."""
    try:
        embeddings = model.get_input_embeddings()
    except NotImplementedError:  # PP-FormulaNet's
        raise _refuse("", model, "does not say which module embeds its input tokens") from None
    name = next((name for name, module in model.named_modules() if module is embeddings), None)
    if name is None:
        raise _refuse("", model, "does not say which module embeds its input tokens")
    parts = name.split(".")[:-1]
    for depth in range(len(parts), -1, -1):
        module = model.get_submodule(".".join(parts[:depth]))
        if {"attention_mask", "position_ids"} <= set(inspect.signature(module.forward).parameters):
            break
    if not isinstance(module, PreTrainedModel):
        raise _refuse("", model, "has no language model taking an attention_mask and position_ids")
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
            raise _refuse("", module, "takes no position_ids, so it cannot be given its global positions")
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
            module, id(model), group, indexed, validate, layout, positions, chunk, isolates, kinds, own_mask
        )
        module.register_forward_pre_hook(hook, with_kwargs=True)
        module.register_forward_hook(hook.done, with_kwargs=True, always_call=True)


def apply_short_conv(convs, group, layout="contiguous"):
    """Every short convolution runs its own forward with CP's conv (torch_impl.hf.recurrent's
    ConvHalo: the conv's inputs over a halo of kernel - 1). Returns which path they take."""
    return {
        type(module).__name__: f"{apply_recurrent(module, group, layout)}: its own forward, the conv over a "
        "halo of kernel - 1 inputs"
        for module in convs
    }


def apply_token_conv(convs, group, layout="contiguous"):
    """Every token-dependent short conv (Inkling2's) runs its own forward per chunk over a halo of
    kernel - 1 inputs (torch_impl.hf.inkling.TokenConvHalo), every PLE layer (Qwen4's) over the
    rows its dilated conv reads, given the ids its n-grams read (torch_impl.hf.ple.PLEHalo).
    Returns which path they take."""
    paths = {}
    for module in convs:
        if is_ple(module):
            path = "its own forward per chunk over the (kernel - 1) * dilation rows before it, given "
            path += "the n-grams' ids before those"
        else:
            path = "its own forward per chunk over a halo of kernel - 1 inputs"
        mix(module, PLEHalo if is_ple(module) else TokenConvHalo).cp_packed = Packed(group)
        module.cp_layout = layout
        paths[type(module).__name__] = path
    return paths


def apply_linear_attention(modules, group, layout="contiguous"):
    """Every linear-attention module runs its own forward with CP's conv and chunked kernel, or
    MiniMax's lightning attention its block loop per chunk (torch_impl.hf.recurrent). Returns
    which path they take."""
    paths = {}
    for module in modules:
        name = apply_recurrent(module, group, layout)
        if is_lightning(module):
            path = "its block loop from zero per chunk, corrected by the earlier chunks' state (gather_state)"
        elif is_cca(module):
            path = "its own forward per chunk over the K hidden states before it (a halo: its q/k convs "
            path += "and delayed values)"
        elif is_mlstm(module):
            path = "its own forward per chunk from zero (its map), then from the earlier chunks' state "
            path += "(gather_state) and stabiliser (max-plus fold)"
        else:
            path = "its own forward, the conv over a halo of kernel - 1 inputs, the chunked kernel from the "
            path += "earlier chunks' state (gather_state)"
        paths[type(module).__name__] = f"{name}: {path}"
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
        raise _refuse("", model, "is already context-parallel")
    head = check_head(model)
    if head is not None:
        raise _refuse("", model, head)
    attentions, convs, token_convs, linear = _layers(model, decoder, group, layout, dense)
    hooked = _hooked(model, decoder, attention=bool(attentions))
    apply_inputs(model, decoder, hooked, group, validate, layout, isolate_documents)
    paths = (
        apply_attention(decoder, attentions)
        | apply_short_conv(convs, group, layout)
        | apply_token_conv(token_convs, group, layout)
        | apply_linear_attention(linear, group, layout)
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
    token_convs = [module for module in decoder.modules() if is_token_conv(module) or is_ple(module)]
    hooked = list(dict.fromkeys([model.base_model, decoder]))
    if not (linear or token_convs) or not (isolates_documents(hooked) if isolates is None else isolates):
        return model
    if getattr(model, "cp_transport_paths", None) is not None:
        raise _refuse("", model, "is already parallelized")
    for module in hooked:
        hook = OneRankDocuments(module, id(model))
        module.register_forward_pre_hook(hook, with_kwargs=True)
        module.register_forward_hook(hook.done, with_kwargs=True, always_call=True)
    model.cp_transport_paths = {
        type(module).__name__: f"{apply_recurrent(module, None, 'contiguous')}: each packed document from "
        "zero, as under CP"
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
    return forward, _in_context(RUNNING.context, recompute)


@contextmanager
def _in_context(context, inner):
    outer, RUNNING.context = RUNNING.context, context
    try:
        with inner:
            yield
    finally:
        RUNNING.context = outer
