"""Which kind of token-mixing layer each module of a model is, or why CP cannot make it exact:
`walk` goes over the model once before anything changes (its attention modules with their setups,
short convs, token-dependent convs and PLE layers, recurrences; each module's kind from `_kind`) and
`_check_configs` refuses what the configs say that the walk cannot see. torch_impl.hf.parallelize
then makes each kind CP, as its table says: TOKEN_CONVS here (the token-dependent convs),
torch_impl.hf.recurrent.RECURRENCES (recurrences and short convs) and
torch_impl.hf.attention_kinds.ATTENTIONS (attention layers with parts of their own)."""

import re
import sys

from torch import nn
from transformers import PreTrainedConfig
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from torch_impl.hf._common import INDEXED, LINEAR, SLIDING, mix
from torch_impl.hf.attention import AttentionSetup, CrossAttention, temperature_scale
from torch_impl.hf.attention_kinds import attention_kind, layer_type
from torch_impl.hf.block_sparse import BLOCK_SPARSE
from torch_impl.hf.compressed import COMPRESSED
from torch_impl.hf.documents import Packed
from torch_impl.hf.inkling import TokenConvHalo, is_relative, is_token_conv
from torch_impl.hf.ple import PLEHalo, is_ple
from torch_impl.hf.recurrent import CONV, KERNELS, Recurrence, is_known, is_short_conv, recurrence_of

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
# cross-attention modules whose keys and values come from outside the sequence CP splits, each
# rank holding them whole (torch_impl.hf.media.CROSS: Mllama's images' states), by class
CROSS_ATTENTION = ("MllamaTextCrossAttention",)
RECURRENT_LAYER_TYPES = ("mamba", "mamba2", "recurrent")
RECURRENCE = "carries recurrent state along the sequence, which CP cannot split exactly"
# sub-configs of the encoders of other inputs than text, and of what resamples their features
TOWERS = re.compile(r"vision|audio|image|video|speech|visual|vq|protein|qformer|perceiver")


def _mixed(cls):
    """Making a module CP by mixing `cls` (its own forward per local chunk) into its class, with the
    forward's packed documents and the layout."""

    def apply(module, group, layout):
        mix(module, cls).cp_packed = Packed(group)
        module.cp_layout = layout

    return apply


# the token-dependent convs, each run per chunk over the rows before it (the walk's "token_conv")
TOKEN_CONVS = (
    Recurrence(
        "Qwen4's per-layer embeddings",
        is_ple,
        _mixed(PLEHalo),
        "its own forward per chunk over the (kernel - 1) * dilation rows before it, given the n-grams' ids "
        "before those",
    ),
    Recurrence(
        "Inkling2's token-dependent conv",
        is_token_conv,
        _mixed(TokenConvHalo),
        "its own forward per chunk over a halo of kernel - 1 inputs",
    ),
)


def token_conv_of(module):
    """The first TOKEN_CONVS kind that recognises `module`, else None."""
    return next((kind for kind in TOKEN_CONVS if kind.recognise(module)), None)


def _unsupported(layer_types):
    """Why layers of these types are refused: the recurrence named where they are one."""
    if any(t in RECURRENT_LAYER_TYPES for t in layer_types):
        return f"{RECURRENCE} ({layer_types} layers)"
    return f"has {layer_types} layers, a kind the adapter does not know (supported: {SUPPORTED_LAYER_TYPES})"


def refuse(name, module, why):
    return ValueError(f"torch_impl.hf: {name or 'the model'} ({type(module).__name__}) {why}")


def _check_configs(model, towers, allowed=()):
    """Model-wide refusals, from the model's config and its sub-models' but its non-text encoders'
    (a catch-all after the walk; `allowed`: the layer types of the modules it recognised beyond
    SUPPORTED_LAYER_TYPES)."""
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if not isinstance(config, PreTrainedConfig) or id(config) in towers:
            continue
        if getattr(config, "is_encoder_decoder", False):
            raise refuse(name, module, "is an encoder-decoder model: cross attention is not supported")
        if getattr(config, "attention_chunk_size", None) and getattr(config, "sliding_window", None):
            raise refuse(
                name,
                module,
                "has both chunked and sliding-window attention, which its masks cannot tell apart",
            )
        layer_types = set(getattr(config, "layer_types", None) or ())
        unsupported = sorted(layer_types - set(SUPPORTED_LAYER_TYPES) - set(allowed))
        if unsupported:
            raise refuse(name, module, _unsupported(unsupported))
        if INDEXED in layer_types and not layer_types <= {INDEXED, LINEAR, SLIDING}:  # Qwen4's, dots3's
            others = sorted(layer_types - {INDEXED, LINEAR, SLIDING})
            raise refuse(name, module, f"mixes {INDEXED!r} layers with {others}")


def _kind(name, module, family=""):
    """'attention', 'cross_attention' (CROSS_ATTENTION: keys every rank holds whole), 'short_conv',
    'token_conv' (Inkling2's, Qwen4's PLE), 'recurrent', or None for a
    module that mixes no tokens itself; ValueError for a module that mixes them in a way CP cannot
    reproduce exactly. `family`: a class-name prefix that names no recurrence (RecurrentGemma's,
    whose MLP, norm and rotary embedding are RecurrentGemma*)."""
    typed = layer_type(module)
    known = (*SUPPORTED_LAYER_TYPES, HYBRID, *(RELATIVE_LAYER_TYPES if is_relative(module) else ()))
    if typed is not None and typed not in known:
        raise refuse(name, module, _unsupported([typed]))
    if type(module).__name__ in REFUSED_ATTENTION:
        raise refuse(name, module, REFUSED_ATTENTION[type(module).__name__])
    if type(module).__name__ in CROSS_ATTENTION:
        return "cross_attention"
    if hasattr(module, "is_causal") and hasattr(module, "config"):  # transformers' attention modules
        if not module.is_causal or getattr(module, "is_cross_attention", False):
            raise refuse(
                name, module, "is bidirectional or cross attention; only causal attention is supported"
            )
        return "attention"
    if type(module).__name__ in SHORT_CONVS:
        if not is_short_conv(module):
            raise refuse(name, module, f"does not call `{CONV}` over its own depthwise `conv`")
        if recurrence_of(module).why(module):
            raise refuse(name, module, recurrence_of(module).why(module))
        return "short_conv"
    if token_conv_of(module) is not None:
        return "token_conv"
    if is_known(module):
        if recurrence_of(module).why(module):
            raise refuse(name, module, recurrence_of(module).why(module))
        return "recurrent"
    name_ = type(module).__name__
    if (
        RECURRENT.search(name_.removeprefix(family))
        and not name_.endswith("Norm")
        and not any(map(is_known, module.modules()))
    ):
        raise refuse(name, module, RECURRENCE)  # (a layer holding a linear attention it knows is not)
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        raise refuse(name, module, "is a convolution over the sequence that the adapter does not know")
    return None


def _attention_setup(name, module, group, layout, dense=False):
    kind = attention_kind(module)
    if kind is not None and kind.why(module):
        raise refuse(name, module, kind.why(module))
    implementation = module.config._attn_implementation
    if implementation == "sdpa":
        attend = ALL_ATTENTION_FUNCTIONS["sdpa"]
    elif implementation == "eager":
        attend = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if attend is None:
            raise refuse(name, module, "uses eager attention but its module has no eager_attention_forward")
    else:
        raise refuse(
            name,
            module,
            f"uses attention {implementation!r}; only 'sdpa' and 'eager' take the global query and key "
            "offsets of a CP rank (flash kernels align causal masks bottom-right)",
        )
    reason = "parallelize(dense=True)" if dense and layer_type(module) != INDEXED else None
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


def walk(model, decoder, group, layout, dense=False):
    """(attention modules with their setups, short convs, token-dependent convs, linear-attention
    modules): every token-mixing module, or ValueError."""
    if not type(model)._can_set_attn_implementation():
        raise refuse("", model, "does not route its attention through transformers' AttentionInterface")
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
            raise refuse(name, module, "reads an attention config other than its language model's")
        if kind == "attention":
            attentions.append((module, _attention_setup(name, module, group, layout, dense)))
        elif kind == "cross_attention":  # the model's own math over keys every rank holds whole
            attentions.append((module, CrossAttention(_attention_setup(name, module, group, layout).attend)))
        elif kind is not None:
            whole[kind][name] = module
    relative = any(is_relative(module) for module, _ in attentions)
    allowed = ((HYBRID,) if whole["recurrent"] else ()) + (RELATIVE_LAYER_TYPES if relative else ())
    _check_configs(model, towers, allowed)
    linear = list(getattr(decoder.config, "layer_types", None) or ()).count("linear_attention")
    if linear > len(whole["recurrent"]):  # a linear attention the walk did not recognise
        raise refuse(
            "",
            model,
            f"{RECURRENCE}: {linear} 'linear_attention' layers, of which {len(whole['recurrent'])} are "
            f"Gated DeltaNet, KDA, Mamba2 or Mamba modules calling the kernels {sorted(KERNELS)} or "
            "MiniMax's lightning attention",
        )
    convs = [*whole["short_conv"].values()], [*whole["token_conv"].values()]
    return attentions, *convs, list(whole["recurrent"].values())
