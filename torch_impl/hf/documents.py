"""Whether a model isolates packed documents in one process: the rule CP must follow.

transformers isolates the documents of a packed row (position_ids restarting, no attention_mask, no
cache) only where the model hands its mask functions (`create_causal_mask`, ...) the position_ids:
Llama, Mistral, Gemma, LFM2, DeepSeek V3.2 and GLM-5 do; GPT-OSS (and Bloom, Falcon, MPT, ...) do
not, and in one process their tokens attend across documents. A rank cannot tell from its own mask
call (transformers looks for restarts in the rank's own positions, which a shard inside one document
does not have), and every rank must decide alike (the decision picks each layer's transport), so it
is looked up in `ISOLATES`, by the class of the module that receives the inputs (its base model or
language model), or given to `parallelize(isolate_documents=...)`. A class outside the table (a new
family) gets packed rows refused until it is added: `make models` runs every family's packed rows
against one process, so a wrong entry shows there as a wrong family.
"""

from functools import partial

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from torch_impl.hf import upstream
from torch_impl.hf._common import RUNNING, Arguments, Aside, Context, stepping_aside
from torch_impl.layout import Documents, ShardPlan, document_starts, packed_ids

_ISOLATING = """
    AXK1Model AXK2Model ApertusModel ArceeModel AriaTextModel BailingHybridModel BambaModel
    BeamModel BitNetModel BltModel CTRLModel CodeGenModel Cohere2Model Cohere2MoeModel
    CohereCompassTextModel CohereModel CwmModel DbrxModel DeepseekV2Model DeepseekV32Model
    DeepseekV3Model DeepseekV4Model DiffLlamaModel DogeModel Dots1Model Dots3NoteTextModel
    Emu3TextModel Ernie4_5Model Ernie4_5_MoeModel Exaone4Model ExaoneMoeModel FalconH1Model
    FlexOlmoModel FlintModel GPT2Model GPTBigCodeModel GPTJModel GPTNeoModel
    GPTNeoXJapaneseModel GPTNeoXModel Gemma2Model Gemma3Model Gemma3TextModel Gemma3nTextModel
    Gemma4Model Gemma4TextModel Gemma4UnifiedModel Gemma4UnifiedTextModel GemmaModel Glm4Model
    Glm4MoeLiteModel Glm4MoeModel GlmModel GlmMoeDsaModel GraniteModel GraniteMoeModel
    GraniteMoeSWAModel GraniteMoeSharedModel GraniteSWAModel HYV3Model HYV4Model HeliumModel
    HrmTextModel HunYuanDenseV1Model HunYuanMoEV1Model HyperCLOVAXModel Inkling2TextModel
    InklingTextModel Jais2Model JambaModel JetMoeModel KimiLinearModel Kolibri1Model LagunaModel
    Lfm2Model Lfm2MoeModel Lfm3Model Llama4TextModel LlamaModel LongcatFlashModel MellumModel
    MiMoV2FlashModel MiniCPM3Model MiniMaxM2Model MiniMaxM3VLTextModel MiniMaxModel
    Ministral3Model MinistralModel MistralModel MixtralModel MllamaTextModel
    ModernBertDecoderModel MoshiModel NanoChatModel NemotronHModel NemotronModel Olmo2Model
    Olmo3Model OlmoHybridModel OlmoModel OlmoeModel PersimmonModel Phi3Model Phi4MultimodalModel
    PhiModel PhimoeModel Qwen2Model Qwen2MoeModel Qwen3Model Qwen3MoeModel Qwen3NextModel
    Qwen3_5MoeTextModel Qwen3_5TextModel Qwen4ExpTextModel RecurrentGemmaModel SeedOssModel
    SmolLM3Model SolarOpenModel StableLmModel Starcoder2Model VaultGemmaModel WhisperDecoder
    YoutuModel Zamba2Model ZambaModel ZayaModel
"""
_NOT_ISOLATING = """
    AfmoeModel BertGenerationEncoder BertModel BigBirdModel BioGptModel BloomModel
    CamembertModel Data2VecTextModel ElectraModel ErnieModel FalconModel GptOssModel
    FalconMambaModel GraniteMoeHybridModel Mamba2Model MambaModel MegatronBertModel MptModel
    OPTDecoder RemBertModel RoCBertModel
    RoFormerModel RobertaModel RobertaPreLayerNormModel XGLMModel XLMRobertaModel
    XLMRobertaXLModel XmodModel xLSTMModel
"""
# transformers 5.23.0's model classes that receive a causal LM's inputs -> whether they isolate
ISOLATES = dict.fromkeys(_ISOLATING.split(), True) | dict.fromkeys(_NOT_ISOLATING.split(), False)


def isolates_documents(modules):
    """Whether the model whose inputs `modules` (outer first) receive isolates packed documents in
    one process: the first of their classes in ISOLATES (a subclass of a transformers class: that
    class's entry); None when none is listed. ValueError where the installed transformers' rule
    for packed rows, which the table's entries stand on, is not the recorded release's
    (torch_impl.hf.upstream)."""
    upstream.check("torch_impl.hf.documents.ISOLATES")
    for module in modules:
        for cls in type(module).__mro__:
            if cls.__module__.startswith("transformers."):
                if cls.__name__ in ISOLATES:
                    return ISOLATES[cls.__name__]
                break
    return None


class OneRankDocuments:
    """Without CP (one rank), a forward pre-hook on the module receiving the inputs of a model
    with linear-attention layers that isolates packed documents, so that those layers keep the
    documents apart as they do under CP (Packed), where transformers' torch
    kernels would carry the state across them. Packed rows (position_ids, no attention_mask, no
    cache: transformers' rule for isolating them) get a Context holding their documents; any other
    call runs as the model does (Aside: the model's own kernels). Nothing is communicated."""

    def __init__(self, module, owner):
        self.arguments, self.owner, self.outer = Arguments(module.forward), owner, []

    def __call__(self, module, args, kwargs):
        current = RUNNING.context
        if current is not None and current.owner == self.owner:  # an outer hooked module prepared it
            return None
        argument = partial(self.arguments.get, args, kwargs)
        positions, tokens = argument("position_ids"), argument("input_ids")
        tokens = argument("inputs_embeds") if tokens is None else tokens
        packed = (
            positions is not None
            and positions.dim() == 2
            and argument("attention_mask") is None
            and argument("past_key_values") is None
            and not creates_cache(module, argument)
        )
        self.outer.append(current)
        if packed:
            (B, L) = tokens.shape[:2]
            ids = packed_ids(positions.expand(B, -1))
            documents = Documents(ids, None, document_starts(ids))  # their starts, once a forward
            shard = ShardPlan.of("contiguous", 1, 0, L)
            RUNNING.context = Context(self.owner, None, shard, documents, None, None, None)
        else:
            RUNNING.context = Aside(self.owner, None)
        return None

    def done(self, module, args, kwargs, output):
        """The forward hook (always called): the context this forward's pre-hook set is unset."""
        if self.outer:
            RUNNING.context = self.outer.pop()


def creates_cache(module, argument):
    """Whether the model will make itself a KV cache in this call, as transformers decides (its
    `merge_with_config_defaults`: use_cache, else the config's, off while checkpointing in training);
    with one it does not look for packed sequences."""
    use_cache = argument("use_cache")
    use_cache = getattr(module.config, "use_cache", False) if use_cache is None else use_cache
    return bool(use_cache) and not (getattr(module, "gradient_checkpointing", False) and module.training)


class Packed:
    """Packed documents in a recurrent layer: a document start resets the state and the conv reads
    nothing before it, as if each document ran alone. The documents are the forward's (its
    Context, built from the gathered positions where the model isolates packed documents:
    torch_impl.hf.documents). Under activation checkpointing the recomputation finds the forward's
    Context again through hf.checkpoint_kwargs()'s context_fn; recomputed without it, a layer that
    saw documents in its forward raises rather than mix them."""

    def __init__(self, group):
        self.group = group
        self.seen = False  # whether this layer has run a forward with packed documents

    def aside(self):
        """Whether the call runs as the model does (its own kernels): an unsharded (Aside) forward,
        or without CP one recomputed outside any forward's context (a one-rank model's forwards
        without packed documents are Aside ones)."""
        if stepping_aside():
            return True
        return self.group is None and RUNNING.context is None and not self.seen

    def first_rows(self):
        """int64 [B, S] by global row: the first row of each token's document (None: no documents)."""
        context = RUNNING.context
        if context is None:
            if self.seen:
                raise ValueError(
                    "torch_impl.hf: a recurrent layer that has been given packed documents was recomputed "
                    "under activation checkpointing without hf.checkpoint_kwargs() (its context_fn carries "
                    "the documents into the recomputation); enable checkpointing with those kwargs"
                )
            return None
        documents = getattr(context, "documents", None)
        if (
            documents is not None and not torch.compiler.is_compiling()
        ):  # compiled, the recomputation is traced
            self.seen = True
        return None if documents is None else documents.first_rows()


# --- a recurrent layer's chunk in pieces, each document from zero ---------------------------------


def pieces(first, start, stop):
    """For the global rows [start, stop) of each batch row: bool [B, T] whether a token's document
    began before `start` (the state coming in reaches it), and per row the pieces [lo, hi) (local
    to the rows) that run from zero, cut where a document begins; None where no document begins
    in them (one piece per row, every token reached). `first`: Packed.first_rows(), or None."""
    if first is None:
        return None
    first = first[:, start:stop]  # [B, T]
    carried = first < max(start, 1)  # the sequence's first chunk: its first document takes the zero state
    begins = first == torch.arange(start, stop, device=first.device)  # [B, T]
    begins[:, 0] = True
    if carried.all():
        return None
    cuts = [[t for t, b in enumerate(row) if b] + [stop - start] for row in begins.tolist()]
    return carried, [list(zip(row[:-1], row[1:], strict=True)) for row in cuts]


def by_piece(run, runs, dim):
    """Each row's pieces run alone from zero (`run(b, lo, hi, first)` -> (outputs [1, ...],
    final state [1, ...]); `first`: the row's first piece), the outputs concatenated along `dim`
    and the last piece's final state, stacked over the rows."""
    outs, finals = [], []
    for b, row in enumerate(runs):
        parts = [run(b, lo, hi, i == 0) for i, (lo, hi) in enumerate(row)]
        outs.append(torch.cat([out for out, _ in parts], dim=dim))
        finals.append(parts[-1][1])
    return torch.cat(outs), torch.cat(finals)


def conv_by_document(x, weight, bias, w, first, activation=None):
    """A causal depthwise conv (weight [C, K], bias [C] or None, then `activation`, as transformers'
    `causal_conv1d_fn`) over one local chunk's segment x [B, C, T] (the window w's halo, then the
    chunk) whose outputs read nothing before their document's start: each tap masked where it
    would read an earlier document (no host read, no branch: it compiles as one graph). The
    chunk's outputs, [B, C, w.end - w.start]."""
    K, T = weight.shape[-1], w.end - w.first_key
    x = x[..., -T:]  # [B, C, T]: global rows [first_key, end)
    dtype = torch.promote_types(weight.dtype, torch.float32)  # summed as F.conv1d accumulates
    taps = F.pad(x.to(dtype), (K - 1, 0)).unfold(-1, K, 1)  # [B, C, T, K]: tap j reads t - K + 1 + j
    rows = torch.arange(w.first_key, w.end, device=x.device)  # [T]
    read = rows[:, None] - (K - 1) + torch.arange(K, device=x.device)  # [T, K]: the global row each tap reads
    keep = read[None] >= first[:, w.first_key : w.end, None]  # [B, T, K]: within the output's document
    out = (taps * keep[:, None] * weight.to(dtype)[:, None, :]).sum(dim=-1)  # [B, C, T]
    out = (out if bias is None else out + bias.to(dtype)[:, None]).to(weight.dtype)
    out = ACT2FN[activation](out) if activation is not None else out
    return out[..., -(w.end - w.start) :].to(x.dtype)
